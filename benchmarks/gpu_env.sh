# Sourced by the benchmarks/gpu_*.sh scripts on the GPU machine (run from the repo root with .whl/):
# installs the carried wheels (megatron-core, hydra) into /tmp/site, puts them and the repo on the
# path, and sets `out` ($OUT, or benchmarks/results).
out=${OUT:-benchmarks/results}
mkdir -p "$out" /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>/dev/null
# CUDA_DEVICE_MAX_CONNECTIONS is left as the caller sets it (the driver's default: several hardware queues),
# as a user's run has it. This file exported 1 until 2026-12-05, so every bench JSON before then ran with all
# streams on one hardware queue, where work issued on one stream can wait for earlier work on another (a
# residency copy, a decode-window item). Megatron asks for 1 only to order tensor-parallel communication ahead
# of the GEMMs it overlaps. `bench` records it per mode; `MODE[env:CUDA_DEVICE_MAX_CONNECTIONS=1]` runs one under 1.
export PYTHONPATH=/tmp/site:$PWD
# gpu_tests TESTFILE NAME: a GPU test file's verdicts, also kept as $out/NAME (a failure is read there, not fatal),
# and beside it $out/NAME less .txt, plus .json: the command, each test's verdict and the environment (device, versions, commit, date)
# ($1 may hold several test paths, split by the shell)
gpu_tests() {
  python3 -m pytest -q -rA -p no:cacheprovider $1 2>&1 | grep -v -i warn | tee "$out/$2" | tail -25 || true
  python3 benchmarks/pytest_record.py "$out/$2" "$out/${2%.txt}.json" \
    --command "python3 -m pytest -q -rA -p no:cacheprovider $1" || true
}
