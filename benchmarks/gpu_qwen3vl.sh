#!/usr/bin/env bash
# GPU machine: Qwen3-VL at a released shape (issue of the model seam, its GPU items), in one lease:
# (1) HF parity in fp32 and bf16 with random weights (benchmarks/hf_parity_bf16.py; PRESET, default qwen3_vl_4b);
# (2) the graph decode step's kernels on its shapes, the default path against the module layers (nolayer)
#     (benchmarks/gpu_decode_kernels.sh with PRESET);
# (3) with BENCH=1, one bench suite (SUITE, default image_short) at the defaults, three modes, the preset as the model
#     (benchmarks/gpu_bench.sh; BENCH_MODES to split the modes over calls of the 10-minute limit, merged on a warm
#     machine).
#   ROLLPLEX_COMMIT=<sha> [PRESET=qwen3_vl_4b] [PARITY=1] [PROFILE=1] [BENCH=0] bash benchmarks/gpu_qwen3vl.sh
# Writes $OUT/hf_parity_bf16_$PRESET.json, decode_step_profile_kernels_$PRESET.json, decode_bandwidth_$PRESET.json,
# bench_${SUITE}_$PRESET.json.
set -euo pipefail
source benchmarks/gpu_env.sh
preset=${PRESET:-qwen3_vl_4b}
if [ "${PARITY:-1}" = 1 ]; then
  python3 -m torch.distributed.run --nproc_per_node 1 benchmarks/hf_parity_bf16.py --preset "$preset" \
    --out "$out/hf_parity_bf16_$preset.json" 2>&1 | grep -v -i warn | tail -4 || true
fi
if [ "${PROFILE:-1}" = 1 ]; then
  TESTS=0 PROFILE=1 HF=0 PRESET="$preset" PATHS="${PATHS:-triton:triton,triton:triton:nolayer}" \
    bash benchmarks/gpu_decode_kernels.sh || true
fi
if [ "${BENCH:-0}" = 1 ]; then
  suite=${SUITE:-image_short}
  BENCH_NAME="${suite}_$preset" bash benchmarks/gpu_bench.sh "$suite" "${BENCH_MODES:-serial,prefix_shared,rollplex}" \
    "model=$preset" train.steps=4 --warmup 1
fi
