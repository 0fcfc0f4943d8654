"""TP layout algebra: which canonical rows/columns each rank's shard holds, per parameter kind.

The canonical tensor of a parameter is its HF components concatenated along the sharded dim
(fused QKV: [q; k; v] rows; gated fc1: [gate; up] rows; row-parallel weights: columns; vocab:
rows). A layout at TP degree d maps rank i to an index vector into that canonical dim, in the
order the shard stores it, with -1 for padding rows/columns.

Layouts:
- `megatron`: derived from the checkpoint rules (the family's HF layout, `models/hf_rules.py`) by sharding index
  vectors instead of weights, so the algebra and the loader cannot disagree.
- `sglang`: QKVParallelLinear ([q; k; v] per rank, KV heads replicated when TP exceeds the KV-head
  count), MergedColumnParallelLinear ([gate; up] per rank), RowParallelLinear (column chunks),
  vocabulary padded to a multiple of 64 (of 64*TP when TP does not divide it), vision MLP width
  rounded up to a multiple of 8.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rollplex_megatron.config import ModelConfig
from rollplex_megatron.models import hf_rules as CL

LAYOUTS = ("megatron", "sglang")


@dataclass(frozen=True)
class ShardIndex:
    """One rank's shard of a parameter: sharded dim (None = full copy) and canonical indices."""

    dim: int | None
    index: torch.Tensor | None  # [n] long, -1 = padding; None when dim is None
    canonical: int  # canonical extent along `dim` (0 when replicated)


def _canonical_sizes(rule: CL.Rule, shapes: list[tuple]) -> tuple[int, list[int]]:
    dim = 1 if rule.kind == "cols" else 0
    return dim, [s[dim] for s in shapes]


def megatron_index(rule: CL.Rule, shapes: list[tuple], d: int, rank: int) -> ShardIndex:
    """Megatron's shard at TP d: the checkpoint layout applied to index vectors (+1 encoded)."""
    if rule.kind == "replicate":
        return ShardIndex(None, None, 0)
    dim, sizes = _canonical_sizes(rule, shapes)
    offs = [0]
    for s in sizes:
        offs.append(offs[-1] + s)
    comps = [torch.arange(offs[i], offs[i + 1]) + 1 for i in range(len(sizes))]  # 0 = padding
    if rule.kind == "qkv_fused":
        comps = [torch.cat(comps)]
    if dim == 1:
        comps = [c[None, :] for c in comps]
    shard = CL.to_shard(rule, comps, rank, d)
    idx = (shard[0] if dim == 1 else shard) - 1
    return ShardIndex(dim, idx.long(), offs[-1])


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def sglang_index(rule: CL.Rule, shapes: list[tuple], d: int, rank: int, cfg: ModelConfig) -> ShardIndex:
    """SGLang's shard at TP d (its QKV / merged-column / row-parallel / vocab rules)."""
    if rule.kind == "replicate":
        return ShardIndex(None, None, 0)
    dim, sizes = _canonical_sizes(rule, shapes)
    total = sum(sizes)
    vision = rule.mcore.startswith("vision.")
    if rule.kind in ("qkv", "qkv_fused"):
        return ShardIndex(0, _sglang_qkv(rule, d, rank), total)
    if rule.kind == "fc1":
        f = sizes[0]
        fp = _round_up(f, 8) if vision else f
        if fp % d:
            raise ValueError(f"{rule.mcore}: SGLang needs the MLP width ({fp}) divisible by TP={d}")
        part = torch.arange(rank * fp // d, (rank + 1) * fp // d)
        gate = torch.where(part < f, part, -1)
        up = torch.where(part < f, part + f, -1)
        return ShardIndex(0, torch.cat([gate, up]), total)
    n = sizes[0]
    if rule.kind == "rows" and ("word_embeddings" in rule.mcore or "output_layer" in rule.mcore):
        padded = _round_up(n, 64)
        if padded % d:
            padded = _round_up(n, 64 * d)
    elif rule.kind == "cols" and vision and "linear_fc2" in rule.mcore:
        padded = _round_up(n, 8)
    else:
        padded = n
    if padded % d:
        raise ValueError(f"{rule.mcore}: extent {padded} not divisible by SGLang TP={d}")
    part = torch.arange(rank * padded // d, (rank + 1) * padded // d)
    return ShardIndex(dim, torch.where(part < n, part, -1), total)


def _sglang_qkv(rule: CL.Rule, d: int, rank: int) -> torch.Tensor:
    nh, nkv, hd = rule.opts["np"], rule.opts["ng"], rule.opts["hd"]
    if nh % d:
        raise ValueError(f"{rule.mcore}: SGLang needs attention heads ({nh}) divisible by TP={d}")
    if nkv >= d and nkv % d:
        raise ValueError(f"{rule.mcore}: SGLang needs KV heads ({nkv}) divisible by TP={d}")
    if nkv < d and d % nkv:
        raise ValueError(f"{rule.mcore}: SGLang needs TP={d} divisible by KV heads ({nkv}) to replicate them")
    q = torch.arange(rank * nh // d * hd, (rank + 1) * nh // d * hd)
    if nkv >= d:
        kv_heads = range(rank * nkv // d, (rank + 1) * nkv // d)
    else:
        kv_heads = [rank // (d // nkv)]
    k = torch.cat([torch.arange(h * hd, (h + 1) * hd) for h in kv_heads]) + nh * hd
    v = k + nkv * hd
    return torch.cat([q, k, v])


def shard_index(layout: str, rule: CL.Rule, shapes: list[tuple], d: int, rank: int,
                cfg: ModelConfig) -> ShardIndex:
    """Dispatch on the layout name."""
    if layout == "megatron":
        return megatron_index(rule, shapes, d, rank)
    if layout == "sglang":
        return sglang_index(rule, shapes, d, rank, cfg)
    raise ValueError(f"unknown rollout layout {layout!r}; choose megatron or sglang")


def kind_of(rule: CL.Rule) -> str:
    """Parameter kind: the megatron name without its layer index (e.g. llm.linear_qkv.weight)."""
    parts = rule.mcore.split(".")
    tower = "vision" if parts[0] == "vision" else "llm"
    if "layers" in parts:
        parts = parts[parts.index("layers") + 2:]
    else:
        parts = parts[1:]
    return f"{tower}.{'.'.join(parts)}"
