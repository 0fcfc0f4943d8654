"""Compatibility layer: CPU shims for megatron-core, and the warnings we deliberately silence."""
import warnings

from rollplex_megatron.compat.cpu import applied_shims, apply_cpu_shims


def quiet_known_warnings() -> None:
    """Silence megatron-core's import-time notices that TE/apex are absent.

    docs/getting-started/install.md's dependency table says what runs where; `smoke` records it in its summary.
    """
    for pat in ("Transformer Engine and Apex are not installed", "Apex is not installed",
                "full scope is deprecated"):
        warnings.filterwarnings("ignore", message=pat)


__all__ = ["apply_cpu_shims", "applied_shims", "quiet_known_warnings"]
