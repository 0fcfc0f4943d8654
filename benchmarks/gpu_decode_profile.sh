#!/usr/bin/env bash
# GPU machine: where the decode step and a decode-window item spend their time (3B shapes, bf16).
#   ROLLPLEX_COMMIT=<sha> bash benchmarks/gpu_decode_profile.sh
# Writes $OUT/decode_profile_3b_unshared.json (eager decode step of 128 one-sample requests: kernel
# breakdown) and $OUT/window_item_profile_3b.json (one reference prefix item: host issue vs GPU time).
set -euo pipefail
out=${OUT:-benchmarks/results}
mkdir -p "$out" /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD CUDA_DEVICE_MAX_CONNECTIONS=1
run() { python3 -m torch.distributed.run --nproc_per_node 1 "$@" 2>&1 | grep -v -i warn | grep -v "^  warnings" | tail -8; }
run benchmarks/decode_profile.py --groups 16 --group-size 8 --new-tokens 16 --unshared --out "$out/decode_profile_3b_unshared.json"
run benchmarks/decode_profile.py --groups 16 --group-size 8 --new-tokens 16 --out "$out/decode_profile_3b_shared128.json"
run benchmarks/decode_window.py --profile-item --out "$out/window_item_profile_3b.json"
