#!/usr/bin/env bash
# GPU machine: after a restructuring, the GPU paths still run: (1) the GPU tests (tests/test_gpu_decode.py),
# (2) two bf16 training steps of the tiny preset per decode-window mechanism (interleave, stream, tail, green:
# side streams, the issuer thread, the green-context partition). Writes $OUT/gpu_decode_tests.txt,
# $OUT/train_<window>.log and prints each run's (step, loss, grad_norm, mechanism, items in the window).
#   ROLLPLEX_COMMIT=<sha> bash benchmarks/gpu_check_renovation.sh
set -uo pipefail
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pytest -q -rA -p no:cacheprovider tests/test_gpu_decode.py 2>&1 | grep -v -i warn \
  | tee "$out/gpu_decode_tests.txt" | tail -12
for w in interleave stream tail green; do
  python3 -m rollplex_megatron train train.steps=2 train.progress=false dtype=bfloat16 mode.window=$w \
    train.save_final=false train.out=/tmp/run_$w > "$out/train_$w.log" 2>&1
  echo "window=$w rc=$?"
  cp /tmp/run_$w/metrics.jsonl "$out/train_$w.metrics.jsonl" 2>/dev/null
  python3 -c "import json; r=[json.loads(l) for l in open('/tmp/run_$w/metrics.jsonl')]; print([(x['step'], \
round(x['loss'], 6), round(x['grad_norm'], 5), x['rollout'].get('window_mechanism'), \
x['rollout'].get('items_in_window')) for x in r])" 2>&1 | tail -1
done
