"""The registry of execution modes: a new mode is one file in this folder plus one line here."""
from __future__ import annotations

from rollplex_megatron.trainer.modes.base import Mode
from rollplex_megatron.trainer.modes.disaggregated import Disaggregated
from rollplex_megatron.trainer.modes.prefix_shared import PrefixShared
from rollplex_megatron.trainer.modes.rollplex import Rollplex
from rollplex_megatron.trainer.modes.serial import Serial

MODES: dict[str, type[Mode]] = {m.name: m for m in (Serial, PrefixShared, Rollplex, Disaggregated)}


def get_mode(name: str) -> type[Mode]:
    """The mode class registered under `name`; a clear error naming the setting otherwise."""
    if name not in MODES:
        raise ValueError(f"mode.name must be one of {tuple(MODES)}, got {name!r}")
    return MODES[name]
