"""memory.plan=auto on the video_long suite: what the planner releases under a 134 GiB budget, with torch's
RMSNorm and with the fused one (TRITON_INTERPRET=1 lets train.norm_kernel=triton resolve on CPU); one JSON
to stdout. No GPU: the planner only. `--model qwen2_5_vl_7b` plans another preset; a mode that fits under
no release records the planner's refusal (the phase, its peak and largest class) instead of a choice."""
import argparse
import json
import sys

from rollplex_megatron.memory.planner import auto_release, plan, runtime_cfg, summarize, workload_shape
from rollplex_megatron.recipes import load_run_config
from rollplex_megatron.runtime import environment_record

BUDGET_GIB = 134.0  # the H200's free memory at start-up less memory.auto_margin_gib, rounded down


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="qwen2_5_vl_3b", help="a recipes/model preset")
    model = ap.parse_args().model
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


if __name__ == "__main__":
    main()
