"""The `rollplex` trainer for verl's v1 driver (`trainer.use_v1=true trainer.v1.trainer_mode=rollplex`).

It runs the phases of verl's synchronous trainer (`PPOTrainerSync`: rollout, reward, old and reference
log-probs, advantages, actor update, weight update) unchanged; with the `rollplex` engine
(`VERL_ENGINE_VENDOR=rollplex`) the log-prob and update phases compute each group's prompt once. Moving the
reference prefix stage into the rollout's decode window needs the SGLang bridge inside verl's SGLang server
replicas, which this trainer does not start yet: it refuses `ROLLPLEX_SGLANG_BRIDGE` instead of running
without it silently.
"""
from __future__ import annotations

import logging
import os

from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from rollplex_megatron.rollout.sglang.protocol import ENV_ADDRESS

log = logging.getLogger(__name__)
NAME = "rollplex"


class RollplexTrainer(PPOTrainerSync):
    """verl's synchronous PPO trainer with the Rollplex engine's checks (see the module docstring).

    verl's trainer base branches on the mode's name (`self.trainer_mode == "sync"`: the replay buffer, the
    prompt refill, TransferQueue checkpoints), not on the class; this trainer reads as `sync` there, so it
    has exactly the sync trainer's behaviour, while `trainer.v1.trainer_mode=rollplex` selects it."""

    @property
    def trainer_mode(self) -> str:
        return "sync"

    @trainer_mode.setter
    def trainer_mode(self, value: str) -> None:  # PPOTrainer.__init__ assigns the configured name
        if value not in (NAME, "sync"):
            raise ValueError(f"RollplexTrainer under trainer.v1.trainer_mode={value!r}")

    def on_init_end(self):
        if os.environ.get(ENV_ADDRESS):
            raise RuntimeError(f"trainer.v1.trainer_mode={NAME}: {ENV_ADDRESS} is set, but the decode-window path "
                               f"through verl's SGLang replicas is not built yet; unset it (the prefix sharing of "
                               f"the rollplex engine works without it)")
        vendor = os.environ.get("VERL_ENGINE_VENDOR")
        if vendor != "rollplex":
            log.warning("trainer.v1.trainer_mode=%s with VERL_ENGINE_VENDOR=%r: verl's own engine computes every "
                        "response's prompt again; set VERL_ENGINE_VENDOR=rollplex", NAME, vendor)
        super().on_init_end()


def register() -> None:
    """Idempotent: `register_trainer` refuses a second class under a taken name, not the same one."""
    register_trainer(NAME)(RollplexTrainer)
