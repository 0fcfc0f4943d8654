"""Rollplex-Megatron: cross-phase GPU sharing for VLM RL post-training on Megatron-Core."""
__version__ = "0.1.0"
