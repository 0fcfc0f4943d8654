#!/usr/bin/env bash
# GPU machine: the decode step's Triton kernels (attention/triton_decode.py, rollout/triton_sampling.py).
# (1) their tests, compiled (tests/test_triton_kernels.py) and the engine's GPU decode tests
# (tests/test_gpu_decode.py); (2) one graph decode step's kernels per path pair and case
# (benchmarks/decode_step_profile.py) and each kernel class's bandwidth in it (benchmarks/decode_bandwidth.py,
# TBPS= the device's bandwidth, default the H100 SXM's 3.35); (3) with HF=1, engine decode tokens/s of the
# default path against the module layers (nolayer) and the response kernel running empty key blocks masked (noskip) in the same run
# (HF_PATHS= others), and the default path with the decode state kept between rollouts
# (benchmarks/decode_vs_hf.py --only-paths --kept).
# PRESET= the model preset of (2) (default qwen2_5_vl_3b; its files are named by it unless it is the default).
#   ROLLPLEX_COMMIT=<sha> [TESTS=1] [PROFILE=1] [HF=1] [PRESET=qwen3_vl_4b] bash benchmarks/gpu_decode_kernels.sh
# Writes $OUT/gpu_decode_kernel_tests.txt, decode_step_profile_kernels_3b.json, decode_bandwidth_3b.json,
# decode_vs_hf_kernels_3b.json.
set -euo pipefail
source benchmarks/gpu_env.sh
if [ "${TESTS:-1}" = 1 ]; then
  python3 -m pytest -q -rA -p no:cacheprovider tests/test_triton_kernels.py tests/test_gpu_decode.py 2>&1 \
    | grep -v -i warn | tee "$out/gpu_decode_kernel_tests.txt" | tail -25 || true
fi
run() { python3 -m torch.distributed.run --nproc_per_node 1 "$@" 2>&1 | grep -v -i warn | grep -v "^  warnings" | tail -40; }
if [ "${PROFILE:-1}" = 1 ]; then
  preset=${PRESET:-qwen2_5_vl_3b}
  tag=3b
  [ "$preset" = qwen2_5_vl_3b ] || tag=$preset
  run benchmarks/decode_step_profile.py --preset "$preset" --paths "${PATHS:-flash:torch,triton:torch,triton:triton}" \
    --out "$out/decode_step_profile_kernels_$tag.json"
  python3 benchmarks/decode_bandwidth.py "$out/decode_step_profile_kernels_$tag.json" --tbps "${TBPS:-3.35}" \
    --preset "$preset" --out "$out/decode_bandwidth_$tag.json" 2>&1 | grep -v -i warn || true
fi
if [ "${HF:-0}" = 1 ]; then
  run benchmarks/decode_vs_hf.py --preset qwen2_5_vl_3b --batches 8,64,128 --new-tokens 128 --grid 2,16,16 \
    --text-tokens 896 --paths "${HF_PATHS:-triton:triton,triton:triton:nolayer,triton:triton:noskip}" --only-paths \
    --kept --out "$out/decode_vs_hf_kernels_3b.json"
fi
