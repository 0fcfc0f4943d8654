"""Classify every rollout-side tensor against the training shard on the same GPU.

GPU mapping (`mapping="aligned"`, the default): W = max(t, r) GPUs. The side with the larger TP
degree uses megatron's default order (TP groups of consecutive GPUs, rank g % d); the other side
uses megatron's "dp-tp" order (strided TP groups, rank g // (W / d)). Then every rollout shard
nests inside the training shard on its GPU when r > t, and contains it when r < t.
`mapping="consecutive"` puts both sides in the default order (for comparison). PP=1 on both
sides (pipeline stages hold whole tensors, so sharing is per stage).

Classes, per tensor and GPU:
- `view`: the rollout shard is a contiguous slice (dim 0, or all of dim 1) of the local training
  storage: no bytes.
- `strided_view`: a column block of the local storage (row-parallel weights): same storage, a
  strided tensor that GEMMs consume without a copy: no bytes.
- `local_permute`: every element is on this GPU but in another order (or needs padding): a copy
  inside the GPU, the shard's bytes.
- `gather`: needs other training ranks' data: the shard's bytes (or only the remote pieces'
  bytes when the layer runs as several GEMMs over [local view | received pieces]).
With split GEMMs a `local_permute` tensor of a tensor-parallel linear whose elements are all local
(the gated fc1 at rollout TP > training TP: [gate; up] are two row blocks of the training shard)
allocates nothing: the layer runs one GEMM per block over views.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

import torch

from rollplex_megatron.config import ModelConfig
from rollplex_megatron.dist import aligned_coordinates
from rollplex_megatron.models import hf_rules as CL
from rollplex_megatron.models.registry import model_spec
from rollplex_megatron.weights import layout as WL


@dataclass
class TensorPlan:
    """How one rollout tensor is obtained on one GPU."""

    name: str  # megatron parameter name
    kind: str  # parameter kind (layer index dropped)
    klass: str  # view | strided_view | local_permute | gather
    dim: int | None  # sharded dim (None: replicated)
    positions: torch.Tensor | None  # per rollout element: position in the local training shard,
    #                                 -1 missing (remote), -2 padding
    shard_bytes: int  # bytes of the rollout shard (what a second copy costs)
    alloc_bytes: int  # bytes this plan allocates for it
    remote_bytes: int  # bytes that must come from other GPUs
    rule: CL.Rule | None = None  # the checkpoint rule (megatron names, HF sources, layout)
    hf_shapes: list | None = None  # shapes of the rule's HF tensors
    need: WL.ShardIndex | None = None  # the rollout shard's canonical indices


@dataclass
class WeightPlan:
    """Per-GPU plans for (train TP t, rollout TP r, layout)."""

    t: int
    r: int
    layout: str
    gpus: list[list[TensorPlan]] = field(default_factory=list)

    def summary(self) -> dict:
        """Totals per GPU (the max over GPUs) and per kind (bytes: the GPU that needs the most)."""
        per_gpu = [{"full_copy_bytes": sum(p.shard_bytes for p in g), "allocated_bytes": sum(p.alloc_bytes for p in g),
                    "allocated_bytes_split_gemm": sum(split_gemm_bytes(p) for p in g)} for g in self.gpus]
        worst = max(per_gpu, key=lambda x: x["allocated_bytes"])
        by_kind: dict[str, dict] = {}
        for gi, g in enumerate(self.gpus):
            per: dict[str, dict] = {}
            for p in g:
                k = per.setdefault(p.kind, {"classes": set(), "count": 0, "shard_bytes": 0, "alloc_bytes": 0})
                k["classes"].add(p.klass)
                k["count"] += 1
                k["shard_bytes"] += p.shard_bytes
                k["alloc_bytes"] += p.alloc_bytes
            for kind, k in per.items():
                agg = by_kind.setdefault(kind, {"classes": set(), "count": k["count"], "shard_bytes": 0,
                                                "alloc_bytes": 0})
                agg["classes"] |= k["classes"]
                agg["shard_bytes"] = max(agg["shard_bytes"], k["shard_bytes"])
                agg["alloc_bytes"] = max(agg["alloc_bytes"], k["alloc_bytes"])
        for k in by_kind.values():
            classes = k.pop("classes")
            k["class"] = classes.pop() if len(classes) == 1 else "mixed"
        full = worst["full_copy_bytes"]
        return {"train_tp": self.t, "rollout_tp": self.r, "layout": self.layout, "gpus": len(self.gpus),
                "full_copy_bytes": full, "allocated_bytes": worst["allocated_bytes"],
                "allocated_bytes_split_gemm": max(x["allocated_bytes_split_gemm"] for x in per_gpu),
                "saved_fraction": 1 - worst["allocated_bytes"] / full if full else 0.0,
                "per_gpu": per_gpu, "by_kind": by_kind}


SPLIT_CAPABLE = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight",
                 "merger.fc1.weight", "merger.fc2.weight", "output_layer.weight")


def split_capable(name: str) -> bool:
    """Weights of megatron's tensor-parallel linears: the split-GEMM executor can run them."""
    return name.endswith(SPLIT_CAPABLE)


def split_local(p: "TensorPlan") -> bool:
    """A `local_permute` tensor the split-GEMM executor serves from views alone: every element is in
    the local shard (no padding to make up) and the layer is a tensor-parallel linear."""
    return (p.klass == "local_permute" and split_capable(p.name) and p.positions is not None
            and bool((p.positions >= 0).all()))


def split_gemm_bytes(p: "TensorPlan") -> int:
    """What a tensor allocates when split-capable layers run as GEMMs over views: the remote pieces of
    a gathered weight, nothing for a local permutation the views cover, else the plan's bytes."""
    if p.klass == "gather" and split_capable(p.name):
        return p.remote_bytes
    if split_local(p):
        return 0
    return p.alloc_bytes


def positions_in(have: WL.ShardIndex, need: WL.ShardIndex) -> torch.Tensor:
    """For each element of the needed shard, its position in the local shard (-1 remote, -2 pad)."""
    if need.dim is None:
        return None
    inv = torch.full((need.canonical,), -1, dtype=torch.long)
    if have.dim is None:
        inv = torch.arange(need.canonical)
    else:
        ok = have.index >= 0
        inv[have.index[ok]] = torch.arange(have.index.numel())[ok]
    pos = torch.where(need.index >= 0, inv[need.index.clamp_min(0)], torch.full_like(need.index, -2))
    return _match_padding_tail(have, need, pos)


def _match_padding_tail(have: WL.ShardIndex, need: WL.ShardIndex, pos: torch.Tensor) -> torch.Tensor:
    """Map a padding tail of the needed shard onto the padding rows that follow it locally.

    Padding rows are zeros on both sides, so when the local shard already has them right after
    the last needed real row, they are as good as real rows (the shard stays a view).
    """
    if have.dim is None or not (pos == -2).any():
        return pos
    n_pad = int((need.index < 0).sum())
    if not bool((need.index[-n_pad:] < 0).all()) or n_pad == pos.numel():
        return pos
    start = int(pos[-n_pad - 1]) + 1
    if start + n_pad <= have.index.numel() and bool((have.index[start:start + n_pad] < 0).all()):
        pos = pos.clone()
        pos[-n_pad:] = torch.arange(start, start + n_pad)
    return pos


def classify(have: WL.ShardIndex, need: WL.ShardIndex, local_extent: int) -> tuple[str, torch.Tensor | None]:
    """The class of one rollout shard given the local training shard (`local_extent` along dim)."""
    if need.dim is None:
        return "view", None
    pos = positions_in(have, need)
    if (pos == -1).any():
        return "gather", pos
    if (pos == -2).any():
        return "local_permute", pos
    if torch.equal(pos, pos[0] + torch.arange(pos.numel())):
        if need.dim == 0 or pos.numel() == local_extent:
            return "view", pos
        return "strided_view", pos
    return "local_permute", pos


MAPPINGS = ("aligned", "consecutive")


def check_degrees(t: int, r: int, mapping: str) -> None:
    """Training and rollout TP degrees must nest for a shared layout."""
    if mapping not in MAPPINGS:
        raise ValueError(f"unknown GPU mapping {mapping!r}; choose aligned or consecutive")
    if max(t, r) % min(t, r):
        raise ValueError(f"parallel.tp={t} and rollout.tp={r}: one must divide the other")


def plan_weights(cfg: ModelConfig, t: int, r: int, layout: str = "megatron", elem_bytes: int = 2,
                 mapping: str = "aligned") -> WeightPlan:
    """The plan for every GPU of a W = max(t, r) GPU group (training PP=1, rollout PP=1)."""
    check_degrees(t, r, mapping)
    world = max(t, r)
    pairs = rank_pairs(t, r, world) if mapping == "aligned" else [(g % t, g % r) for g in range(world)]
    plan = WeightPlan(t, r, layout)
    plan.gpus = plan_pairs(cfg, t, r, pairs, layout, elem_bytes)
    return plan


def rank_pairs(t: int, r: int, world: int) -> list[tuple[int, int]]:
    """(training TP rank, rollout TP rank) of every rank of a `world`-rank run under the aligned
    mapping `dist.ParallelLayouts` builds (PP=1)."""
    block = max(t, r)
    return [(aligned_coordinates(g, t, block)[0], aligned_coordinates(g, r, block)[0]) for g in range(world)]


def plan_pairs(cfg: ModelConfig, t: int, r: int, pairs: list[tuple[int, int]], layout: str = "megatron",
               elem_bytes: int = 2) -> list[list[TensorPlan]]:
    """Per (training TP rank, rollout TP rank) pair: how each rollout tensor is obtained on a GPU that
    holds that training shard and needs that rollout shard."""
    if layout not in WL.LAYOUTS:
        raise ValueError(f"unknown rollout layout {layout!r}; choose megatron or sglang")
    check_degrees(t, r, "aligned")
    hf = model_spec(cfg).hf
    naming = hf.naming()
    shapes = hf.shapes(cfg, naming)
    rules = [x for x in hf.rules(cfg, t, 1, naming) if x.export]
    rules_r = {x.mcore: x for x in hf.rules(cfg, r, 1, naming)}
    out = []
    for tr, rr in pairs:
        plans = []
        for rule in rules:
            sh = [shapes[n] for n in rule.hf]
            have = WL.megatron_index(rule, sh, t, tr)
            need = WL.shard_index(layout, rules_r[rule.mcore], sh, r, rr, cfg)
            other = prod(sh[0]) // sh[0][need.dim] if need.dim is not None else prod(sh[0])
            extent = have.index.numel() if have.dim is not None else (need.canonical if need.dim is not None else 0)
            klass, pos = classify(have, need, extent)
            n = need.index.numel() if need.dim is not None else 1
            shard = n * other * elem_bytes
            remote = int((pos == -1).sum()) * other * elem_bytes if pos is not None else 0
            plans.append(TensorPlan(rule.mcore, WL.kind_of(rule), klass, need.dim, pos, shard,
                                    0 if klass in ("view", "strided_view") else shard, remote, rule, sh, need))
        out.append(plans)
    return out
