#!/usr/bin/env bash
# The README's test command: set up .venv if needed, then run the whole CPU test suite.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup_env.sh"
cd "$root"
exec .venv/bin/python -m pytest -q tests "$@"
