"""Data sources: a registry keyed by `data.source` (the contract is `source.py`)."""
from __future__ import annotations

from rollplex_megatron.config import RunConfig
from rollplex_megatron.data.dataset import DatasetSource
from rollplex_megatron.data.rendered import RenderedTask
from rollplex_megatron.data.source import DataSource, Row, Score

SOURCES = {"rendered": RenderedTask, "dataset": DatasetSource}

__all__ = ["SOURCES", "DataSource", "Row", "Score", "build_source", "check_source", "source_name"]


def check_source(name: str) -> None:
    """`data.source` names a registered source (or `auto`)."""
    if name != "auto" and name not in SOURCES:
        raise ValueError(f"data.source must be auto or one of {tuple(SOURCES)}, got {name!r}")


def source_name(cfg: RunConfig) -> str:
    """The source the run uses: `data.source`, where `auto` means dataset when `data.train_files` are given."""
    check_source(cfg.data.source)
    return cfg.data.resolved_source


def build_source(cfg: RunConfig) -> DataSource:
    """The run's data source (bad input in its settings fails here, before any model is built)."""
    return SOURCES[source_name(cfg)](cfg)
