#!/usr/bin/env bash
# GPU machine: forward+backward of the Qwen2.5-VL presets in bf16 through megatron's schedule.
# Run from the repo root on the device with .whl/ carried (see ../shared/device/fetch_wheels.sh):
#   ROLLPLEX_COMMIT=<sha> bash benchmarks/gpu_smoke.sh
# Writes one JSON per run under $OUT (default benchmarks/results/) with command, commit, date,
# device and versions (smoke's summary.json), and prints a one-line table per run.
set -euo pipefail
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv > "$out/nvidia_smi.csv" || true
run() {
  local tag=$1; shift
  local args=("$@")
  python3 -m rollplex_megatron smoke "${args[@]}" run_dir=/tmp/runs_$tag > /tmp/$tag.log 2> /tmp/$tag.err || { tail -40 /tmp/$tag.err; return 1; }
  local dir; dir=$(tail -1 /tmp/$tag.log)
  python3 - "$dir/summary.json" "$out/$tag.json" "python -m rollplex_megatron smoke ${args[*]}" <<'PY'
import json, sys
s = json.load(open(sys.argv[1])); s["command"] = sys.argv[3]
json.dump(s, open(sys.argv[2], "w"), indent=2)
PY
  tail -2 /tmp/$tag.log | head -1
}
# 3B: 2 prompts, each a 448x448 image (1024 patches -> 256 tokens) and a 16-frame 224x224 video
# (8x16x16 patches -> 512 tokens) plus 256 text tokens: 1028 LLM tokens per prompt.
run qwen2_5_vl_3b_bf16_fwd_bwd model=qwen2_5_vl_3b dtype=bfloat16 smoke.batch=2 \
  smoke.image_grid=[1,32,32] smoke.video_grid=[8,16,16] smoke.text_tokens=256 smoke.steps=5 smoke.warmup=2
run tiny_bf16_fwd_bwd model=tiny dtype=bfloat16 smoke.steps=5
