"""The memory planner's per-phase peaks for each mode of a `bench` record against the peaks that record measured.
Runs on CPU: each mode's plan is made again from the record's suite, its auto choices and budget, with the GPU
run's kernels (fused RMSNorm, RoPE and log-prob: the interpreter stands in for CUDA), by the same function the
trainer calls at start-up (`trainer/runtime.memory_plan`), so a planner change is seen against real peaks.

    python benchmarks/plan_vs_measured.py benchmarks/results/bench_video_long_defaults_h100_1198c06.json \
        --out benchmarks/results/plan_vs_measured_video_long_defaults_h100.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the kernels the GPU run resolved, accepted without CUDA (before any Triton import)
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from rollplex_megatron.data import build_source  # noqa: E402
from rollplex_megatron.recipes import load_run_config  # noqa: E402
from rollplex_megatron.runtime import environment_record  # noqa: E402
from rollplex_megatron.trainer.runtime import memory_plan  # noqa: E402

GPU_KERNELS = ["train.norm_kernel=triton", "train.rope_kernel=triton", "train.logprob_kernel=triton"]


def overrides(suite: str, mode: str, choices: dict, extra: list[str] = ()) -> list[str]:
    """A recorded mode's settings: its suite and the record's own overrides (`extra`, e.g. model=...), the planner's
    recorded auto choices and the budget they were made under, and the GPU run's kernels."""
    out = [f"+bench={suite}", *extra, f"mode.name={mode}", *GPU_KERNELS, f"memory.budget_gib={choices['budget_gib']}"]
    return out + [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in choices.items()
                  if k != "budget_gib"]


def compare(record: dict) -> dict:
    """{mode: {released (the recorded set, planned as it ran), released_now (what `memory.plan=auto` would
    release now under the record's budget), phases: {phase: planned, measured, planned / measured}}}."""
    out = {}
    for mode, m in record["modes"].items():
        cfg = load_run_config(overrides(record["suite"], mode, m["planned"]["auto_choices"],
                                        record.get("overrides", [])))
        source = build_source(cfg)
        ran = frozenset(m["memory"]["released"])
        plan = memory_plan(cfg, source, release=ran)
        phases = {ph: {"planned_gib": round(gib, 3), "measured_gib": round(m["phase_peak_gib"][ph], 3),
                       "planned_over_measured": round(gib / m["phase_peak_gib"][ph], 3)}
                  for ph, gib in plan["phase_gib"].items() if ph in m["phase_peak_gib"]}
        out[mode] = {"released": sorted(plan["released"]),
                     "released_now": sorted(memory_plan(cfg, source)["released"]), "phases": phases}
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("record", help="a bench JSON with per-mode planned auto choices and measured phase peaks")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    record = json.loads(Path(a.record).read_text())
    res = {"command": "python " + " ".join(sys.argv), "record": Path(a.record).name, "suite": record["suite"],
           "record_environment": record["environment"], "modes": compare(record),
           "environment": environment_record()}
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    for mode, m in res["modes"].items():
        print(mode, {ph: v["planned_over_measured"] for ph, v in m["phases"].items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
