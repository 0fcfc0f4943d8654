"""Hugging Face <-> megatron tensor layouts as pure functions per tensor, shared by every model family.

A `Rule` ties one megatron parameter (global layer numbering) to the HF tensors it is made of and
knows how to cut this TP rank's shard from them (`to_shard`) and how to rebuild them from all TP
shards (`from_shards`). A family's HF layout (models/<family>/hf_layout.py) lists its rules in these kinds.
Megatron layouts: fused QKV is group-major `[ng, (np/ng)*hd + 2*hd, ...]`; gated fc1 is `[gate_r; up_r]` on
each rank; row-parallel weights shard dim 1; `pad_to` zero-pads rows or columns (the vocabulary to a multiple of
128*TP, a vision SwiGLU width to a multiple of TP).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from rollplex_megatron.config import ModelConfig


@dataclass(frozen=True)
class Rule:
    """One megatron parameter and the HF tensors that make it."""

    mcore: str  # megatron name with global layer index
    hf: tuple[str, ...]  # HF tensor names, in the order `to_shard` takes them
    kind: str  # replicate | rows | cols | qkv | qkv_fused | fc1
    stage: int  # pipeline stage that holds it (-1: last stage)
    layer: int | None = None  # global LLM layer index (renumbered per stage)
    opts: dict = field(default_factory=dict, hash=False, compare=False)  # kind parameters
    export: bool = True  # False: a tied copy that export must not write twice


def _pad_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    return t if t.shape[0] == n else F.pad(t, [0, 0] * (t.dim() - 1) + [0, n - t.shape[0]])


def _pad_cols(t: torch.Tensor, n: int) -> torch.Tensor:
    return t if t.shape[1] == n else F.pad(t, (0, n - t.shape[1]))


def _qkv_fuse(q, k, v, ng: int) -> torch.Tensor:
    """[q; k; v] (HF) -> megatron group-major fused rows."""
    hd = k.shape[0] // ng
    rest = q.shape[1:]
    qg = q.reshape(ng, -1, *rest)
    kg, vg = k.reshape(ng, hd, *rest), v.reshape(ng, hd, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)


def _qkv_split(fused: torch.Tensor, ng: int, np_: int, hd: int):
    """Megatron group-major fused rows -> (q, k, v) in HF order."""
    rest = fused.shape[1:]
    g = fused.reshape(ng, (np_ // ng + 2) * hd, *rest)
    q, k, v = g.split([np_ // ng * hd, hd, hd], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def to_shard(rule: Rule, tensors: list[torch.Tensor], tp_rank: int, tp: int) -> torch.Tensor:
    """This TP rank's megatron shard from the HF tensors of `rule`."""
    o, k = rule.opts, rule.kind
    if k == "replicate":
        return tensors[0]
    if k == "rows":
        return _pad_rows(tensors[0], o.get("pad_to", tensors[0].shape[0])).chunk(tp)[tp_rank]
    if k == "cols":
        return _pad_cols(tensors[0], o.get("pad_to", tensors[0].shape[1])).chunk(tp, dim=1)[tp_rank]
    if k in ("qkv", "qkv_fused"):
        q, kk, v = tensors if k == "qkv" else tensors[0].chunk(3)
        return _qkv_fuse(q, kk, v, o["ng"]).chunk(tp)[tp_rank]
    if k == "fc1":
        gate, up = (_pad_rows(t, o.get("pad_to", t.shape[0])) for t in tensors)
        return torch.cat([gate.chunk(tp)[tp_rank], up.chunk(tp)[tp_rank]])
    raise ValueError(f"unknown layout kind {k!r} for {rule.mcore}")


def from_shards(rule: Rule, shards: list[torch.Tensor], hf_shapes: list[tuple]) -> list[torch.Tensor]:
    """The HF tensors of `rule` rebuilt from its TP shards (rank order); padding dropped."""
    o, k = rule.opts, rule.kind
    if k == "replicate":
        return [shards[0]]
    if k == "rows":
        return [torch.cat(shards)[: hf_shapes[0][0]]]
    if k == "cols":
        return [torch.cat(shards, dim=1)[:, : hf_shapes[0][1]]]
    if k in ("qkv", "qkv_fused"):
        q, kk, v = _qkv_split(torch.cat(shards), o["ng"], o["np"], o["hd"])
        return [q, kk, v] if k == "qkv" else [torch.cat([q, kk, v])]
    if k == "fc1":
        halves = [s.chunk(2) for s in shards]
        gate = torch.cat([h[0] for h in halves])[: hf_shapes[0][0]]
        up = torch.cat([h[1] for h in halves])[: hf_shapes[1][0]]
        return [gate, up]
    raise ValueError(f"unknown layout kind {k!r} for {rule.mcore}")


def local_name(rule: Rule, cfg: ModelConfig, pp: int) -> str:
    """The parameter's name inside its stage's module (layer index renumbered from 0)."""
    if rule.layer is None:
        return rule.mcore
    local = rule.layer % (cfg.num_layers // pp)
    return rule.mcore.replace(f"layers.{rule.layer}.", f"layers.{local}.", 1)


def stage_rules(rules: list[Rule], stage: int, pp: int) -> list[Rule]:
    """The rules whose parameter lives on pipeline stage `stage`."""
    return [r for r in rules if (r.stage if r.stage >= 0 else pp - 1) == stage]
