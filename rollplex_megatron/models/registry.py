"""The model registry: one `ModelSpec` (models/spec.py) per model family, and the lookups the package uses.

`model_spec(cfg)` gives the family of a model config (`model.family`); `open_hf(path)` opens a Hugging Face
checkpoint with the family its config.json's `model_type` names. Adding a family: a package `models/<family>/`
whose `spec.py` fills every field of `ModelSpec`, one entry in `FAMILIES`, and presets that set `family:`
(docs/design.md section 4).
"""
from __future__ import annotations

import os
from pathlib import Path

from rollplex_megatron.checkpoint.files import check_model_type, read_json
from rollplex_megatron.config import ModelConfig
from rollplex_megatron.models.qwen25vl.spec import SPEC as QWEN2_5_VL
from rollplex_megatron.models.qwen3vl.spec import SPEC as QWEN3_VL
from rollplex_megatron.models.spec import ModelSpec

FAMILIES: dict[str, ModelSpec] = {s.family: s for s in (QWEN2_5_VL, QWEN3_VL)}
DEFAULT_FAMILY = QWEN2_5_VL.family  # reads a checkpoint whose model_type no family claims, to name the problem


def family_spec(family: str) -> ModelSpec:
    """The registered family `family`; an unknown name is a ValueError naming `model.family` and the choices."""
    if family not in FAMILIES:
        raise ValueError(f"model.family={family!r} is not a registered model family; set one of "
                         f"{', '.join(FAMILIES)} (models/registry.py)")
    return FAMILIES[family]


def model_spec(cfg: ModelConfig) -> ModelSpec:
    """The family of a model config (`model.family`)."""
    return family_spec(cfg.family)


def hf_family(raw_config) -> ModelSpec:
    """The family whose HF layout reads a config.json dict with this `model_type` (the default family for an
    unknown one: its reader refuses it with the supported types listed)."""
    mt = raw_config.get("model_type") if isinstance(raw_config, dict) else None
    return next((s for s in FAMILIES.values() if mt in s.hf.model_types), FAMILIES[DEFAULT_FAMILY])


def open_hf(path: str | os.PathLike):
    """A Hugging Face checkpoint directory, opened lazily by the family its config.json names."""
    config = Path(path) / "config.json"
    raw = read_json(config) if config.is_file() else {}
    if isinstance(raw, dict) and raw.get("model_type") is not None:  # an unknown type: every family's listed
        check_model_type(raw, str(config), {k: v for s in FAMILIES.values() for k, v in s.hf.model_types.items()})
    return hf_family(raw).hf.checkpoint(path)
