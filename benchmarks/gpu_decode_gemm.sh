#!/usr/bin/env bash
# GPU machine: rollout.decode_gemm (models/triton_linear.py) against the modules' cuBLAS GEMMs, one call.
# (1) the kernels' tests compiled (tests/test_triton_linear.py: bf16 against F.linear, the gated kernel against the
#     GEMM then silu_mul) and the kernel-shapes benchmark's CPU-twin tests; (2) each decode GEMM shape alone, cuBLAS
#     beside every Triton tiling, and the attention's key splits (benchmarks/decode_kernel_shapes.py); (3) one graph
#     decode step's kernels with and without the Triton GEMMs at batch 8 (8 x 1), 16 (2 x 8) and 32 (4 x 8): the
#     Triton GEMMs run at steps of at most 32 samples, so larger batches run cuBLAS on both paths
#     (benchmarks/decode_step_profile.py, paths triton:triton (the default), :gated and :all (rollout.decode_gemm),
#     :threelaunch (the attention's parts in kernels of their own)); (4) with HF=1, engine decode tokens/s of the
#     default path, :gated and :threelaunch at batch 8 and 32 in one run (benchmarks/decode_vs_hf.py).
#   ROLLPLEX_COMMIT=<sha> [TBPS=3.35] [HF=1] bash benchmarks/gpu_decode_gemm.sh
# Writes $OUT/gpu_triton_linear_tests.txt and .json, decode_kernel_shapes.json, decode_step_profile_gemm.json,
# decode_bandwidth_gemm.json (and decode_vs_hf_gemm.json with HF=1). TBPS: the card's bandwidth (H100 3.35, H200 4.3).
set -euo pipefail
source benchmarks/gpu_env.sh
gpu_tests "tests/test_triton_linear.py tests/test_triton_kernels.py::test_the_kernel_shapes_benchmark_runs_its_gemm_rows" \
  gpu_triton_linear_tests.txt
python3 benchmarks/decode_kernel_shapes.py --tbps "${TBPS:-3.35}" --out "$out/decode_kernel_shapes.json" 2>&1 \
  | grep -v -i warn | tail -80 || true
run() { python3 -m torch.distributed.run --nproc_per_node 1 "$@" 2>&1 | grep -v -i warn | grep -v "^  warnings" | tail -40; }
run benchmarks/decode_step_profile.py --cases shared_8x1,shared_2x8,shared_4x8 \
  --paths triton:triton,triton:triton:gated,triton:triton:all,triton:triton:threelaunch --out "$out/decode_step_profile_gemm.json"
python3 benchmarks/decode_bandwidth.py "$out/decode_step_profile_gemm.json" --tbps "${TBPS:-3.35}" \
  --out "$out/decode_bandwidth_gemm.json" 2>&1 | grep -v -i warn || true
if [ "${HF:-0}" = 1 ]; then
  run benchmarks/decode_vs_hf.py --preset qwen2_5_vl_3b --batches 8,32 --new-tokens 128 --grid 2,16,16 \
    --text-tokens 896 --paths triton:triton,triton:triton:gated,triton:triton:threelaunch --only-paths --kept \
    --out "$out/decode_vs_hf_gemm.json"
fi
