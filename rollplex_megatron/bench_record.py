"""A bench mode's record from its step records: steady medians, warm-up steps apart, per-phase times, parts and
peaks, achieved TFLOP/s, the decode window's figures, the plan beside the measured peaks; and what a suite JSON's
modes give together (`window_cost`, `ratios`).
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from rollplex_megatron.bench_modes import PHASE_FLOPS, label_spec
from rollplex_megatron.recipes import override_key

GIB = 2**30


def _median(xs):
    return statistics.median(xs) if xs else None


def phase_flops(mode: str, rec: dict, recompute: bool) -> dict:
    """Forward+backward FLOPs of each phase of one step record."""
    parts, out = rec["fwd_flops"], {}
    for phase, mult in PHASE_FLOPS[mode].items():
        f = sum(parts[k] * m for k, m in mult.items())
        if phase == "update" and recompute and mode != "serial":
            f += parts["prefix"]
        out[phase] = f
    return out


PREFIX_GRAPH_COUNTERS = ("prefix_graphs_captured", "prefix_graph_replays", "prefix_graph_eager",
                         "prefix_graph_capture_s", "prefix_graph_pool_gib")


def prefix_graph_summary(rollouts: list[dict]) -> dict | None:
    """mode.window_graphs' per-step counters of the steady steps' rollout stats, as medians (None when the
    setting was off), and the reason captures stopped if a step gave one."""
    if not any("prefix_graph_replays" in r for r in rollouts):
        return None
    out = {k: _median([r.get(k, 0) for r in rollouts]) for k in PREFIX_GRAPH_COUNTERS}
    errors = [r["prefix_graph_error"] for r in rollouts if r.get("prefix_graph_error")]
    if errors:
        out["error"] = errors[-1]
    return out


def summarize_mode(label: str, records: list[dict], warmup: int, recompute: bool) -> dict:
    """Step times, the steady medians, the warm-up steps apart, per-phase times, memory, tokens/s,
    achieved TFLOP/s and the decode window's record of one mode, with the mode and the overrides it ran with."""
    mode, over = label_spec(label)
    steady, first = records[warmup:], records[:warmup]
    med = _median([r["step_time_s"] for r in steady])
    phases = list(dict.fromkeys(k for r in records for k in r["phase_times"]))
    phase_med = {p: _median([r["phase_times"].get(p, 0.0) for r in steady]) for p in phases}
    one_update = all(r.get("optimizer_steps", 1) == 1 and "dynamic_sampling" not in r["rollout"] for r in steady)
    flops = [phase_flops(mode, r, recompute) for r in steady]
    # PHASE_FLOPS holds for one update per step on the batch sampled; fwd_flops are the whole job's
    # (every DP rank; divide by the GPU count for per-GPU figures)
    tflops = {p: _median([f[p] / r["phase_times"][p] / 1e12 for f, r in zip(flops, steady)
                          if r["phase_times"].get(p)]) for p in PHASE_FLOPS[mode]} if one_update else {}
    warm = []
    for r in first:  # one-time costs: the phases holding the excess over the steady median
        excess = {p: r["phase_times"].get(p, 0.0) - phase_med[p] for p in phases}
        top = max(excess, key=excess.get)
        warm.append({"step": r["step"], "step_time_s": r["step_time_s"], "excess_s": r["step_time_s"] - med,
                     "phase_excess_s": excess, "largest_in": top, "capture_s": r["rollout"].get("capture_s"),
                     "prefix_graph_capture_s": r["rollout"].get("prefix_graph_capture_s"),
                     "offload_bytes": r.get("offload_bytes")})
    ro = [r["rollout"] for r in steady]
    window = None
    if mode == "rollplex":
        inside, after = _median([x.get("window_s", 0.0) for x in ro]), _median([x.get("after_s", 0.0) for x in ro])
        window = {"mechanism": ro[-1].get("window_mechanism"), "items_in_window": _median([x.get("items_in_window", 0)
                                                                                            for x in ro]),
                  "items_after": _median([x.get("items_after", 0) for x in ro]),
                  "side_work_in_window_s": inside, "side_work_after_s": after,
                  # GPU spans of the same items (CUDA timing events; absent in older records and on CPU)
                  "side_work_in_window_gpu_s": _median([x["window_gpu_s"] for x in ro if "window_gpu_s" in x]),
                  "side_work_after_gpu_s": _median([x["after_gpu_s"] for x in ro if "after_gpu_s" in x]),
                  # the share of the side work that ran inside the decode window (not the share of it
                  # hidden behind decode: compare rollout_excess_s with side_work_in_window_s for that)
                  "in_window_share": inside / (inside + after) if inside + after > 0 else None}
        graphs = prefix_graph_summary(ro)
        if graphs is not None:
            window["prefix_graphs"] = graphs
    return {
        "label": label, "mode": mode, "overrides": list(over),
        "step_times_s": [r["step_time_s"] for r in records], "warmup_steps": warm,
        "steady": {"steps": [r["step"] for r in steady], "median_s": med,
                   "min_s": min(r["step_time_s"] for r in steady), "max_s": max(r["step_time_s"] for r in steady)},
        "phase_median_s": phase_med,
        "phase_parts_s": phase_parts(steady),
        "phase_peak_gib": {p: max(r["phase_peak_bytes"].get(p, 0) for r in steady) / GIB
                           for p in phases if any(p in r["phase_peak_bytes"] for r in steady)},
        "peak_mem_gib": max(r["peak_mem_bytes"] for r in steady) / GIB,
        "peak_mem_source": steady[-1]["peak_mem_source"],
        "response_tokens": _median([r["response_tokens"] for r in steady]),
        "prompt_tokens": _median([r["prompt_tokens"] for r in steady]),
        "decode_tokens_per_s": _median([r["response_tokens"] / r["phase_times"]["rollout"] for r in steady]),
        "step_response_tokens_per_s": _median([r["response_tokens"] / r["step_time_s"] for r in steady]),
        "step_prompt_tokens_per_s": _median([r["prompt_tokens"] / r["step_time_s"] for r in steady]),
        "achieved_tflops": tflops,
        "rollout": {k: _median([x.get(k, 0) for x in ro]) for k in ("decode_steps", "capture_s", "graphs_captured",
                                                                    "prefill_s", "decode_s")},
        "window": window,
        "rollout_layout": steady[-1].get("rollout_layout"),  # a rollout model of its own: bytes it owns, replicas
        # memory.plan and the classes it released (auto: the set chosen for this run's budget)
        "memory": {"plan": steady[-1].get("memory_plan"), "released": steady[-1].get("memory_released")},
    }


def planned_vs_measured(plan_json: Path, mode: dict) -> dict:
    """The run's plan (its memory_plan.json: what the planner chose and its per-phase GiB) beside the allocator's
    per-phase peaks of the steady steps, and start-up's (`setup`): planned over measured per phase (the planner is
    within 10% where the ratio is in [0.9, 1.1]; over 1 it plans more than ran)."""
    plan = json.loads(plan_json.read_text())
    # start-up's peak (the allocator's, at the end of the runtime's construction) beside the step phases'
    measured = {**mode["phase_peak_gib"], **({"setup": plan["measured_setup_gib"]} if "measured_setup_gib" in plan
                                             else {})}
    return {"auto_choices": plan.get("auto_choices", {}), "released": plan.get("released"),
            "phase_gib": plan["phase_gib"], "peak_gib": plan["peak_gib"], "budget_gib": plan.get("auto_budget_gib"),
            "planned_over_measured": {p: plan["phase_gib"][p] / measured[p] for p in plan["phase_gib"]
                                      if measured.get(p)}}


def phase_parts(steady: list[dict]) -> dict:
    """Per phase, per named part (`spans`): the medians over the steady steps of its count, host seconds and GPU
    seconds (CUDA timing events; None on CPU). Records from before the parts were recorded give {}."""
    out: dict[str, dict] = {}
    for phase in dict.fromkeys(p for r in steady for p in r.get("phase_parts", {})):
        names = dict.fromkeys(n for r in steady for n in r.get("phase_parts", {}).get(phase, {}))
        rows = {}
        for n in names:
            got = [r["phase_parts"][phase][n] for r in steady if n in r.get("phase_parts", {}).get(phase, {})]
            gpu = [g["gpu_s"] for g in got if g["gpu_s"] is not None]
            rows[n] = {"count": _median([g["count"] for g in got]), "host_s": _median([g["host_s"] for g in got]),
                       "gpu_s": _median(gpu)}
        out[phase] = rows
    return out


WINDOW_ONLY = ("mode.window_graphs",)  # settings that change only the window's side items, not the decode


def _settings(label: str, window: bool = True) -> frozenset:
    """A mode label's overrides other than its window mechanism (`rollplex[a=1,mode.window=after]` -> {a=1}); with
    `window=False` also without those that change only the side items (`WINDOW_ONLY`): the settings of the same
    decode without them, a prefix_shared mode's. Old labels read as the overrides their variants set."""
    drop = ("mode.window",) if window else ("mode.window", *WINDOW_ONLY)
    return frozenset(o for o in label_spec(label)[1] if override_key(o) not in drop)


def window_cost(modes: dict) -> None:
    """Each rollplex variant's rollout time over that of the prefix_shared mode with the same other variants
    (same decode without side work; a `WINDOW_ONLY` variant such as graphs is matched by the mode without it):
    what the window's side work and the actor prefill's K/V leaves added
    to the rollout phase (`rollout_excess_s`, against `rollout_excess_vs`), and the bound that sets: the
    ratio over that prefix_shared mode had the rollout cost no more than its (`free_window_ratio`: the median
    step less the excess; a free window can reach no further, all else as measured).

    With that mode's rollout `R` and the side work's time alone `S` (its items' CUDA spans in a rollplex run of
    the same settings whose items had the GPU to themselves: `after`, else `interleave`): the window ratio,
    (R + S) / this rollout (`window_ratio`: the rollout alone plus its side work alone over the two together),
    and the most any overlap can give, (R + S) / max(R, S) (`window_ratio_bound`: the side work hidden whole).
    A span holds whatever GPU idle an item's issuing leaves inside it, so `S` is at most the item's work and
    both figures are upper bounds where items are paced by the host."""
    alone_side = {}  # settings -> S, from a run whose items did not share the GPU with decode
    for mech in ("after", "interleave"):
        for k, m in modes.items():
            w = m.get("window") or {}
            if label_spec(k)[0] == "rollplex" and w.get("mechanism") == mech \
                    and w.get("side_work_in_window_gpu_s") is not None:
                side = w["side_work_in_window_gpu_s"] + (w.get("side_work_after_gpu_s") or 0.0)
                alone_side.setdefault(_settings(k), side)
    for k, m in modes.items():
        base = next((b for b in modes if label_spec(b)[0] == "prefix_shared"
                     and _settings(b) == _settings(k, window=False)), None)
        if m.get("window") and base is not None:
            alone = modes[base]["phase_median_s"]["rollout"]
            excess = m["phase_median_s"]["rollout"] - alone
            m["window"]["rollout_excess_s"] = excess
            m["window"]["rollout_excess_vs"] = base
            side = alone_side.get(_settings(k))
            if side is not None:
                m["window"]["window_ratio"] = (alone + side) / m["phase_median_s"]["rollout"]
                m["window"]["window_ratio_bound"] = (alone + side) / max(alone, side)
            if "steady" in m and "steady" in modes[base]:
                m["window"]["free_window_ratio"] = (modes[base]["steady"]["median_s"]
                                                    / (m["steady"]["median_s"] - max(excess, 0.0)))


def ratios(modes: dict) -> dict:
    """`a/b` = median step of a over median step of b: every non-rollplex mode over every rollplex
    mode, each rollplex mode over plain rollplex, a mode with rollout.bound_model=true over the same mode without
    it (what the shared path costs), and one with memory.plan=auto over the same with keep (what auto costs)."""
    med = {k: m["steady"]["median_s"] for k, m in modes.items()}
    spec = {k: (label_spec(k)[0], frozenset(label_spec(k)[1])) for k in med}
    fast = [k for k in modes if spec[k][0] == "rollplex"]
    out = {f"{a}/{b}": med[a] / med[b] for b in fast for a in modes if a not in fast}
    if "rollplex" in med:
        out.update({f"{b}/rollplex": med[b] / med["rollplex"] for b in fast if b != "rollplex"})
    for had, instead in (("rollout.bound_model=true", None), ("memory.plan=auto", "memory.plan=keep")):
        for k, (name, over) in spec.items():
            other = (name, over - {had} | ({instead} if instead else set()))
            base = next((b for b in med if had in over and spec[b] == other), None)
            if base is not None:
                out[f"{k}/{base}"] = med[k] / med[base]
    return out
