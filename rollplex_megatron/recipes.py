"""Compose a RunConfig from the Hydra recipes (`recipes/`) and command-line overrides."""
from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from rollplex_megatron.config import RunConfig, register_configs
from rollplex_megatron.data import check_source
from rollplex_megatron.models.qwen25vl.model import check_megatron_overrides
from rollplex_megatron.rollout.window import check_mechanism
from rollplex_megatron.trainer.modes import get_mode

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


def compose_config(overrides: list[str] | None = None, config_name: str = "config"):
    """The resolved OmegaConf config for `overrides` (unknown keys are rejected by the schema)."""
    if not RECIPES_DIR.is_dir():
        raise FileNotFoundError(f"recipes folder not found at {RECIPES_DIR}; install the package editable "
                                f"(pip install -e .)")
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(RECIPES_DIR), version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides or []))


def check_closed(node, schema: type, path: str = "") -> None:
    """Unknown keys anywhere in `node` are errors, whatever form added them (`+key=` included:
    Hydra opens the struct flag for it and `to_object` would drop the key silently)."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key in node.keys():
        name = f"{path}{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean {path}{close[0]}?" if close else ""
            raise ValueError(f"unknown config key {name!r}: {schema.__name__} has no field {key!r}{hint} "
                             f"(`rollplex print-config` lists every key)")
        sub = fields[key].type
        value = node._get_node(key)
        if OmegaConf.is_dict(value) and isinstance(sub, str):
            sub = getattr(value, "_metadata").object_type
        if OmegaConf.is_dict(value) and dataclasses.is_dataclass(sub):
            check_closed(value, sub, f"{name}.")


def load_run_config(overrides: list[str] | None = None) -> RunConfig:
    """A validated RunConfig (cross-field checks run here, before any heavy work)."""
    cfg = compose_config(overrides)
    check_closed(cfg, RunConfig)
    run = OmegaConf.to_object(cfg)
    check_registered(run)
    return run


def check_registered(cfg: RunConfig) -> None:
    """Names that select a registered strategy (config.py knows no registry: it imports nothing above it)."""
    get_mode(cfg.mode.name)
    check_source(cfg.data.source)
    check_megatron_overrides(cfg.model, cfg.megatron)
    check_mechanism(cfg.mode.window, cfg.parallel.tp, cfg.parallel.pp)


def to_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML (printed by every command)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
