# Sourced by the benchmarks/gpu_*.sh scripts on the GPU machine (run from the repo root with .whl/):
# installs the carried wheels (megatron-core, hydra) into /tmp/site, puts them and the repo on the
# path, and sets `out` ($OUT, or benchmarks/results).
out=${OUT:-benchmarks/results}
mkdir -p "$out" /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD CUDA_DEVICE_MAX_CONNECTIONS=1
