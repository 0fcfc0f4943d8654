"""Compatibility layer: CPU shims for megatron-core and version checks."""
from rollplex_megatron.compat.cpu import applied_shims, apply_cpu_shims

__all__ = ["apply_cpu_shims", "applied_shims"]
