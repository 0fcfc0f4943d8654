"""Data sources: a registry keyed by `data.source` (the contract is `source.py`)."""
from __future__ import annotations

from rollplex_megatron.config import RunConfig
from rollplex_megatron.data.rendered import RenderedTask
from rollplex_megatron.data.source import DataSource, Row, Score

SOURCES = {"rendered": RenderedTask}

__all__ = ["SOURCES", "DataSource", "Row", "Score", "build_source", "check_source"]


def check_source(name: str) -> None:
    """`data.source` names a registered source."""
    if name not in SOURCES:
        raise ValueError(f"data.source must be one of {tuple(SOURCES)}, got {name!r}")


def build_source(cfg: RunConfig) -> DataSource:
    """The run's data source (bad input in its settings fails here, before any model is built)."""
    check_source(cfg.data.source)
    return SOURCES[cfg.data.source](cfg)
