#!/usr/bin/env bash
# GPU machine: the loss's fused log-prob / entropy kernel (rl/triton_logprob.py, train.logprob_kernel=triton).
# (1) its tests, compiled (tests/test_triton_logprob.py: values and gradients against float64 and the torch
# path, TP 1 and 2 over gloo, two trainer steps, mutations); (2) forward + backward time and peak memory
# against the torch path at the full vocabulary (benchmarks/logprob_kernel.py). Both before `auto` picks it.
#   ROLLPLEX_COMMIT=<sha> [TESTS=1] [BENCH=1] bash benchmarks/gpu_logprob_kernel.sh
# Writes $OUT/gpu_logprob_kernel_tests.txt and $OUT/logprob_kernel_h200.json.
set -euo pipefail
source benchmarks/gpu_env.sh
if [ "${TESTS:-1}" = 1 ]; then
  gpu_tests tests/test_triton_logprob.py gpu_logprob_kernel_tests.txt
fi
if [ "${BENCH:-1}" = 1 ]; then
  python3 benchmarks/logprob_kernel.py --rows ${ROWS:-4096 8192 16384} --out "$out/logprob_kernel_h200.json" 2>&1 \
    | grep -v -i warn | tail -20
fi
