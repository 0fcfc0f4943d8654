#!/usr/bin/env bash
# GPU machine: a short GRPO run of the 3B preset per mode (serial, prefix_shared, rollplex), bf16,
# random weights, the long-prefix motion workload. Run from the repo root with .whl/ carried:
#   ROLLPLEX_COMMIT=<sha> STEPS=3 bash benchmarks/gpu_train.sh
# Writes $OUT/train_3b_<mode>.metrics.jsonl, $OUT/train_3b_summary.json (command, commit, date,
# device, versions, per-mode summary) and $OUT/train_3b_report.png.
set -euo pipefail
source benchmarks/gpu_env.sh
steps=${STEPS:-3}
# PYTORCH_CUDA_ALLOC_CONF: the command line sets expandable segments where unset (not for rollout.engine=sglang)
args=(model=qwen2_5_vl_3b dtype=bfloat16 task=motion_long workload=vlm_gpu memory=h200 rollout.group_size=8
      train.steps=$steps train.save_final=false train.progress=false train.out=/tmp/gpu_train)
cmd="python -m rollplex_megatron train --modes serial,prefix_shared,rollplex ${args[*]}"
python3 -m rollplex_megatron train --modes serial,prefix_shared,rollplex "${args[@]}" 2>&1 > /tmp/train.log 2>&1 || { grep -v -i warn /tmp/train.log | tail -25; exit 1; }
grep -v -i warn /tmp/train.log | grep -v "^step" | tail -8
for m in serial prefix_shared rollplex; do cp /tmp/gpu_train/$m/metrics.jsonl "$out/train_3b_$m.metrics.jsonl"; done
cp /tmp/gpu_train/report.png "$out/train_3b_report.png"
python3 - "$out/train_3b_summary.json" "$cmd" <<'PY'
import json, sys
from rollplex_megatron.runtime import environment_record
s = json.load(open("/tmp/gpu_train/summary.json"))
s.update(command=sys.argv[2], **environment_record())
json.dump(s, open(sys.argv[1], "w"), indent=1)
PY
