"""Compose a RunConfig from the Hydra recipes (`recipes/`) and command-line overrides."""
from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from rollplex_megatron.config import RunConfig, register_configs

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


def compose_config(overrides: list[str] | None = None, config_name: str = "config"):
    """The resolved OmegaConf config for `overrides` (unknown keys are rejected by the schema)."""
    if not RECIPES_DIR.is_dir():
        raise FileNotFoundError(f"recipes folder not found at {RECIPES_DIR}; install the package editable (pip install -e .)")
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(RECIPES_DIR), version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides or []))


def load_run_config(overrides: list[str] | None = None) -> RunConfig:
    """A validated RunConfig (cross-field checks run here, before any heavy work)."""
    return OmegaConf.to_object(compose_config(overrides))


def to_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML (printed by every command)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
