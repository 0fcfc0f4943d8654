#!/usr/bin/env bash
# The README's test command: set up .venv if needed, lint the tree (ruff.toml), then run the whole CPU
# test suite.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup_env.sh"
cd "$root"
.venv/bin/python -m ruff check rollplex_megatron tests benchmarks
exec .venv/bin/python -m pytest -q --durations=30 tests "$@"
