#!/usr/bin/env bash
# GPU machine: the residency copies on a stream per direction (memory.copy_streams=2) and a phase early
# (memory.prefetch_ahead).
# (1) their GPU tests (tests/test_gpu_memory_streams.py: the phase cycle bit-exact on one and on two streams,
# and with the masters brought back at the update's entry);
# (2) the compute stream's wait at rollplex's rollout entry on one and on two streams, and after an unrelated copy,
# with the driver's default hardware queues and with CUDA_DEVICE_MAX_CONNECTIONS=1 (benchmarks/copy_streams.py).
#   ROLLPLEX_COMMIT=<sha> [TESTS=1] [BENCH=1] bash benchmarks/gpu_memory_streams.sh
# Writes $OUT/gpu_memory_streams_tests.txt, $OUT/copy_streams_h200.json and $OUT/copy_streams_h200_conn1.json.
set -euo pipefail
source benchmarks/gpu_env.sh
if [ "${TESTS:-1}" = 1 ]; then
  gpu_tests tests/test_gpu_memory_streams.py gpu_memory_streams_tests.txt
fi
if [ "${BENCH:-1}" = 1 ]; then
  python3 benchmarks/copy_streams.py --out "$out/copy_streams_h200.json" 2>&1 | grep -v -i warn | tail -20
  CUDA_DEVICE_MAX_CONNECTIONS=1 python3 benchmarks/copy_streams.py --out "$out/copy_streams_h200_conn1.json" 2>&1 \
    | grep -v -i warn | tail -20
fi
