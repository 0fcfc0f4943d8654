#!/usr/bin/env bash
# GPU machine: CUDA-graph decode against transformers' generate, and the decode-window
# microbenchmark (3B shapes, bf16, random weights, one H200). Run from the repo root with .whl/:
#   ROLLPLEX_COMMIT=<sha> bash benchmarks/gpu_decode.sh
# Writes $OUT/decode_vs_hf_3b_graphs.json and $OUT/decode_window_3b.json.
set -euo pipefail
source benchmarks/gpu_env.sh
run() { python3 -m torch.distributed.run --nproc_per_node 1 "$@" 2>&1 | grep -v -i warn | grep -v "^  warnings" | tail -40; }
if [ "${SKIP_HF:-0}" != 1 ]; then
  run benchmarks/decode_vs_hf.py --preset qwen2_5_vl_3b --batches 64,128 --new-tokens 128 --grid 2,16,16 \
    --text-tokens 896 --out "$out/decode_vs_hf_3b_graphs.json"
fi
run benchmarks/decode_window.py --out "$out/decode_window_3b.json" ${WINDOW_ARGS:-}
