#!/usr/bin/env bash
# GPU machine: the split training attention (attention/split.py, mode.attention_backend=split).
# (1) its GPU tests (tests/test_gpu_split_attention.py: the flash path against fp32 math and the masked path,
# outputs and gradients); (2) forward + backward time and memory against the masked SDPA path at the
# video_long micro-batch shapes (benchmarks/split_attention.py). Both before `split` becomes a default.
#   ROLLPLEX_COMMIT=<sha> [TESTS=1] [BENCH=1] bash benchmarks/gpu_split_attention.sh
# Writes $OUT/gpu_split_attention_tests.txt and $OUT/split_attention_h200.json.
set -euo pipefail
source benchmarks/gpu_env.sh
if [ "${TESTS:-1}" = 1 ]; then
  gpu_tests tests/test_gpu_split_attention.py gpu_split_attention_tests.txt
fi
if [ "${BENCH:-1}" = 1 ]; then
  python3 benchmarks/split_attention.py --out "$out/split_attention_h200.json" 2>&1 | grep -v -i warn | tail -20
fi
