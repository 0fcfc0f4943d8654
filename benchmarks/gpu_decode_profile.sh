#!/usr/bin/env bash
# GPU machine: one decode-window item (the reference prefix stage of one group, 3B shapes, bf16)
# under torch.profiler: the host's time to issue it against its GPU kernel time.
#   ROLLPLEX_COMMIT=<sha> bash benchmarks/gpu_decode_profile.sh
# Writes $OUT/window_item_profile_3b.json.
set -euo pipefail
source benchmarks/gpu_env.sh
python3 -m torch.distributed.run --nproc_per_node 1 benchmarks/decode_window.py --profile-item \
  --out "$out/window_item_profile_3b.json" 2>&1 | grep -v -i warn | tail -3
