#!/usr/bin/env bash
# GPU machine: one `bench` suite (or part of one). Run from the repo root with .whl/ carried:
#   ROLLPLEX_COMMIT=<sha> bash benchmarks/gpu_bench.sh SUITE MODES [overrides]
# MODES as bench takes them, quoted: "serial,prefix_shared,rollplex,rollplex[mode.window=after]" (each mode at
# its defaults, or with Hydra overrides of its own in brackets).
# The JSON is kept in runs/bench/ (ignored, so it stays on a warm machine between calls) and copied
# to $OUT. A later call on the same machine merges its modes into it (bench accepts a merge only from
# the same host, GPU UUIDs and commit), so a suite can be split over calls of the 10-minute limit.
# BENCH_NAME=NAME keeps the JSON as runs/bench/bench_NAME.json instead, for a run of the suite under other
# overrides (a different workload) that must not merge into the suite's own JSON.
set -euo pipefail
source benchmarks/gpu_env.sh
suite=$1 modes=$2
shift 2
# PYTORCH_CUDA_ALLOC_CONF: the command line sets expandable segments where unset (not for rollout.engine=sglang)
mkdir -p runs/bench
name=${BENCH_NAME:-$suite}
json=runs/bench/bench_$name.json
merge=()
[ -f "$json" ] && merge=(--merge "$json")
nvidia-smi --query-gpu=name,uuid,memory.used,memory.total --format=csv > "$out/bench_${name}_nvidia_smi.csv" || true
status=0
python3 -m rollplex_megatron bench "$suite" --modes "$modes" --out "$json" "${merge[@]}" "$@" > /tmp/bench.log 2>&1 || status=$?
grep -v -i warn /tmp/bench.log | tail -40
cp "$json" "${json%.json}.md" runs/bench/*_profile.json "$out/" 2>/dev/null || true
exit $status
