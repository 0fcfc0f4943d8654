"""verl's entry point (`verl.plugins: rollplex`): imported by `import verl` in every process, Ray workers
included. Registers the CPU platform (`platform.py`: used where no accelerator exists), the engine (vendor
`rollplex`, selected with `VERL_ENGINE_VENDOR=rollplex`), the v1 trainer `rollplex`, the rollout backend
`rollplex` (`rollout.py`: `actor_rollout_ref.rollout.name=rollplex`), a Qwen2-VL video processor without
torchvision (`video.py`), and, where the installed verl has verl issue #7899, a layout-checking
`maybe_fix_3d_position_ids` (`positions.py`: batches whose samples have one length train). verl swallows plugin
import errors (debug log), so each part logs its own failure."""
from __future__ import annotations

import importlib
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
    # the platform first: the others' imports may ask verl for its platform, which it then resolves for good
    for what, fn in (("platform", _register_platform), ("engine", register_engine), ("trainer", _register_trainer),
                     ("rollout", _register_rollout), ("video processor", _register_video_processor),
                     ("position ids fix", _register_position_fix)):
        try:
            fn()
        except Exception as e:  # verl would hide it: say it at warning level
            log.warning("rollplex verl plugin: registering the %s failed: %s: %s", what, type(e).__name__, e)


def _register_platform() -> None:
    from rollplex_megatron.integrations.verl.platform import register

    register()


def _register_rollout() -> None:
    # the module registers itself when its import ends: a process that imports it first (Ray unpickling the
    # server) reaches this plugin through the module's own `import verl`, half-initialised
    importlib.import_module("rollplex_megatron.integrations.verl.rollout")


def _register_video_processor() -> None:
    from rollplex_megatron.integrations.verl.video import register

    register()


def _register_position_fix() -> None:
    from rollplex_megatron.integrations.verl.positions import install

    install()


def _register_trainer() -> None:
    from rollplex_megatron.integrations.verl.trainer import register

    register()


register_all()

