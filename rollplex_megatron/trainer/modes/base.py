"""The contract of an execution mode: its phases, what it keeps in memory, and its step.

A mode is chosen once from `mode.name` (registry: `trainer/modes/__init__.py`). It declares the
phases of one step in order (the timer's and the memory planner's), where the phase plan keeps the
reference weights, and the tensor classes only it holds (`memory_classes`, read by the planner).
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from rollplex_megatron.memory.classes import PlanInputs, TensorClass


class Mode(ABC):
    """One execution strategy of the GRPO step; every mode computes the same update."""

    name: str
    phases: tuple[str, ...]  # the phases of one step, in order
    reference_phases: tuple[str, ...]  # where memory.plan=phase keeps the reference weights

    @abstractmethod
    def step(self, rt, step: int, t):
        """Run one step; returns (StepBatch, the update's loss dicts, mode-specific stats)."""

    @staticmethod
    @abstractmethod
    def memory_classes(p: PlanInputs) -> list[TensorClass]:
        """The tensor classes of this mode's prefix work, scoring workspaces and update activations."""

    @staticmethod
    def rollout(rt, rows, reqs, t, **kw):
        """Rollout and scoring, shared by every mode."""
        with t("rollout"):
            out = rt.engine.generate(reqs, rt.sampling, **kw)
        with t("reward"):
            batch = rt.score(rows, reqs, out)
        return batch, out


def scoring_workspaces(p: PlanInputs, phases: tuple[str, ...], tokens: int) -> list[TensorClass]:
    """One micro-batch's loss workspace per forward-only scoring phase."""
    return [TensorClass(f"{ph}_workspace", p.logits(tokens), (ph,), "free",
                        "one micro-batch's loss workspace (forward only)") for ph in phases]


def response_stage_activations(p: PlanInputs) -> TensorClass:
    """The update's activations when responses run as a response stage over stored prefix K/V."""
    s = p.shape
    act, note = p.activations(s.mb * s.R, 0), "one response micro-batch"
    if not p.keep:
        act, note = max(act, p.prefix_graph), note + ", or one group's recomputed prefix graph (the larger)"
    return TensorClass("update_activations", act, ("update",), "free", note)
