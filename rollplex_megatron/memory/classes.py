"""The planner's vocabulary, shared with the modes that declare their memory: tensor classes, the
step's shape, and what a mode's declaration is given to size its own classes.

Legend: P = prefix tokens, R = response tokens, mb = responses per micro-batch (under a token budget, enough
R-token responses to cover it: planner.micro_batch_responses).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class TensorClass:
    """One class of tensors: bytes on one GPU, where it lives per phase, and why."""

    name: str
    bytes: int
    resident: tuple[str, ...]  # phases in which it occupies HBM
    action: str  # keep | offload | free | recompute (what the plan does outside `resident`)
    note: str = ""


@dataclass(frozen=True)
class Shape:
    """Per DP rank: prompts, samples, prefix/response tokens, patches, responses per micro-batch."""

    prompts: int
    group: int
    P: int
    R: int
    patches: int
    mb: int
    P_min: int = 0  # the shortest prefix of the sampled prompts (0: all P); packs of shorter ones hold more groups

    @property
    def samples(self) -> int:
        """Sampled responses per DP rank."""
        return self.prompts * self.group


@dataclass(frozen=True)
class PlanInputs:
    """What a mode's `memory_classes` is given (bytes on the fullest GPU)."""

    shape: Shape
    keep: bool  # residency `keep` (everything stays) rather than `phase`
    prefix_kv_fp32: int  # fp32 K/V leaves of every group's prefix (the actor's, with gK/gV of the same size)
    prefix_kv: int  # every group's prefix K/V in the compute dtype
    prefix_graph: int  # one group's saved prefix activations
    logits: Callable[[int], int]  # loss workspace of a forward over `tokens`
    score_logits: Callable[[int], int]  # loss workspace of a forward-only scoring pass over `tokens`
    # a training forward's saved tensors and loss workspace over (tokens, patches, packed: one row of responses over
    # stored prefix K/V, whose loss is counted with the log-prob kernel that runs, as `score_logits`)
    activations: Callable[..., int]
    rounds: int = 1  # rollout rounds a step may sample (dynamic sampling: 1 + train.max_resample_rounds)
    pack_groups: int = 1  # groups whose prefixes run as one forward (workload.prefix_pack_tokens; one recomputed)
