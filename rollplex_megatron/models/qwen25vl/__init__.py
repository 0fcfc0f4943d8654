"""Qwen2.5-VL on megatron-core."""
from rollplex_megatron.models.qwen25vl.model import Qwen25VLModel, build_model, gather_vocab_logits

__all__ = ["Qwen25VLModel", "build_model", "gather_vocab_logits"]
