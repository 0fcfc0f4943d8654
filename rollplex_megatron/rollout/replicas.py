"""The embedded engine at the rollout's own layout: `rollout.tp` ranks per replica, on shared weights.

The rollout model is built on the meta device inside the rollout layout (`dist.ParallelLayouts`)
and bound to the training storage by `weights/share.py` (views where the layouts allow, rebuilt
tensors elsewhere); `refresh()` rebuilds the non-view tensors after the step's optimizer steps.
Replicas = world / rollout.tp. Every training data-parallel rank's requests are gathered in training
DP-rank order, split over the replicas in that order (replica j takes the j-th contiguous slice), and
each replica's results are gathered back, so every training rank gets its own requests' results in
its own order. Sampling is counter-based per request (seed, sample, step), so a request's tokens do
not depend on which replica decodes it.

Decode-window items run at the training layout (`_AtTrainingLayout`). A training TP group can span
several replicas that decode different batches and finish at different times; its collectives stay
in one order on every rank because items are issued only by the decode thread, after decode steps
(`interleave`: item k after the same step index k on every rank) and by a replica that has finished
in queue order (`on_idle`): every rank issues the same items in the same order, and each replica's
members issue the same decode steps in the same order, so there is a single global order of
collectives and no rank waits on one that waits on it.
"""
from __future__ import annotations

import torch.distributed as dist
from megatron.core import parallel_state as ps

from rollplex_megatron.config import RunConfig
from rollplex_megatron.dist import ParallelLayouts
from rollplex_megatron.models.registry import model_spec
from rollplex_megatron.rollout.embedded import EmbeddedEngine
from rollplex_megatron.rollout.engine import DecodeHooks, RolloutOutput, RolloutRequest
from rollplex_megatron.rollout.sampling import SamplingParams
from rollplex_megatron.weights.share import SharedRolloutWeights


class _AtTrainingLayout(DecodeHooks):
    """The trainer's decode hooks, with the work they run (window items) at the training layout."""

    def __init__(self, inner: DecodeHooks, layouts: ParallelLayouts):
        self.inner, self.layouts = inner, layouts

    def on_wave(self, samples: int) -> None:  # noqa: D102
        self.inner.on_wave(samples)

    def decode_stream(self):  # noqa: D102
        return self.inner.decode_stream()

    def capture_guard(self):  # noqa: D102
        return self.inner.capture_guard()

    def on_decode_step(self, step: int, active: int) -> None:  # noqa: D102
        with self.layouts.use("train"):
            self.inner.on_decode_step(step, active)

    def on_idle(self) -> None:  # noqa: D102
        with self.layouts.use("train"):
            self.inner.on_idle()

    def abort(self) -> None:  # noqa: D102
        self.inner.abort()


class RolloutReplicas:
    """RolloutEngine over rollout replicas at `rollout.tp`, bound to the actor's training storage."""

    prefill_is_actor_prefix = False  # other layout: the trainer runs the actor prefix stage itself
    window_items_elsewhere = False  # they run here, at the training layout (`_AtTrainingLayout`)

    def __init__(self, actor, cfg: RunConfig, layouts: ParallelLayouts, full_copy=None):
        """`actor`: the training model (unwrapped, after every wrapper that moves its parameters).
        `full_copy`: a rollout model built at the rollout layout with weights of its own, used as it is
        (no binding, nothing to refresh: the reference the shared path is tested against)."""
        r = cfg.rollout
        self.layouts = layouts
        self.train_dp_rank = ps.get_data_parallel_rank()
        self.train_first = ps.get_tensor_model_parallel_rank() == 0  # PP=1 here (checked by the config)
        train_group = ps.get_tensor_model_parallel_group()
        with layouts.use("rollout"):
            build = model_spec(cfg.model).build
            self.model = full_copy if full_copy is not None else build(cfg.model, cfg.dtype, cfg.megatron, meta=True)
            rollout_rank = ps.get_tensor_model_parallel_rank()
            self.replica, self.replicas = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
            self.rollout_first = rollout_rank == 0
            self.engine = EmbeddedEngine.for_run(self.model, cfg)
        self.weights = None if full_copy is not None else SharedRolloutWeights(
            actor, self.model, cfg.model, layouts.tp, layouts.rollout_tp, train_group, split_gemm=r.split_gemm,
            rollout_tp_rank=rollout_rank)

    weights_phase = "weight_refresh"  # the loop's phase after the optimizer steps (see sync_weights)
    collective = True  # generate is collective over every rank

    def sync_weights(self) -> float:
        """Rebuild the rollout's non-view tensors from the current training weights; seconds."""
        return 0.0 if self.weights is None else self.weights.refresh()

    def allocated_bytes(self) -> int:
        """Bytes the rollout model owns on this rank (rebuilt tensors; views cost nothing; a full copy:
        all of it)."""
        if self.weights is None:
            return sum(p.numel() * p.element_size() for p in self.model.parameters())
        return self.weights.allocated_bytes()

    def generate(self, requests: list[RolloutRequest], params: SamplingParams, hooks: DecodeHooks | None = None,
                 actor_prefix=None, recompute_prefix: bool = False) -> RolloutOutput:
        """Collective over every rank: this training rank's requests, sampled by the replicas."""
        if actor_prefix is not None:
            raise NotImplementedError("the rollout runs at its own layout (rollout.tp != parallel.tp): its prefill "
                                      "cannot be the actor prefix stage; run that stage as window work")
        every, counts = gather_requests((self.train_dp_rank, requests) if self.train_first else None)
        part = every[replica_slice(len(every), self.replica, self.replicas)]
        with self.layouts.use("rollout"):
            out = self.engine.generate(part, params, _AtTrainingLayout(hooks or DecodeHooks(), self.layouts))
        results, _ = gather_results((self.replica, out.results, {}) if self.rollout_first else None, self.replicas,
                                    len(every))
        start = sum(counts[:self.train_dp_rank])
        stats = {**out.stats, "rollout_replicas": self.replicas, "replica_requests": len(part)}
        return RolloutOutput(results[start:start + len(requests)], [], stats)


def gather_requests(mine: tuple[int, list] | None) -> tuple[list[RolloutRequest], list[int]]:
    """Collective over every rank: each training DP rank's requests (sent as (dp rank, requests) by one
    rank of its model-parallel group, None elsewhere), in DP-rank order, and the count per DP rank."""
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, mine)
    by_rank = dict(x for x in got if x is not None)
    order = sorted(by_rank)
    return [q for k in order for q in by_rank[k]], [len(by_rank[k]) for k in order]


def gather_results(mine: tuple[int, list, dict] | None, replicas: int, n: int) -> tuple[list, dict]:
    """Collective over every rank: every replica's results (sent as (replica, results, statistics) by its
    first rank, None elsewhere) in the global request order, and replica 0's statistics."""
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, mine)
    by_replica = {x[0]: x[1:] for x in got if x is not None}
    out = [res for j in range(replicas) for res in by_replica[j][0]]
    if len(out) != n:
        raise RuntimeError(f"rollout replicas returned {len(out)} results for {n} requests")
    return out, dict(by_replica[0][1])


def replica_slice(n: int, replica: int, replicas: int) -> slice:
    """Replica `replica`'s contiguous share of `n` requests (the global order)."""
    return slice(replica * n // replicas, (replica + 1) * n // replicas)
