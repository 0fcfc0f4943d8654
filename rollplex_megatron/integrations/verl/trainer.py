"""The `rollplex` trainer for verl's v1 driver (`trainer.use_v1=true trainer.v1.trainer_mode=rollplex`).

It runs the phases of verl's synchronous trainer (`PPOTrainerSync`: rollout, reward, old and reference
log-probs, advantages, actor update, weight update) unchanged; with the `rollplex` engine
(`VERL_ENGINE_VENDOR=rollplex`) the log-prob and update phases compute each group's prompt once. Moving the
reference prefix stage into the rollout's decode window needs the SGLang bridge inside verl's SGLang server
replicas, which this trainer does not start yet: it refuses `ROLLPLEX_SGLANG_BRIDGE` instead of running
without it silently.

One phase differs in how, not what: verl's v1 step always balances the batch over DP ranks by sequence
length (`_balance_batch`, whatever `trainer.balance_batch` says), which spreads a uid's rows over ranks, and
each rank then computes that prompt again. This trainer balances whole uids instead (`group_partitions`):
every DP rank gets the same number of rows, as verl's dispatch requires, each uid's rows on one rank and
contiguous. The update is the same either way (the loss is normalised by global counts); only how often a
prompt is computed changes.
"""
from __future__ import annotations

import logging
import os

import torch
from verl.trainer.ppo.padding_utils import upsample_batch_to_divisible_size
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils.seqlen_balancing import calculate_workload, log_seqlen_unbalance

from rollplex_megatron.rollout.sglang.protocol import ENV_ADDRESS

log = logging.getLogger(__name__)
NAME = "rollplex"


def row_uid(key: str) -> str:
    """The uid of a TransferQueue row key (verl's agent loop writes `{uid}_{session}_{index}`)."""
    return key.rsplit("_", 2)[0]


def group_partitions(uids: list[str], workloads: list[float], k: int, loose: list[bool] | None = None
                     ) -> list[list[int]] | None:
    """Row indices in `k` partitions of equal size, each uid's rows in one partition (together, in row order),
    partition workloads balanced greedily: heaviest group first, into the lightest partition with room.
    `loose` rows (verl's padding samples) are placed one by one. None when the groups do not fit."""
    if len(uids) % k:
        return None
    groups: dict = {}
    for i, u in enumerate(uids):
        groups.setdefault(("row", i) if loose and loose[i] else ("uid", u), []).append(i)
    order = sorted(groups.values(), key=lambda rows: (-len(rows), -sum(workloads[i] for i in rows), rows[0]))
    size = len(uids) // k
    parts: list[list[int]] = [[] for _ in range(k)]
    load = [0.0] * k
    for rows in order:
        room = [p for p in range(k) if len(parts[p]) + len(rows) <= size]
        if not room:
            return None
        p = min(room, key=lambda q: (load[q], q))
        parts[p].extend(rows)
        load[p] += sum(workloads[i] for i in rows)
    return parts


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

    def _balance_batch(self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
        """verl's balancing (the same padding to the required multiple, equal rows per DP rank, its metrics) with
        each uid's rows kept on one rank (`group_partitions`); verl's own when the groups cannot be split equally."""
        wg = self.actor_rollout_wg
        if "actor" not in wg._dispatch_info:
            wg._dispatch_info["actor"] = wg._query_dispatch_info("actor")
        dp_size = max(wg._dispatch_info["actor"]) + 1
        batch = upsample_batch_to_divisible_size(batch, self._get_required_batch_multiple(dp_size),
                                                 self.tokenizer.eos_token_id)
        seqlens = torch.tensor([tag["seq_len"] for tag in batch.tags], dtype=torch.int64)
        workloads = calculate_workload(seqlens).tolist()
        parts = group_partitions([row_uid(k) for k in batch.keys], workloads, dp_size,
                                 [bool(tag.get("is_padding", False)) for tag in batch.tags])
        if parts is None:
            log.warning("rollplex trainer: the step's uids do not split into %d equal DP shares; verl's balancing "
                        "spreads some of them over ranks (their prompts are computed on each)", dp_size)
            return super()._balance_batch(batch, metrics, logging_prefix, keep_minibatch)
        batch.reorder([i for part in parts for i in part])
        metrics.update(log_seqlen_unbalance(seqlen_list=seqlens.tolist(), partitions=parts, prefix=logging_prefix))
        return batch

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
