"""Build the rollout model's weights on the training storage: views where the plan allows,
rebuilt tensors (local permutation or bucketed all-gather over the training TP group) elsewhere.

No second full copy exists: `view` / `strided_view` parameters alias the training parameters'
storage (`param.data` is a narrow of the training tensor), so an optimizer step is visible to
rollout at once; only `local_permute` and `gather` tensors own memory, and `refresh()` rebuilds
them after each optimizer step.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from rollplex_megatron.config import ModelConfig
from rollplex_megatron.weights import layout as WL
from rollplex_megatron.weights import split
from rollplex_megatron.weights.plan import TensorPlan, plan_pairs, plan_weights, positions_in, split_local

BUCKET_BYTES = 256 << 20


def _select(src: torch.Tensor, dim: int, pos: torch.Tensor) -> torch.Tensor:
    """Elements of `src` at `pos` along `dim`; -2 (padding) gives zeros."""
    out = src.index_select(dim, pos.clamp_min(0).to(src.device))
    pad = (pos < 0).to(src.device)
    if pad.any():
        shape = [1] * src.dim()
        shape[dim] = -1
        out = out.masked_fill(pad.view(shape), 0)
    return out


def union_positions(p: TensorPlan, t: int) -> torch.Tensor:
    """Positions of the rollout shard of `p` in the union of the t training shards laid side by side along
    its sharded dim (training TP rank order): what a rollout rank selects once it holds every shard."""
    union = WL.ShardIndex(p.dim, torch.cat([WL.megatron_index(p.rule, p.hf_shapes, t, k).index for k in range(t)]), 0)
    return positions_in(union, WL.ShardIndex(p.dim, p.need.index, p.need.canonical))


def bind_parameter(modules: dict, name: str, tensor: torch.Tensor) -> torch.nn.Parameter:
    """Make parameter `name` of a module tree (`modules`: its `named_modules()` dict) the tensor itself, no
    copy: the Parameter object is replaced, not its `.data` (a meta-device parameter cannot take real data)."""
    path, _, attr = name.rpartition(".")
    prm = torch.nn.Parameter(tensor, requires_grad=False)  # aliases `tensor`'s storage, offset and strides
    modules[path]._parameters[attr] = prm
    return prm


class SharedRolloutWeights:
    """Rollout parameters bound to the training parameters on this GPU (megatron rollout layout)."""

    def __init__(self, train_model, rollout_model, cfg: ModelConfig, t: int, r: int, train_tp_group,
                 gpu: int | None = None, mapping: str = "aligned", split_gemm: bool | str = False,
                 rollout_tp_rank: int | None = None, layout: str = "megatron"):
        """Bind `rollout_model`'s parameters (random or on the meta device: every one is replaced).

        `gpu`: this GPU's index in `plan_weights`' W = max(t, r) GPU group; or `rollout_tp_rank`: this
        rank's rollout TP rank, the pairs of the training TP group are gathered over it (any world size;
        a pair whose shards do not nest is served by rebuilt tensors). `split_gemm` (`rollout.split_gemm`):
        off | local (locally permuted linears run one GEMM per block of views: nothing allocated) | all
        (gathered linears too: only their remote pieces allocated); True means all. `layout`: the rollout
        shards' layout (`weights/layout.py`: megatron, or sglang for SGLang's parameters)."""
        split_gemm = {True: "all", False: "off"}.get(split_gemm, split_gemm)
        elem = next(train_model.parameters()).element_size()
        if rollout_tp_rank is None:
            per_rank = plan_weights(cfg, t, r, layout, elem, mapping).gpus
            self.plan: list[TensorPlan] = per_rank[gpu]
        else:
            rrs = [None] * t
            dist.all_gather_object(rrs, rollout_tp_rank, group=train_tp_group)
            per_rank = plan_pairs(cfg, t, r, list(enumerate(rrs)), layout, elem)
            self.plan = per_rank[dist.get_rank(train_tp_group)]
        self.t, self.group = t, train_tp_group
        gather_any = {p.name for g in per_rank for p in g if p.klass == "gather"}
        self.train = dict(train_model.named_parameters())
        self.roll = dict(rollout_model.named_parameters())
        self.gathered = [p.name for p in self.plan if p.name in gather_any]  # same order on every rank
        self.union_pos = {}
        self.remote: dict[str, torch.Tensor] = {}  # split-GEMM layers: only the remote stretches
        modules = dict(rollout_model.named_modules())
        self._modules = modules
        for p in self.plan:
            tp, rp = self.train[p.name], self.roll[p.name]
            own = dict(dtype=tp.dtype, device=tp.device)  # the rollout model may live on the meta device
            if p.klass == "view":
                self._bind(p.name, tp.data if p.dim is None else tp.data.narrow(p.dim, int(p.positions[0]),
                                                                               p.positions.numel()))
            elif p.klass == "strided_view":
                self._bind(p.name, tp.data.narrow(1, int(p.positions[0]), p.positions.numel()))
            if p.klass == "gather":
                self.union_pos[p.name] = union_positions(p, t)
                mod = modules[p.name.rsplit(".", 1)[0]]
                if split_gemm == "all" and p.name.endswith(".weight") and split.supports(mod):
                    shape = list(rp.shape)
                    remote = p.positions < 0
                    shape[p.dim] = int(remote.sum())
                    self.remote[p.name] = torch.empty(shape, **own)
                    self.union_pos[p.name] = self.union_pos[p.name][remote]
                    split.install(mod, tp.data, self.remote[p.name], split.runs(p.positions), p.dim)
                    self._bind(p.name, torch.empty(0, **own))  # never read again
                    continue
            if p.klass == "local_permute" and split_gemm in ("local", "all") and split_local(p):
                # every element is here in another order (gated fc1 at rollout TP > training TP: the
                # rollout's [gate; up] are two row blocks of the training shard): one GEMM per block
                mod = modules[p.name.rsplit(".", 1)[0]]
                if split.supports(mod):
                    self.remote[p.name] = torch.empty(0, **own)
                    split.install(mod, tp.data, self.remote[p.name], split.runs(p.positions), p.dim)
                    self._bind(p.name, torch.empty(0, **own))  # never read again
                    continue
            if p.klass in ("local_permute", "gather"):
                self._bind(p.name, torch.empty(rp.shape, **own))
        missing = [n for n, prm in self.roll.items() if prm.is_meta]
        if missing:
            raise RuntimeError(f"rollout parameter {missing[0]} has no plan (and {len(missing) - 1} more); the "
                               f"weight plan must cover every parameter of the rollout model")
        self._bound_storage = {p.name: self.train[p.name].untyped_storage().data_ptr() for p in self.plan}
        self.refresh()

    def _bind(self, name: str, tensor: torch.Tensor) -> None:
        """Make rollout parameter `name` the tensor (a view of training storage, or its own buffer)."""
        self.roll[name] = bind_parameter(self._modules, name, tensor)

    def check_bound(self) -> None:
        """Fail if a training parameter was re-allocated after binding (views would go stale).

        Bind after every wrapper that moves parameters (`.cuda()`, Float16Module, DDP with the
        distributed optimizer, which points `param.data` into its own buffer).
        """
        for name, ptr in self._bound_storage.items():
            if self.train[name].untyped_storage().data_ptr() != ptr:
                raise RuntimeError(f"training parameter {name} was re-allocated after the rollout weights were "
                                   f"bound to it; build SharedRolloutWeights after wrapping the training model")

    def refresh(self, blocking: bool = True) -> float:
        """Rebuild the non-view tensors from the current training weights; returns seconds.

        On GPU the rebuild runs on a side stream after everything queued so far (the optimizer
        step); `blocking=False` returns at once and `wait()` makes the current stream wait for it.
        """
        self.check_bound()
        t0 = time.perf_counter()
        if torch.cuda.is_available():
            if not hasattr(self, "_stream"):
                self._stream, self._ready = torch.cuda.Stream(), torch.cuda.Event()
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                self._rebuild()
                self._ready.record(self._stream)
            if not blocking:
                return 0.0
            self._ready.synchronize()
        else:
            self._rebuild()
        return time.perf_counter() - t0

    def wait(self) -> None:
        """Make the current stream wait for the last non-blocking refresh."""
        if torch.cuda.is_available() and hasattr(self, "_ready"):
            torch.cuda.current_stream().wait_event(self._ready)

    def _rebuild(self) -> None:
        with torch.no_grad():
            for p in self.plan:
                if p.klass == "local_permute" and p.name not in self.remote:
                    self.roll[p.name].data.copy_(_select(self.train[p.name].data, p.dim, p.positions))
            self._gather_all()

    def _gather_all(self) -> None:
        bucket, size = [], 0
        for name in self.gathered:
            bucket.append(name)
            size += self.train[name].numel() * self.train[name].element_size()
            if size >= BUCKET_BYTES:
                self._gather_bucket(bucket)
                bucket, size = [], 0
        if bucket:
            self._gather_bucket(bucket)

    def _gather_bucket(self, names: list[str]) -> None:
        flat = torch.cat([self.train[n].data.reshape(-1) for n in names])
        parts = [torch.empty_like(flat) for _ in range(self.t)]
        dist.all_gather(parts, flat, group=self.group)
        by_name = {p.name: p for p in self.plan}
        off = 0
        for n in names:
            shard = self.train[n]
            k = shard.numel()
            p = by_name[n]
            union = torch.cat([part[off:off + k].view_as(shard) for part in parts], dim=p.dim)
            off += k
            if p.klass != "gather":  # gathered elsewhere; here served from local views (split GEMMs)
                continue
            if n in self.remote:
                self.remote[n].copy_(_select(union, p.dim, self.union_pos[n]))
            else:
                self.roll[n].data.copy_(_select(union, p.dim, self.union_pos[n]))

    def allocated_bytes(self) -> int:
        """Bytes the rollout side owns on this GPU (rebuilt tensors and remote stretches only)."""
        own = sum(self.roll[p.name].numel() * self.roll[p.name].element_size() for p in self.plan
                  if p.klass in ("local_permute", "gather"))
        return own + sum(b.numel() * b.element_size() for b in self.remote.values())
