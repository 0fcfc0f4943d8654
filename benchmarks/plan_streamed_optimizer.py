"""The planner's optimizer phase with and without `memory.optimizer_step=stream`, for each mode of the video_long
suite (3B, `memory.plan=phase`); one JSON to stdout. No GPU: the planner only."""
import json

from rollplex_megatron.memory import planner as M
from rollplex_megatron.recipes import load_run_config
from rollplex_megatron.runtime import environment_record


def summary(mode: str, step: str) -> dict:
    """Per-phase GiB and the peak of `mode` under the phase plan with this optimizer step."""
    cfg = load_run_config(["+bench=video_long", "model=qwen2_5_vl_3b", f"mode.name={mode}", "memory.plan=phase",
                           f"memory.optimizer_step={step}"])
    s = M.summarize(M.runtime_plan(cfg, M.workload_shape(cfg)), mode)
    return {"phase_gib": s["phase_gib"], "peak_phase": s["peak_phase"], "peak_gib": s["peak_gib"],
            "optimizer_phase_classes_gib": s["by_phase_gib"]["optimizer"]}


def main() -> None:
    rows = [{"mode": mode, "optimizer_step": step, **summary(mode, step)}
            for mode in ("serial", "prefix_shared", "rollplex") for step in ("resident", "stream")]
    print(json.dumps({"what": "the planner's per-phase GiB on the video_long suite (qwen2_5_vl_3b, memory.plan=phase) "
                              "with the resident and the streamed optimizer step",
                      "command": "python benchmarks/plan_streamed_optimizer.py",
                      "environment": environment_record(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
