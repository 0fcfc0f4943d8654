"""`mode=disaggregated`: the rollout on ranks of its own, with weights of its own (the paper's other
baseline). The last `parallel.rollout_ranks` ranks decode in replicas of `rollout.tp` ranks; the others
train (`dist.ParallelLayouts` gives each side its own megatron world).

Protocol (every collective below is over the whole job, in this order on every rank): training rank 0
broadcasts a command; `generate` is followed by the requests' gather (training side sends), the
replicas' decode and the results' gather (rollout side sends); `weights` by the bucketed broadcast of
the training weights, once at start-up and after each step's optimizer steps (`weight_transfer`);
`stop` ends the rollout ranks' loop. While the training ranks run their serial phases the rollout
ranks wait in the next command's broadcast, as in the systems the paper compares against.

Weights: per bucket and per training TP rank k, training rank k of data-parallel rank 0 broadcasts its
shards over {k} + the rollout ranks; each rollout rank lays the training shards side by side (their
union along the sharded dim) and copies its own rollout-TP shard out of it.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from rollplex_megatron.config import RunConfig
from rollplex_megatron.dist import ParallelLayouts
from rollplex_megatron.models.registry import model_spec
from rollplex_megatron.rollout.embedded import EmbeddedEngine
from rollplex_megatron.rollout.engine import DecodeHooks, RolloutOutput, RolloutRequest
from rollplex_megatron.rollout.replicas import gather_requests, gather_results, replica_slice
from rollplex_megatron.rollout.sampling import SamplingParams
from rollplex_megatron.runtime import device
from rollplex_megatron.weights import layout as WL
from rollplex_megatron.weights.plan import plan_pairs
from rollplex_megatron.weights.share import BUCKET_BYTES, _select, union_positions


def command(cmd=None):
    """Collective: training rank 0's command (None elsewhere) on every rank."""
    msg = [cmd]
    dist.broadcast_object_list(msg, src=0)
    return msg[0]


class WeightTransfer:
    """The training weights, sent from data-parallel rank 0's TP group to every rollout rank."""

    def __init__(self, cfg: RunConfig, layouts: ParallelLayouts, train_model=None, rollout_model=None,
                 rollout_tp_rank: int = 0):
        t, r = layouts.tp, layouts.rollout_tp
        self.t, self.senders = t, layouts.senders
        elem = cfg.param_bytes
        self.plan = plan_pairs(cfg.model, t, r, [(0, rollout_tp_rank)], "megatron", elem)[0]
        self.train = dict(train_model.named_parameters()) if train_model is not None else None
        self.roll = dict(rollout_model.named_parameters()) if rollout_model is not None else None
        # every training TP rank's shard extent along the sharded dim (megatron's shards are equal-sized)
        self.extent = {p.name: [WL.megatron_index(p.rule, p.hf_shapes, t, k).index.numel() for k in range(t)]
                       for p in self.plan if p.dim is not None}
        self.numel = {p.name: (p.shard_bytes // elem) // (p.need.index.numel() if p.dim is not None else 1)
                      for p in self.plan}  # elements per index along the sharded dim (all of it if replicated)
        self.pos = {p.name: union_positions(p, t) for p in self.plan if p.dim is not None and self.roll is not None}
        self.buckets, cur, size = [], [], 0
        for p in self.plan:
            cur.append(p)
            size += self._count(p, 0) * elem
            if size >= BUCKET_BYTES:
                self.buckets.append(cur)
                cur, size = [], 0
        if cur:
            self.buckets.append(cur)
        if self.train is not None and ps.get_data_parallel_rank() == 0:
            k = ps.get_tensor_model_parallel_rank()
            bad = [p.name for p in self.plan if (p.dim is not None or k == 0) and self.train[p.name].numel()
                   != self._count(p, k)]
            if bad:
                raise RuntimeError(f"weight transfer: training parameter {bad[0]} has another size than its plan")

    def _count(self, p, k: int) -> int:
        """Elements training TP rank k sends of parameter `p` (replicated ones: rank 0 alone)."""
        if p.dim is None:
            return self.numel[p.name] if k == 0 else 0
        return self.extent[p.name][k] * self.numel[p.name]

    def send(self) -> None:
        """Training ranks: data-parallel rank 0's TP ranks each broadcast their shards, bucket by bucket."""
        if ps.get_data_parallel_rank() != 0:
            return
        k = ps.get_tensor_model_parallel_rank()
        for bucket in self.buckets:
            mine = [self.train[p.name].data.reshape(-1) for p in bucket if self._count(p, k)]
            if mine:
                dist.broadcast(torch.cat(mine), src=k, group=self.senders[k])

    def receive(self) -> None:
        """Rollout ranks: every bucket's shards from each training TP rank, then this rank's shard of each."""
        dev = device()
        with torch.no_grad():
            for bucket in self.buckets:
                flats = []
                for k in range(self.t):
                    n = sum(self._count(p, k) for p in bucket)
                    buf = torch.empty(n, dtype=next(iter(self.roll.values())).dtype, device=dev) if n else None
                    if n:
                        dist.broadcast(buf, src=k, group=self.senders[k])
                    flats.append(buf)
                offs = [0] * self.t
                for p in bucket:
                    parts = []
                    for k in range(self.t):
                        n = self._count(p, k)
                        if n:
                            parts.append(flats[k][offs[k]:offs[k] + n])
                            offs[k] += n
                    self._assign(p, parts)

    def _assign(self, p, parts: list[torch.Tensor]) -> None:
        dst = self.roll[p.name]
        if p.dim is None:
            dst.data.copy_(parts[0].view_as(dst))
            return
        shapes = []
        for k in range(self.t):
            shape = list(dst.shape)
            shape[p.dim] = self.extent[p.name][k]
            shapes.append(shape)
        union = torch.cat([x.view(s) for x, s in zip(parts, shapes)], dim=p.dim)
        dst.data.copy_(_select(union, p.dim, self.pos[p.name]))


class RemoteRollout:
    """The training ranks' RolloutEngine under mode=disaggregated: the rollout ranks decode."""

    prefill_is_actor_prefix = False
    window_items_elsewhere = False  # mode disaggregated has no decode window
    weights_phase = "weight_transfer"
    collective = True

    def __init__(self, actor, cfg: RunConfig, layouts: ParallelLayouts):
        """`actor`: the training model (unwrapped). Sends the initial weights."""
        self.train_dp_rank = ps.get_data_parallel_rank()
        self.train_first = ps.get_tensor_model_parallel_rank() == 0
        self.replicas = layouts.rollout_ranks // layouts.rollout_tp
        self.transfer = WeightTransfer(cfg, layouts, train_model=actor)
        self.sync_weights()  # the rollout starts from the training side's initial weights

    def generate(self, requests: list[RolloutRequest], params: SamplingParams, hooks: DecodeHooks | None = None,
                 actor_prefix=None, recompute_prefix: bool = False) -> RolloutOutput:
        """Collective over every rank: this training rank's requests, decoded by the rollout ranks."""
        if actor_prefix is not None:
            raise NotImplementedError("mode=disaggregated decodes on other ranks: the prefill cannot be the actor "
                                      "prefix stage")
        command(("generate", params))
        every, counts = gather_requests((self.train_dp_rank, requests) if self.train_first else None)
        results, stats = gather_results(None, self.replicas, len(every))
        start = sum(counts[:self.train_dp_rank])
        if hooks is not None:
            hooks.on_idle()
        return RolloutOutput(results[start:start + len(requests)], [], stats)

    def sync_weights(self) -> float:
        """Send the current training weights to the rollout ranks; seconds."""
        t0 = time.perf_counter()
        command(("weights", None))
        self.transfer.send()
        return time.perf_counter() - t0

    def close(self) -> None:
        """The rollout ranks leave their loop (training rank 0 decides; every rank calls)."""
        command(("stop", None))


class RolloutWorker:
    """A rollout rank under mode=disaggregated: its replica's model with weights of its own, serving the
    training ranks' commands until `stop`."""

    def __init__(self, cfg: RunConfig, layouts: ParallelLayouts):
        self.layouts = layouts
        with layouts.use("rollout"):
            self.model = model_spec(cfg.model).build(cfg.model, cfg.dtype, cfg.megatron).eval()  # weights: training's
            rank = ps.get_tensor_model_parallel_rank()
            self.first = rank == 0
            self.replica, self.replicas = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
            self.engine = EmbeddedEngine.for_run(self.model, cfg)
        self.transfer = WeightTransfer(cfg, layouts, rollout_model=self.model, rollout_tp_rank=rank)

    def serve(self) -> dict:
        """Answer commands until `stop`; what was served."""
        served = {"rollouts": 0, "weight_loads": 0, "requests": 0, "decode_s": 0.0, "weights_s": 0.0}
        while True:
            kind, arg = command()
            t0 = time.perf_counter()
            if kind == "stop":
                return served
            if kind == "weights":
                self.transfer.receive()
                served["weight_loads"] += 1
                served["weights_s"] += time.perf_counter() - t0
                continue
            every, _ = gather_requests(None)
            part = every[replica_slice(len(every), self.replica, self.replicas)]
            with self.layouts.use("rollout"), torch.no_grad():
                out = self.engine.generate(part, arg)
            stats = {**out.stats, "rollout_replicas": self.replicas, "replica_requests": len(part)}
            gather_results((self.replica, out.results, stats) if self.first else None, self.replicas,
                                    len(every))
            served["rollouts"] += 1
            served["requests"] += len(part)
            served["decode_s"] += time.perf_counter() - t0

