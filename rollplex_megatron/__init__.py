"""Rollplex-Megatron: cross-phase GPU sharing for VLM RL post-training on Megatron-Core.

The public API for your own megatron-core model and loop is `rollplex_megatron.api`; its names are
also reachable here (`rollplex_megatron.PrefixGPT`, ...), loaded on first use so that importing a
submodule (the config, the CLI) does not load megatron-core.
"""
import importlib

__version__ = "0.1.0"

_API = ("with_prefix_attention", "PrefixGPT", "TEXT_POSITIONS", "text_groups", "Group", "Prompt",
        "response_micro_batches", "full_micro_batches", "actor_prefix_step", "reference_prefix_logprobs",
        "full_sequence_step", "prefix_forward", "run_schedule", "prefix_backward", "finalize", "KVStore",
        "PrefixContext")
__all__ = list(_API)


def __getattr__(name: str):
    """PEP 562: the public API's names, from `rollplex_megatron.api`."""
    if name in _API:
        return getattr(importlib.import_module("rollplex_megatron.api"), name)
    raise AttributeError(f"module 'rollplex_megatron' has no attribute {name!r}")
