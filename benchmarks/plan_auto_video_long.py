"""memory.plan=auto on the video_long suite: what the planner releases under a 134 GiB budget, with torch's
RMSNorm and with the fused one (TRITON_INTERPRET=1 lets train.norm_kernel=triton resolve on CPU); one JSON
to stdout. No GPU: the planner only. `--model qwen2_5_vl_7b` plans another preset; a mode that fits under
no release records the planner's refusal (the phase, its peak and largest class) instead of a choice.
`--pack N` instead records, under memory.plan=phase, how far the trainer lowers the actor's prefix packs of
`workload.prefix_pack_tokens=N` under the same budget (trainer.runtime.actor_pack_tokens). `--tokens N,...`
records, under memory.plan=phase, each mode's peak at those `workload.micro_batch_tokens` budgets (serial at
the suite's prefix packing, none; the prefix modes with `--pack`'s packs, lowered as the trainer lowers them),
so a comparison can say which mode fits which micro-batch. The planner counts a budget as responses of
`plan.response_tokens` (the suite's mean); shorter drawn responses put more of them (for serial, more whole
prompts) into a micro-batch, so the fit is optimistic for serial."""
import argparse
import json
import sys

from rollplex_megatron.memory.auto import ahead_phases, auto_release
from rollplex_megatron.memory.planner import pack_groups, plan, released, runtime_cfg, summarize, workload_shape
from rollplex_megatron.recipes import load_run_config
from rollplex_megatron.runtime import environment_record
from rollplex_megatron.trainer.runtime import with_pack_tokens, actor_pack_tokens

BUDGET_GIB = 134.0  # the H200's free memory at start-up less memory.auto_margin_gib, rounded down


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="qwen2_5_vl_3b", help="a recipes/model preset")
    ap.add_argument("--pack", type=int, default=0, help="workload.prefix_pack_tokens to lower under the budget")
    ap.add_argument("--tokens", default="", help="workload.micro_batch_tokens budgets to plan (comma-separated)")
    ap.add_argument("--ahead", default="", help="TOKENS,PACK: memory.prefetch_ahead's choice (see ahead_rows)")
    a = ap.parse_args()
    if a.ahead:
        tokens, pack = (int(x) for x in a.ahead.split(","))
        return ahead_rows(a.model, tokens, pack)
    if a.tokens:
        return token_rows(a.model, [int(x) for x in a.tokens.split(",")], a.pack)
    if a.pack:
        return pack_rows(a.model, a.pack)
    model = a.model
    rows = []
    for norm in ("torch", "triton"):
        for mode in ("serial", "prefix_shared", "rollplex"):
            cfg = load_run_config(["+bench=video_long", f"model={model}", f"mode.name={mode}", "memory.plan=auto",
                                   f"train.norm_kernel={norm}"])
            s = workload_shape(cfg)

            def peak(residency) -> float:
                return round(summarize(plan(runtime_cfg(cfg), mode, residency, "embedded", s), mode)["peak_gib"], 1)

            row = {"mode": mode, "norm_kernel": norm, "budget_gib": BUDGET_GIB, "keep_peak_gib": peak(frozenset()),
                   "phase_peak_gib": peak("phase")}
            try:
                rel = auto_release(cfg, s, BUDGET_GIB)
                row.update(fits=True, released=sorted(rel), peak_gib=peak(rel))
            except ValueError as e:  # even releasing every releasable class goes over the budget
                row.update(fits=False, refusal=str(e))
            rows.append(row)
    cmd = "TRITON_INTERPRET=1 python benchmarks/plan_auto_video_long.py" + ("" if model == "qwen2_5_vl_3b" else
                                                                             f" --model {model}")
    json.dump({"what": f"memory.plan=auto's choice on the video_long suite, model {model}, under {BUDGET_GIB:g} GiB "
               "(the planner)", "command": cmd, "environment": environment_record(), "rows": rows},
              sys.stdout, indent=1)


def pack_rows(model: str, pack: int) -> None:
    """The actor's packs the trainer keeps of `pack` tokens under the budget (memory.plan=phase, fused norm)."""
    rows = []
    for mode in ("prefix_shared", "rollplex"):
        cfg = load_run_config(["+bench=video_long", f"model={model}", f"mode.name={mode}", "memory.plan=phase",
                               f"workload.prefix_pack_tokens={pack}"])
        s = workload_shape(cfg)
        kept = actor_pack_tokens(cfg, s, BUDGET_GIB, released("phase"))

        def summary(tokens):
            return summarize(plan(runtime_cfg(with_pack_tokens(cfg, tokens)), mode, "phase", "embedded", s), mode)

        one, got, asked = summary(0), summary(kept), summary(pack)
        rows.append({"mode": mode, "prefix_tokens": s.P, "groups": s.prompts, "budget_gib": BUDGET_GIB,
                     "asked_pack_tokens": pack, "asked_peak_gib": round(asked["peak_gib"], 1),
                     "actor_pack_tokens": kept, "actor_pack_groups": pack_groups(with_pack_tokens(cfg, kept), s),
                     "peak_gib": round(got["peak_gib"], 1), "peak_phase": got["peak_phase"],
                     "one_group_graph_gib": round(one["classes"]["update_activations"]["gib"], 1)})
    json.dump({"what": f"how far the trainer lowers workload.prefix_pack_tokens={pack} for the actor's recomputed "
               f"prefix packs on the video_long suite, model {model}, memory.plan=phase, under {BUDGET_GIB:g} GiB "
               "(the planner)",
               "command": f"TRITON_INTERPRET=1 python benchmarks/plan_auto_video_long.py --pack {pack}",
               "environment": environment_record(), "rows": rows}, sys.stdout, indent=1)


def token_rows(model: str, budgets: list[int], pack: int) -> None:
    """Each mode's planned peak at each micro-batch token budget (memory.plan=phase, fused norm and RoPE)."""
    rows = []
    for mode in ("serial", "prefix_shared", "rollplex"):
        for tokens in budgets:
            over = ["+bench=video_long", f"model={model}", f"mode.name={mode}", "memory.plan=phase",
                    f"workload.micro_batch_tokens={tokens}"]
            cfg = load_run_config(over + ([f"workload.prefix_pack_tokens={pack}"] if pack and mode != "serial" else []))
            s = workload_shape(cfg)
            kept = actor_pack_tokens(cfg, s, BUDGET_GIB, released("phase")) if pack and mode != "serial" else 0
            got = summarize(plan(runtime_cfg(with_pack_tokens(cfg, kept)), mode, "phase", "embedded", s), mode)
            rows.append({"mode": mode, "micro_batch_tokens": tokens, "actor_pack_tokens": kept,
                         "peak_gib": round(got["peak_gib"], 1), "peak_phase": got["peak_phase"],
                         "update_gib": round(sum(got["by_phase_gib"]["update"].values()), 1),
                         "fits": got["peak_gib"] <= BUDGET_GIB})
    cmd = f"TRITON_INTERPRET=1 python benchmarks/plan_auto_video_long.py --tokens {','.join(map(str, budgets))}" + (
        f" --pack {pack}" if pack else "")
    json.dump({"what": f"each mode's planned peak at workload.micro_batch_tokens budgets on the video_long suite, "
               f"model {model}, memory.plan=phase, under {BUDGET_GIB:g} GiB (the planner; the prefix modes' actor "
               f"packs lowered as the trainer lowers them); a micro-batch is counted as budget / "
               f"plan.response_tokens responses of that length: shorter drawn responses put more of them (for "
               f"serial, more whole prompts and vision towers) into one, so the fit is optimistic for serial",
               "command": cmd, "environment": environment_record(),
               "rows": rows}, sys.stdout, indent=1)


def ahead_rows(model: str, tokens: int, pack: int) -> None:
    """memory.prefetch_ahead's choice (auto.ahead_phases) under memory.plan=phase and the budget, with the fused
    norm the GPU runs: at the suite's batching, and for the prefix modes at `tokens` / `pack` (the actor's packs
    lowered as the trainer lowers them); each row has the phases' totals without and with the early classes."""
    rows = []
    for mode in ("serial", "prefix_shared", "rollplex"):
        for packed in (False, True):
            if packed and mode == "serial":
                continue
            over = ["+bench=video_long", f"model={model}", f"mode.name={mode}", "memory.plan=phase",
                    "train.norm_kernel=triton"]
            over += [f"workload.micro_batch_tokens={tokens}", f"workload.prefix_pack_tokens={pack}"] if packed else []
            cfg = load_run_config(over)
            s = workload_shape(cfg)
            kept = actor_pack_tokens(cfg, s, BUDGET_GIB, released("phase")) if packed else 0
            rc = runtime_cfg(with_pack_tokens(cfg, kept))
            ahead = ahead_phases(rc, mode, "phase", s, BUDGET_GIB)
            base, early = (summarize(plan(rc, mode, "phase", "embedded", s, a), mode) for a in ({}, ahead))
            rows.append({"mode": mode, "micro_batch_tokens": tokens if packed else 0, "actor_pack_tokens": kept,
                         "budget_gib": BUDGET_GIB, "ahead": ahead,
                         "class_gib": {n: round(base["classes"][n]["gib"], 1)
                                       for n in ("optimizer_states", "main_weights", "reference_weights")},
                         "phase_gib": {k: round(v, 1) for k, v in base["phase_gib"].items()},
                         "phase_gib_ahead": {k: round(v, 1) for k, v in early["phase_gib"].items()}})
    json.dump({"what": f"memory.prefetch_ahead's choice on the video_long suite, model {model}, memory.plan=phase, "
               f"under {BUDGET_GIB:g} GiB (the planner): which released classes come back a phase early, and each "
               f"phase's planned total without and with them",
               "command": f"TRITON_INTERPRET=1 python benchmarks/plan_auto_video_long.py --ahead {tokens},{pack}",
               "environment": environment_record(), "rows": rows}, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
