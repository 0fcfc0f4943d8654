#!/usr/bin/env bash
# The README's main-job command: set up .venv if needed, then run the embedded default job.
# Until the GRPO trainer lands, the embedded default is the model smoke run (tiny preset, CPU).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup_env.sh"
cd "$root"
exec .venv/bin/python -m rollplex_megatron smoke "$@"
