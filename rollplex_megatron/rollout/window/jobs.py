"""Window items as data: what an engine in another process (SGLang's scheduler, through the bridge) runs.

The embedded engine calls a `WorkItem`'s function in this process. An engine that decodes in another
process cannot call it, so the trainer also describes each prefix-stage item as a `PrefixJob`: which
module, which prompt, and where its K/V go. The other process runs the prefix stage without a graph
and sends the K/V back; `accept` records them as the in-process item would have (reference: K/V
only; actor under the recompute plan: trainable leaves and the recompute state the prefix backward
reads), so what the trainer holds afterwards does not depend on which engine decoded.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rollplex_megatron.attention.kv_store import KVStore
from rollplex_megatron.prefix.batch import Group, Prompt
from rollplex_megatron.prefix.execution import PrefixState

MODULES = ("reference", "actor")


@dataclass
class PrefixJob:
    """The prefix stage of one group, as data."""

    module: str  # reference | actor
    prompt: Prompt
    store: KVStore  # where the K/V are recorded
    group: int  # the group's id in `store`
    trainable: bool = False  # record trainable leaves (the actor under the recompute plan)
    states: list | None = None  # the actor's prefix states: the recompute plan is appended here

    def __post_init__(self) -> None:
        if self.module not in MODULES:
            raise ValueError(f"prefix job module must be one of {MODULES}, got {self.module!r}")

    def accept(self, kv: dict) -> None:
        """Record the K/V computed elsewhere ({layer: (k, v)}) as the in-process item would."""
        for layer in sorted(kv):
            k, v = kv[layer]
            self.store.record(layer, self.group, k, v, keep_graph=False, trainable=self.trainable)
        if self.states is not None:  # prefix_forward(recompute=True) on the first (only) stage appends the same
            self.states.append(PrefixState(self.group, self.prompt.input_ids.numel() - 1, None, None,
                                           Group(self.prompt, [], torch.zeros(0))))
