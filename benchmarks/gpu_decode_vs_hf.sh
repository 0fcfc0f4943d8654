#!/usr/bin/env bash
# GPU machine: embedded-engine decode throughput against transformers' generate (3B shapes, bf16,
# random weights, one H200). Batches 64 and 128 (8 and 16 groups of G=8), 128 new tokens each,
# a 2x16x16-patch video (128 tokens) plus 896 text tokens per prompt. Writes
# $OUT/decode_vs_hf_3b.json (see benchmarks/decode_vs_hf.py for what each run means).
set -euo pipefail
out=${OUT:-benchmarks/results}
mkdir -p "$out" /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD CUDA_DEVICE_MAX_CONNECTIONS=1  # set ROLLPLEX_COMMIT=<sha> when .git does not travel
python3 -m torch.distributed.run --nproc_per_node 1 benchmarks/decode_vs_hf.py --preset qwen2_5_vl_3b \
  --batches 64,128 --new-tokens 128 --grid 2,16,16 --text-tokens 896 --out "$out/decode_vs_hf_3b.json"
