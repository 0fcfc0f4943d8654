"""The `rollplex` trainer for verl's v1 driver (`trainer.use_v1=true trainer.v1.trainer_mode=rollplex`).

It runs the phases of verl's synchronous trainer (`PPOTrainerSync`: rollout, reward, old and reference
log-probs, advantages, actor update, weight update) unchanged; with the `rollplex` engine
(`VERL_ENGINE_VENDOR=rollplex`) the log-prob and update phases compute each group's prompt once.

The decode window (`ROLLPLEX_SGLANG_BRIDGE=dir:PATH` in the Ray workers' environment, with verl's SGLang
rollout colocated): the workers are `worker.RollplexActorRolloutRefWorker`; while the rollout runs a thread
polls TransferQueue for finished samples and hands each submitted uid's stored prompt to a DP rank, which sends
the reference prefix stage to the SGLang scheduler on its GPU (`window.py`). The batch balancing keeps each uid
on that rank, where the reference phase finds its K/V.

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
import threading

import torch
from verl.trainer.ppo.padding_utils import upsample_batch_to_divisible_size
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils.seqlen_balancing import calculate_workload, log_seqlen_unbalance

from rollplex_megatron.integrations.verl.held import held_pins, prompt_key
from rollplex_megatron.integrations.verl.rollout import NAME as ROLLOUT_NAME
from rollplex_megatron.integrations.verl.rollout import worker_held_prompts, worker_prefix_stats
from rollplex_megatron.integrations.verl.window import window_dir
from rollplex_megatron.rollout.sglang.protocol import ENV_ADDRESS

log = logging.getLogger(__name__)
NAME = "rollplex"


def check_environment(env=None) -> None:
    """Every `ROLLPLEX_VERL_*` value the workers read (the recipe's `runtime_env.env_vars`), checked in the driver
    before any worker starts or builds a model, each refusal naming the variable and its values."""
    from rollplex_megatron.config import ATTENTION_BACKENDS, NORM_KERNELS, ROPE_KERNELS
    from rollplex_megatron.integrations.verl import engine as E
    from rollplex_megatron.integrations.verl import rollout as R
    from rollplex_megatron.integrations.verl import window as W
    from rollplex_megatron.rollout.window.policy import choices

    env = os.environ if env is None else env
    allowed = {E.ENV_PREFIX: E.PREFIX_MODES, E.ENV_ATTENTION: ATTENTION_BACKENDS, E.ENV_DTYPE: tuple(E.DTYPES),
               E.ENV_NORM: NORM_KERNELS, E.ENV_ROPE: ROPE_KERNELS, R.ENV_WINDOW: R.WINDOW_MODES,
               W.ENV_MECHANISM: tuple(choices())}
    for name, values in allowed.items():
        if name in env and env[name] not in values:
            raise ValueError(f"{name}={env[name]!r}: use one of {', '.join(values)} (the Ray workers' environment, "
                             f"ray_kwargs.ray_init.runtime_env.env_vars)")
    if R.ENV_KV_GIB in env:
        try:
            gib = float(env[R.ENV_KV_GIB])
        except ValueError:
            gib = float("nan")
        if not gib > 0 or gib == float("inf"):
            raise ValueError(f"{R.ENV_KV_GIB}={env[R.ENV_KV_GIB]!r}: the embedded engine's KV cache per rank, a "
                             f"positive number of GiB")


def row_uid(key: str) -> str:
    """The uid of a TransferQueue row key (verl's agent loop writes `{uid}_{session}_{index}`)."""
    return key.rsplit("_", 2)[0]


def group_partitions(uids: list[str], workloads: list[float], k: int, loose: list[bool] | None = None,
                     pinned: dict | None = None) -> list[list[int]] | None:
    """Row indices in `k` partitions of equal size, each uid's rows in one partition (together, in row order),
    partition workloads balanced greedily: heaviest group first, into the lightest partition with room.
    `loose` rows (verl's padding samples) are placed one by one. `pinned` ({uid: partition}: where the decode
    window computed that uid's reference prefix) places those groups first, each in its partition while it
    has room (else with the others). None when the groups do not fit."""
    if len(uids) % k:
        return None
    groups: dict = {}
    for i, u in enumerate(uids):
        groups.setdefault(("row", i) if loose and loose[i] else ("uid", u), []).append(i)
    order = sorted(groups.items(), key=lambda kv: (-len(kv[1]), -sum(workloads[i] for i in kv[1]), kv[1][0]))
    size = len(uids) // k
    parts: list[list[int]] = [[] for _ in range(k)]
    load = [0.0] * k

    def place(rows, p):
        parts[p].extend(rows)
        load[p] += sum(workloads[i] for i in rows)

    rest = []
    for (kind, u), rows in order:
        p = (pinned or {}).get(u) if kind == "uid" else None
        if p is not None and 0 <= p < k and len(parts[p]) + len(rows) <= size:
            place(rows, p)
        else:
            rest.append(rows)
    for rows in rest:
        room = [p for p in range(k) if len(parts[p]) + len(rows) <= size]
        if not room:
            return None
        place(rows, min(room, key=lambda q: (load[q], q)))
    return parts


def moved_uids(parts: list[list[int]], uids: list[str], pinned: dict) -> int:
    """How many pinned uids a partition placed on another rank than their pin."""
    return sum(1 for p, part in enumerate(parts) for u in {uids[i] for i in part} if pinned.get(u, p) != p)


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

    def _dp_size(self, mesh: str) -> int:
        wg = self.actor_rollout_wg if mesh == "actor" else self.ref_policy_wg
        if mesh not in wg._dispatch_info:
            wg._dispatch_info[mesh] = wg._query_dispatch_info(mesh)
        return max(wg._dispatch_info[mesh]) + 1

    def _balance_batch(self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
        """verl's balancing (the same padding to the required multiple, equal rows per DP rank, its metrics) with
        each uid's rows kept on one rank (`group_partitions`), the rank the decode window gave it where it can;
        verl's own when the groups cannot be split equally."""
        dp_size = self._dp_size("actor")
        batch = upsample_batch_to_divisible_size(batch, self._get_required_batch_multiple(dp_size),
                                                 self.tokenizer.eos_token_id)
        seqlens = torch.tensor([tag["seq_len"] for tag in batch.tags], dtype=torch.int64)
        workloads = calculate_workload(seqlens).tolist()
        uids = [row_uid(k) for k in batch.keys]
        # the window's ranks (SGLang) over the rollout's: a rollplex rollout holds each prompt's K/V on the DP rank
        # of the replica that sampled it
        rollout_pins = self._rollout_pins(batch, uids)
        pinned = {**rollout_pins, **self._take_pins(set(uids))}
        parts = group_partitions(uids, workloads, dp_size, [bool(tag.get("is_padding", False)) for tag in batch.tags],
                                 pinned)
        if parts is None:
            log.warning("rollplex trainer: the step's uids do not split into %d equal DP shares; verl's balancing "
                        "spreads some of them over ranks (their prompts are computed on each)", dp_size)
            return super()._balance_batch(batch, metrics, logging_prefix, keep_minibatch)
        if rollout_pins:  # uids placed elsewhere: their scoring phases compute their prefixes again
            metrics["rollplex/rollout_uids_pinned"] = len(rollout_pins)
            metrics["rollplex/rollout_uids_moved"] = moved_uids(parts, uids, rollout_pins)
        if self._window:
            # their reference prefix runs again on another rank
            metrics["rollplex/window_uids_moved"] = moved_uids(parts, uids, pinned)
            metrics["rollplex/window_uids_pinned"] = len(pinned)
            metrics["rollplex/window_failures"] = self.window_failures
        batch.reorder([i for part in parts for i in part])
        metrics.update(log_seqlen_unbalance(seqlen_list=seqlens.tolist(), partitions=parts, prefix=logging_prefix))
        return batch

    # -- the decode window (ROLLPLEX_SGLANG_BRIDGE=dir:PATH) ----------------------------------------------------
    _window = False  # on when the rendezvous setting is found
    _window_thread: threading.Thread | None = None
    window_poll_s = 0.2

    def _window_init(self) -> None:
        self._window = True
        self._window_lock = threading.Lock()
        self._window_wanted: dict = {}  # uid -> the step it was submitted at (its prefix not handed out yet)
        self._window_ranks: dict = {}  # uid -> (the DP rank its reference prefix went to, that step)
        self._window_load: dict = {}  # DP rank -> [uids, prompt tokens] handed out since the last batch
        self._window_stop = threading.Event()
        self.window_failures = 0  # hand-outs that failed (their uids are tried again at the next poll)

    def _rollout_pins(self, batch, uids: list) -> dict:
        """{uid: DP rank} under `rollout.name=rollplex`: where the rollout holds the prefix K/V of the uid's prompt
        (read from one stored sample per uid), so its scoring phases find them (`held.py`)."""
        if self.config.actor_rollout_ref.rollout.get("name") != ROLLOUT_NAME:
            return {}
        import ray
        import transfer_queue as tq

        held = [(dp, keys) for dp, src, keys in ray.get([w.__ray_call__.remote(worker_held_prompts)
                                                          for w in self.actor_rollout_wg.workers]) if src]
        first: dict = {}
        for u, key, tag in zip(uids, batch.keys, batch.tags):
            if not tag.get("is_padding", False):
                first.setdefault(u, key)
        if not first or not any(keys for _, keys in held):
            return {}
        from rollplex_megatron.integrations.verl.worker import prompts_of

        data = tq.kv_batch_get(keys=list(first.values()), partition_id=batch.partition_id, select_fields=["prompts"])
        return held_pins(held, {u: prompt_key(p) for u, p in prompts_of(data, list(first)).items()})

    def _take_pins(self, uids: set) -> dict:
        """The DP rank of each of `uids` the window handed out; this batch consumes them, and forgets the uids of
        steps before the last (groups no batch took: dropped by dynamic sampling, failed, evicted)."""
        if not self._window:
            return {}
        oldest = getattr(self, "global_steps", 0) - 1
        with self._window_lock:
            pinned = {u: self._window_ranks.pop(u)[0] for u in uids if u in self._window_ranks}
            self._window_ranks = {u: (r, s) for u, (r, s) in self._window_ranks.items() if s >= oldest}
            self._window_wanted = {u: s for u, s in self._window_wanted.items() if s >= oldest}
            self._window_load.clear()
        return pinned

    def _init_resource_pool_mgr(self):
        """verl's roles and pools; with the window, its colocated worker becomes the rollplex one (as verl's own
        separate-async trainer swaps its worker here), after the layout is checked: before any worker starts."""
        check_environment()
        if os.environ.get(ENV_ADDRESS) and window_dir() is None:
            raise ValueError(f"trainer.v1.trainer_mode={NAME}: {ENV_ADDRESS}={os.environ[ENV_ADDRESS]} names "
                             f"listener addresses, which only this project's own trainer hands to the SGLang it "
                             f"starts; under verl use a rendezvous directory: {ENV_ADDRESS}=dir:PATH")
        super()._init_resource_pool_mgr()
        if window_dir() is None:
            return
        from verl.trainer.ppo.utils import Role

        from rollplex_megatron.integrations.verl.worker import RollplexActorRolloutRefWorker

        if Role.ActorRolloutRef not in self.role_worker_mapping:
            raise ValueError(f"trainer.v1.trainer_mode={NAME} with {ENV_ADDRESS}={os.environ[ENV_ADDRESS]}: the decode "
                             f"window needs the reference colocated with the actor and rollout (verl's "
                             f"Role.ActorRolloutRef: a reference model, no LoRA reference inside the actor, hybrid "
                             f"replicas); unset {ENV_ADDRESS} for this layout")
        self._check_window_layout()
        import ray

        self.role_worker_mapping[Role.ActorRolloutRef] = ray.remote(RollplexActorRolloutRefWorker)
        self._window_init()

    def _setup(self):
        super()._setup()
        if self._window and self._dp_size("ref") != self._dp_size("actor"):
            raise ValueError(f"trainer.v1.trainer_mode={NAME}: the decode window needs the reference at the actor's "
                             f"data-parallel size ({self._dp_size('ref')} against {self._dp_size('actor')}); give "
                             f"both the same TP and PP, or unset {ENV_ADDRESS}")

    def _check_window_layout(self) -> None:
        """One SGLang scheduler per reference TP rank on the same GPU (the bridge's ranks agree on the jobs they
        hold, so an SGLang TP group must be one reference TP group)."""
        from omegaconf import OmegaConf

        def get(key, default=1):
            v = OmegaConf.select(self.config, f"actor_rollout_ref.{key}", default=default)
            return default if v is None else int(v)

        ref_tp = get("ref.megatron.tensor_model_parallel_size", get("actor.megatron.tensor_model_parallel_size"))
        rollout = {"tensor_model_parallel_size": get("rollout.tensor_model_parallel_size"),
                   "data_parallel_size": get("rollout.data_parallel_size"),
                   "pipeline_model_parallel_size": get("rollout.pipeline_model_parallel_size")}
        want = {"tensor_model_parallel_size": ref_tp, "data_parallel_size": 1, "pipeline_model_parallel_size": 1}
        bad = {k: v for k, v in rollout.items() if v != want[k]}
        if bad or get("ref.megatron.pipeline_model_parallel_size", 1) != 1:
            raise ValueError(f"trainer.v1.trainer_mode={NAME} with {ENV_ADDRESS}: the decode window needs SGLang at "
                             f"the reference's TP without data or pipeline parallelism and the reference at PP 1 "
                             f"(actor_rollout_ref.rollout: {rollout}, reference TP {ref_tp}); set "
                             f"actor_rollout_ref.rollout.tensor_model_parallel_size={ref_tp}, or unset {ENV_ADDRESS}")

    def _submit_batch_to_rollout(self, batch):
        if self._window:
            step = getattr(self, "global_steps", 0)
            with self._window_lock:
                self._window_wanted.update({str(u): step for u in batch["uid"]})
        return super()._submit_batch_to_rollout(batch)

    def _window_rank(self, prompt_len: int, dp: int) -> int:
        """The DP rank for a uid handed out now: among the ranks holding the fewest uids (the batch gives every
        rank as many), the one with the fewest prompt tokens (its reference prefix work)."""
        load = [self._window_load.setdefault(r, [0, 0]) for r in range(dp)]
        r = min(range(dp), key=lambda q: (load[q][0], load[q][1], q))
        load[r][0] += 1
        load[r][1] += prompt_len
        return r

    def window_poll_once(self) -> int:
        """Hand each submitted uid with a finished sample and no job yet to a DP rank's window (its stored prompt:
        the sample's key); returns how many. A failed hand-out leaves its uids for the next poll."""
        import transfer_queue as tq

        found: dict = {}
        with self._window_lock:
            for key, tag in ((tq.kv_list() or {}).get("train") or {}).items():
                uid = row_uid(key)
                if not tag.get("is_prompt") and tag.get("status") == "success" and uid in self._window_wanted:
                    found.setdefault(uid, (key, int(tag.get("prompt_len", 0))))
            if not found:
                return 0
            dp = self._dp_size("ref")
            ranks = {u: self._window_rank(n, dp) for u, (_, n) in found.items()}
            step = {u: self._window_wanted.pop(u) for u in found}
            self._window_ranks.update({u: (r, step[u]) for u, r in ranks.items()})
        try:
            self.ref_policy_wg.rollplex_window_submit({u: k for u, (k, _) in found.items()}, ranks)
        except Exception as e:  # e.g. a sample cleared between the listing and the read: try those uids again
            self.window_failures += 1
            log.warning("rollplex trainer: handing %d uids to the decode window failed (%s: %s); tried again at the "
                        "next poll", len(found), type(e).__name__, e)
            with self._window_lock:
                for u, (_, n) in found.items():
                    self._window_ranks.pop(u, None)
                    self._window_wanted[u] = step[u]
                    load = self._window_load.get(ranks[u])
                    if load is not None:  # the batch may have cleared the loads meanwhile
                        load[0] -= 1
                        load[1] -= n
            return 0
        return len(found)

    def _window_poll(self, stop: threading.Event) -> None:
        while True:
            last = stop.wait(self.window_poll_s)  # after the stop: one more look at what finished meanwhile
            try:
                self.window_poll_once()
            except Exception as e:  # listing TransferQueue failed: the reference phase computes what is missing
                self.window_failures += 1
                log.warning("rollplex trainer: decode-window poll failed: %s: %s", type(e).__name__, e)
            if last:
                return

    def on_sample_begin(self):
        super().on_sample_begin()
        if self._window:
            self._window_stop = threading.Event()
            self._window_thread = threading.Thread(target=self._window_poll, args=(self._window_stop,),
                                                   name="rollplex-window-poller", daemon=True)
            self._window_thread.start()

    def on_sample_end(self):
        if self._window_thread is not None:  # the rollout is over: no more finished samples to hand out
            self._window_stop.set()
            self._window_thread.join()
            self._window_thread = None
        super().on_sample_end()

    # -- what a `rollplex` rollout held for the scoring phases (held.py) -----------------------------------------
    def _compute_old_log_prob(self, batch, metrics):
        batch = super()._compute_old_log_prob(batch, metrics)
        metrics.update(self._held_metrics("old_logp"))
        return batch

    def _compute_ref_log_prob(self, batch, metrics):
        batch = super()._compute_ref_log_prob(batch, metrics)
        metrics.update(self._held_metrics("ref"))
        return batch

    def _held_metrics(self, phase: str) -> dict:
        """`rollplex/{phase}_prefix_{from_rollout,computed,stale}`: the phase's groups, summed over DP ranks, whose
        prefix K/V the rollout held (the prefill for old log-probs, the decode window for the reference), those it
        computed itself, and held ones at other weights; nothing under another rollout or when the phase did not
        run this step."""
        if self.config.actor_rollout_ref.rollout.get("name") != ROLLOUT_NAME:
            return {}
        import ray

        stats = ray.get([w.__ray_call__.remote(worker_prefix_stats) for w in self.actor_rollout_wg.workers])
        mine = [s[phase] for s in stats if s["src"] and s.get(phase)]
        if not mine:
            return {}
        return {f"rollplex/{phase}_prefix_{k}": sum(m[k] for m in mine) for k in ("from_rollout", "computed", "stale")}

    def on_init_end(self):
        vendor = os.environ.get("VERL_ENGINE_VENDOR")
        if vendor != "rollplex":
            log.warning("trainer.v1.trainer_mode=%s with VERL_ENGINE_VENDOR=%r: verl's own engine computes every "
                        "response's prompt again; set VERL_ENGINE_VENDOR=rollplex", NAME, vendor)
        super().on_init_end()


def register() -> None:
    """Idempotent: `register_trainer` refuses a second class under a taken name, not the same one."""
    register_trainer(NAME)(RollplexTrainer)
