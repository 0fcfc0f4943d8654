#!/usr/bin/env bash
# Create or reuse the virtual environment at .venv (repo root) with Python 3.11 and the pinned
# packages of constraints.txt, then install this package in editable mode. Idempotent.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
py=${PYTHON:-python3.11}
if ! command -v "$py" >/dev/null 2>&1; then
  echo "error: $py not found; set PYTHON to a Python 3.11 interpreter" >&2; exit 1
fi
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
stamp=.venv/.rollplex-installed
want=$(cat constraints.txt setup.py | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # torch first and alone: the pinned 2.13.0 is the CPU wheel; nothing else may pull a CUDA build.
  .venv/bin/python -m pip install -q -c constraints.txt torch
  .venv/bin/python -m pip install -q -c constraints.txt megatron-core hydra-core omegaconf \
    transformers safetensors numpy pytest matplotlib tqdm PyYAML ruff pyarrow av pillow tensorboard triton
  # verl (the verl plugin, integrations/verl/, and its tests): verl's declared pins (transformers<5.11,
  # tensordict<=0.10 whose pyvers pins packaging<26) conflict with this project's, and the seams the plugin
  # uses run with these; so what verl imports at module level is installed at constraints.txt's pins, then verl
  # and tensordict 0.10 without their declared dependencies.
  .venv/bin/python -m pip install -q -c constraints.txt ray peft accelerate datasets fastapi uvicorn \
    TransferQueue cachetools torchdata codetiming cloudpickle orjson importlib_metadata
  # the documentation site (docs/, mkdocs.yml), built strictly by scripts/test.sh
  .venv/bin/python -m pip install -q -c constraints.txt mkdocs mkdocs-material
  .venv/bin/python -m pip install -q -c constraints.txt --no-deps verl tensordict==0.10.0 pyvers==0.1.0
  .venv/bin/python -m pip install -q -c constraints.txt --no-deps -e .
  echo "$want" > "$stamp"
fi
