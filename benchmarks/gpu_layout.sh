#!/usr/bin/env bash
# GPU machine, one H200: what the rollout on a model of its own costs (rollout layout work). Run from the
# repo root with .whl/ carried:
#   ROLLPLEX_COMMIT=<sha> bash benchmarks/gpu_layout.sh decode [linear_fc1]   # split-GEMM decode-step cost
#   ROLLPLEX_COMMIT=<sha> bash benchmarks/gpu_layout.sh MODES [overrides]   # image_short bench, e.g. serial
# `decode`: one CUDA-graph decode step (3B, batch 128, flash) with every decoder linear as one GEMM and as
# two GEMMs over views of its halves (the split-GEMM executor of weights/split.py).
# MODES: bench image_short modes, e.g. `serial` then `serial[rollout.bound_model=true]` (the rollout model bound to the
# training storage at equal TP: every tensor a view) in a second call on the same warm machine (merged).
set -euo pipefail
source benchmarks/gpu_env.sh
if [ "$1" = decode ]; then  # decode [ONLY]: split every decoder linear, or those whose name ends in ONLY
  only=${2:-} json="$out/split_gemm_decode_step_3b${2:+_$2}.json"
  python3 benchmarks/decode_step_profile.py --decode-attention flash --split-halves --split-only "$only" \
    --out "$json" 2>&1 | grep -v -i warn | grep -v '^{"' | tail -5 || true
  python3 - "$json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
for k, r in rows.items():
    print(k, round(r["step_ms"], 3), "ms step,", round(r["kernel_ms_per_step"], 3), "ms kernels,", r["kernels_per_step"], "kernels")
PY
  exit 0
fi
modes=$1
shift
exec bash benchmarks/gpu_bench.sh image_short "$modes" --warmup 1 train.steps=4 "$@"
