#!/usr/bin/env bash
# GPU machine: measured per-phase allocator peaks of the 3B preset against the planner's prediction,
# for serial colocation (memory.plan=keep) and Rollplex (memory.plan=phase), plus the two crossed
# combinations; bf16, random weights, the long-prefix motion workload. Run from the repo root with
# .whl/ carried:   ROLLPLEX_COMMIT=<sha> STEPS=3 bash benchmarks/gpu_memory.sh
# Writes $OUT/memory_3b.json (command, commit, date, device, versions; per run: predicted and
# measured GiB per phase at the last step, their ratio, managed class bytes, step times).
set -euo pipefail
source benchmarks/gpu_env.sh
steps=${STEPS:-3}
# PYTORCH_CUDA_ALLOC_CONF: the command line sets expandable segments where unset (not for rollout.engine=sglang)
args=(model=qwen2_5_vl_3b dtype=bfloat16 task=motion_long workload=vlm_gpu memory=h200 rollout.group_size=8
      train.steps=$steps train.save_final=false train.progress=false)
runs=${RUNS:-"serial:keep rollplex:phase rollplex:keep serial:phase"}
for r in $runs; do
  mode=${r%%:*}; plan=${r##*:}
  python3 -m rollplex_megatron train "${args[@]}" mode.name=$mode memory.plan=$plan train.out=/tmp/mem/$mode-$plan \
    > /tmp/mem-$mode-$plan.log 2>&1 || { grep -v -i warn /tmp/mem-$mode-$plan.log | tail -25; exit 1; }
done
python3 - "$out/memory_3b.json" "python -m rollplex_megatron train ${args[*]} mode.name=<mode> memory.plan=<plan>" $runs <<'PY'
import json, sys
from rollplex_megatron.runtime import environment_record
GIB = 2**30
res = {"command": sys.argv[2], **environment_record(), "runs": {}}
for r in sys.argv[3:]:
    mode, plan = r.split(":")
    d = f"/tmp/mem/{mode}-{plan}"
    pred = json.load(open(f"{d}/memory_plan.json"))
    recs = [json.loads(line) for line in open(f"{d}/metrics.jsonl")]
    last = recs[-1]
    meas = {k: v / GIB for k, v in last["phase_peak_bytes"].items() if k in pred["phase_gib"]}
    res["runs"][f"{mode}/{plan}"] = {
        "predicted_phase_gib": pred["phase_gib"], "measured_phase_gib": meas,
        "measured_over_predicted": {k: meas[k] / pred["phase_gib"][k] for k in meas},
        "predicted_peak_gib": pred["peak_gib"], "measured_peak_gib": max(meas.values()),
        "predicted_by_phase_gib": pred["by_phase_gib"], "shape": pred["shape"],
        "managed_gib_at_phase_entry": {p: {c: b / GIB for c, b in v.items()} for p, v in last["phase_managed_bytes"].items()},
        "offload_gib": {k: v / GIB for k, v in last["offload_bytes"].items()},
        "step_time_s": [x["step_time_s"] for x in recs], "phase_times_last": last["phase_times"],
        "prefix_recompute_drift": last["rollout"].get("prefix_recompute_drift"),
        "loss": [x["loss"] for x in recs], "grad_norm": [x["grad_norm"] for x in recs]}
    print(r, {k: round(v, 3) for k, v in res["runs"][f"{mode}/{plan}"]["measured_over_predicted"].items()},
          "peak", round(max(meas.values()), 1), "pred", round(pred["peak_gib"], 1))
json.dump(res, open(sys.argv[1], "w"), indent=1)
PY
