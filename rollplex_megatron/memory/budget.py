"""A plan's peak against the memory it may use: `memory.budget_gib` (`check_budget`) and the machine's free memory
(`check_machine`, memory/machine.py), each failing with one line that names the peak phase, its largest class and
what would shrink it, in the config's terms.
"""
from __future__ import annotations

from rollplex_megatron.memory.planner import GIB


FIXES = {  # what shrinks each class, in the config's terms
    "optimizer_states": "plan.distributed_optimizer=true (shard over DP) or a larger parallel.tp/pp",
    "main_weights": "plan.distributed_optimizer=true (shard over DP) or a larger parallel.tp/pp",
    "optimizer_workspace": "a fused Adam (plan.fused_adam=true where transformer-engine or apex is installed) or "
                           "a larger parallel.tp/pp",
    "grads": "a larger parallel.tp/pp",
    "reference_weights": "a larger parallel.tp/pp",
    "rollout_kv": "a smaller memory.kv_cache_gib (more waves), fewer prompts per DP rank or a larger parallel.tp",
    "actor_prefix_graph": "fewer prompts per DP rank",
    "reference_prefix_graphs": "a smaller mode.window_graph_buckets or workload.prefix_pack_tokens, or "
                               "mode.window_graphs=false",
    "actor_prefix_kv": "fewer prompts per DP rank or shorter prompts",
    "update_activations": "fewer workload.responses_per_micro_batch (or a smaller workload.micro_batch_tokens "
                          "when set), a smaller workload.prefix_pack_tokens (a recomputed pack's graph), "
                          "plan.sequence_parallel=true or a larger parallel.tp",
}
RUNTIME_FIXES = {  # the trainer honours no plan.* setting: only what its own config changes
    "optimizer_states": "memory.optimizer_step=stream (streamed from host memory through the step) or a larger "
                        "parallel.tp/pp",
    "main_weights": "memory.optimizer_step=stream (streamed from host memory through the step) or a larger "
                    "parallel.tp/pp",
    "optimizer_workspace": "memory.optimizer_step=stream (one bucket's workspace) or a larger parallel.tp/pp (or "
                           "transformer-engine/apex installed: a fused Adam)",
    "update_activations": "fewer workload.responses_per_micro_batch (or a smaller workload.micro_batch_tokens "
                          "when set), a smaller workload.prefix_pack_tokens (a recomputed pack's graph) or a "
                          "larger parallel.tp",
}
RELEASED_BY_PHASE_PLAN = {"main_weights", "optimizer_states", "grads", "reference_weights", "actor_prefix_graph"}


def gib_text(x: float) -> str:
    """A GiB figure for a message: one decimal, or three significant digits below 1 GiB (never a bare 0.0)."""
    return f"{x:.1f}" if x >= 1 else f"{x:.3g}"


def check_cap(summary: dict, cap_gib: float, mode: str) -> None:
    """`memory.cap_gib` under the plan's peak: the allocator would stop the run out of memory in that phase."""
    if cap_gib > 0 and summary["peak_gib"] > cap_gib:
        raise ValueError(f"memory.cap_gib={cap_gib:g} is under the {mode} plan's peak of "
                         f"{gib_text(summary['peak_gib'])} GiB (phase {summary['peak_phase']!r}), so the run would "
                         f"stop out of memory there; raise the cap to at least that, or set "
                         f"memory.budget_gib={cap_gib:g} so the plan fits under it")


def check_budget(summary: dict, budget_gib: float, mode: str, runtime: bool = False, fit=None) -> None:
    """Fail, naming the largest class of the peak phase and what would free it, when over budget.

    `runtime`: the trainer's check (its fixes name only settings the trainer honours); `fit`: a callable giving
    the settings that would make the run fit (`fit_fixes`), asked only when over, in place of the class's fix."""
    if budget_gib <= 0 or summary["peak_gib"] <= budget_gib:
        return
    phase = summary["peak_phase"]
    top = max(summary["by_phase_gib"][phase].items(), key=lambda kv: kv[1])
    fixes = {**FIXES, **RUNTIME_FIXES} if runtime else FIXES
    fix = fixes.get(top[0], "a larger parallel.tp/pp or a smaller workload")
    if top[0] in RELEASED_BY_PHASE_PLAN and summary["classes"][top[0]]["action"] == "keep":
        fix = f"memory.plan=phase (releases it outside its phases), or {fix}"
    fix = (fit() if fit is not None else "") or fix
    raise ValueError(f"{mode} plan needs {gib_text(summary['peak_gib'])} GiB in phase {phase!r}, over "
                     f"memory.budget_gib={budget_gib:g}; the largest class there is {top[0]} ({gib_text(top[1])} "
                     f"GiB); to fit: {fix}")


# Classes the batch does not size: over the machine, the model or its layout is the fix, not the batch.
MODEL_CLASSES = ("actor_weights", "main_weights", "grads", "optimizer_states", "reference_weights",
                 "optimizer_workspace", "rollout_weights")


def machine_need_gib(summary: dict, cuda: bool) -> float:
    """What the plan holds at its peak on the memory that backs the device: the peak phase; on CPU, where that is
    host memory, also the host copies of the classes it offloads (memory/manager.py keeps them all run)."""
    if cuda:
        return summary["peak_gib"]
    return summary["peak_gib"] + sum(c["gib"] for c in summary["classes"].values() if c["action"] == "offload")


def check_machine(summary: dict, need_gib: float, free_gib: float, what: str, batch: str) -> None:
    """Fail when the plan cannot fit the memory this rank has (`free_gib` of `what`), naming the largest class of
    the peak phase and, when the batch sizes it, the batch's settings (`batch`: the shape and what lowers it)."""
    if need_gib <= free_gib:
        return
    phase = summary["peak_phase"]
    top, gib = max(summary["by_phase_gib"][phase].items(), key=lambda kv: kv[1])
    if top in MODEL_CLASSES:
        fix = f"to fit: {RUNTIME_FIXES.get(top, FIXES.get(top, 'a larger parallel.tp/pp'))}, or a smaller model"
    else:  # the update's micro-batches have a setting of their own
        fix = batch + (f"; or {RUNTIME_FIXES[top]}" if top in RUNTIME_FIXES else "")
    raise ValueError(f"this run needs {gib_text(need_gib)} GiB per rank ({need_gib * GIB:.3g} bytes; peak phase "
                     f"{phase!r}, largest class {top} {gib_text(gib)} GiB), over the {gib_text(free_gib)} GiB of "
                     f"{what}; {fix}")
