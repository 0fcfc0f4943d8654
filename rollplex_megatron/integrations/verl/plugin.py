"""verl's entry point (`verl.plugins: rollplex`): imported by `import verl` in every process, Ray workers
included. Registers the engine (vendor `rollplex`, selected with `VERL_ENGINE_VENDOR=rollplex`) and the v1
trainer `rollplex`. verl swallows plugin import errors (debug log), so each part logs its own failure."""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)
VENDOR = "rollplex"


def register_engine() -> None:
    from verl.workers.engine.base import EngineRegistry

    from rollplex_megatron.integrations.verl.engine import RollplexMegatronEngine

    reg = EngineRegistry._engines.get("language_model", {}).get("megatron", {})
    todo = [d for d in ("cuda", "cpu") if reg.get((d, VENDOR)) is not RollplexMegatronEngine]
    if todo:
        EngineRegistry.register(model_type="language_model", backend="megatron", device=todo,
                                vendor=VENDOR)(RollplexMegatronEngine)


def register_all() -> None:
    for what, fn in (("engine", register_engine), ("trainer", _register_trainer)):
        try:
            fn()
        except Exception as e:  # verl would hide it: say it at warning level
            log.warning("rollplex verl plugin: registering the %s failed: %s: %s", what, type(e).__name__, e)


def _register_trainer() -> None:
    from rollplex_megatron.integrations.verl.trainer import register

    register()


register_all()
