"""Per-layer prefix K/V of each group: autograd leaves (fp32 masters) and the graph tensors behind them.

Legend: P = prefix tokens, Ng = KV groups per TP rank, D = head dim.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class KVStore:
    """Per-layer prefix K/V of each group: the autograd leaves and the graph tensors behind them."""

    leaves: dict = field(default_factory=dict)  # (layer, group) -> (k_leaf, v_leaf) [P,1,Ng,D]
    graph: dict = field(default_factory=dict)  # (layer, group) -> (k, v) graph outputs (actor only)
    graph_only: bool = False  # a recomputation's store: graph outputs only, no leaves
    recompute_drift: float = 0.0  # largest |recomputed - stored| K/V seen by prefix_backward

    def record(self, layer: int, group: int, key, value, keep_graph: bool, trainable: bool = False) -> None:
        """Store a prefix's K/V; leaves get gradients when the graph is kept or `trainable`.

        Actor leaves are fp32 masters of the K/V (exact copies), so gK/gV summed over every
        response and micro-batch accumulate in fp32, as megatron's main_grad does for weights;
        `kv()` hands attention the K/V in the compute dtype. `trainable` without `keep_graph` is the
        recompute plan: the leaves take gradients, and the graph is rebuilt at prefix-backward time.
        """
        if keep_graph:
            self.graph[(layer, group)] = (key, value)
            if self.graph_only:
                return
        if keep_graph or trainable:
            self.leaves[(layer, group)] = (key.detach().float().requires_grad_(),
                                           value.detach().float().requires_grad_())
        else:  # compact: megatron's V (and K without rotary) are views of the fused QKV projection, which a
            # view would keep alive for every layer, (Nq + 2 Ng) / (2 Ng) times the K/V (5x at 3B)
            self.leaves[(layer, group)] = (key.detach().contiguous(), value.detach().contiguous())

    def kv(self, layer: int, group: int, dtype: torch.dtype):
        """The prefix K/V of (layer, group) in `dtype` (differentiable back to the leaves)."""
        k, v = self.leaves[(layer, group)]
        return k.to(dtype), v.to(dtype)

    def backward_pairs(self, group: int, graph: dict | None = None) -> tuple[list, list]:
        """Graph tensors of `group` and the gradients accumulated on their leaves (skip untouched).

        `graph`: the graph outputs of a recomputed prefix (another store's `graph`) instead of ours."""
        outs, grads = [], []
        for (layer, g), kv in (self.graph if graph is None else graph).items():
            if g != group:
                continue
            for t, leaf in zip(kv, self.leaves[(layer, g)]):
                if leaf.grad is not None:
                    outs.append(t)
                    grads.append(leaf.grad.to(t.dtype))
        return outs, grads

    def nbytes(self) -> tuple[int, int]:
        """Bytes of the K/V leaves and of the gradients accumulated on them (gK/gV)."""
        kv = sum(t.nbytes for pair in self.leaves.values() for t in pair)
        grads = sum(t.grad.nbytes for pair in self.leaves.values() for t in pair if t.grad is not None)
        return kv, grads

    def adopt(self, other: "KVStore", src: int, dst: int) -> None:
        """Move group `src` of `other` into this store as group `dst` (a batch assembled from several
        rollout rounds, each with its own store)."""
        for key in [k for k in other.leaves if k[1] == src]:
            self.leaves[(key[0], dst)] = other.leaves.pop(key)
            if key in other.graph:
                self.graph[(key[0], dst)] = other.graph.pop(key)

    def release(self, group: int) -> None:
        """Drop a group's K/V and graph once its prefix backward is done."""
        for key in [k for k in self.leaves if k[1] == group]:
            self.leaves.pop(key, None)
            self.graph.pop(key, None)
