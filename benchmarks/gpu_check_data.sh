#!/usr/bin/env bash
# GPU machine: video patches and frame sampling against transformers' video processor (torchvision
# is there), the processor tests, and the example dataset trained with the prompt prefetch on and off.
# Writes $OUT/gpu_check_data.json and $OUT/gpu_processor_tests.txt.
#   ROLLPLEX_COMMIT=<sha> bash benchmarks/gpu_check_data.sh
set -uo pipefail
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import importlib.util as u; print({m: bool(u.find_spec(m)) for m in ('torchvision', 'pyarrow', 'av', 'PIL')})"
python3 -m pytest -q -rA -p no:cacheprovider tests/test_processor.py 2>&1 | grep -v -i warn \
  | tee "$out/gpu_processor_tests.txt" | tail -8
python3 benchmarks/gpu_check_data.py "$out/gpu_check_data.json"
