#!/usr/bin/env bash
# GPU machine: the flash decode attention path. (1) the GPU tests against the fp32 reference path
# (tests/test_gpu_decode.py), (2) one graph decode step's kernels for both paths, shared 16x8 and
# unshared 128x1 (3B shapes, bf16; PROFILE=0 skips it), (3) with WINDOW=1, the decode-window
# microbenchmark, (4) with HF=1, decode against transformers' generate. TESTS adds test files.
#   ROLLPLEX_COMMIT=<sha> [PROFILE=0] [WINDOW=1] [HF=1] [TESTS=...] bash benchmarks/gpu_decode_attention.sh
# Writes $OUT/gpu_decode_tests.txt [, decode_step_profile_3b.json, decode_window_3b.json,
# decode_vs_hf_3b_flash.json].
set -euo pipefail
source benchmarks/gpu_env.sh
python3 -m pytest -q -rA -p no:cacheprovider tests/test_gpu_decode.py ${TESTS:-} 2>&1 | grep -v -i warn \
  | tee "$out/gpu_decode_tests.txt" | tail -15 || true  # a failure is recorded; the profile still runs
run() { python3 -m torch.distributed.run --nproc_per_node 1 "$@" 2>&1 | grep -v -i warn | grep -v "^  warnings" | tail -30; }
if [ "${PROFILE:-1}" = 1 ]; then
  run benchmarks/decode_step_profile.py --out "$out/decode_step_profile_3b.json"
fi
if [ "${WINDOW:-0}" = 1 ]; then
  run benchmarks/decode_window.py --out "$out/decode_window_3b.json" ${WINDOW_ARGS:-}
fi
if [ "${HF:-0}" = 1 ]; then
  run benchmarks/decode_vs_hf.py --preset qwen2_5_vl_3b --batches 64,128 --new-tokens 128 --grid 2,16,16 \
    --text-tokens 896 --out "$out/decode_vs_hf_3b_flash.json"
fi
