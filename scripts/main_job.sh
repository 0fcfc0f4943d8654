#!/usr/bin/env bash
# The README's main-job command: set up .venv if needed, then run the embedded default job:
# GRPO training of the tiny preset on CPU (rollplex mode, the reach task). Extra arguments
# are Hydra overrides or --modes serial,prefix_shared,rollplex. Last line = the run directory.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup_env.sh"
cd "$root"
exec .venv/bin/python -m rollplex_megatron train "$@"
