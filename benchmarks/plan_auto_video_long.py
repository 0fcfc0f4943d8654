"""memory.plan=auto on the video_long suite: what the planner releases under a 134 GiB budget, with torch's
RMSNorm and with the fused one (TRITON_INTERPRET=1 lets train.norm_kernel=triton resolve on CPU); one JSON
to stdout. No GPU: the planner only."""
import json
import sys

from rollplex_megatron.memory.planner import auto_release, plan, runtime_cfg, summarize, workload_shape
from rollplex_megatron.recipes import load_run_config
from rollplex_megatron.runtime import environment_record

BUDGET_GIB = 134.0  # the H200's free memory at start-up less memory.auto_margin_gib, rounded down


def main() -> None:
    rows = []
    for norm in ("torch", "triton"):
        for mode in ("serial", "prefix_shared", "rollplex"):
            cfg = load_run_config(["+bench=video_long", f"mode.name={mode}", "memory.plan=auto",
                                   f"train.norm_kernel={norm}"])
            s = workload_shape(cfg)
            rel = auto_release(cfg, s, BUDGET_GIB)

            def peak(residency) -> float:
                return round(summarize(plan(runtime_cfg(cfg), mode, residency, "embedded", s), mode)["peak_gib"], 1)

            rows.append({"mode": mode, "norm_kernel": norm, "budget_gib": BUDGET_GIB, "released": sorted(rel),
                         "peak_gib": peak(rel), "keep_peak_gib": peak(frozenset()), "phase_peak_gib": peak("phase")})
    json.dump({"what": f"memory.plan=auto's choice on the video_long suite under {BUDGET_GIB:g} GiB (the planner)",
               "command": "TRITON_INTERPRET=1 python benchmarks/plan_auto_video_long.py",
               "environment": environment_record(), "rows": rows}, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
