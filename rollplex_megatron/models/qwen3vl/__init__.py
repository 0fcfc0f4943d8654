"""Qwen3-VL (dense) on megatron-core."""
from rollplex_megatron.models.qwen3vl.model import Qwen3VLModel, build_model

__all__ = ["Qwen3VLModel", "build_model"]
