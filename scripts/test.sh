#!/usr/bin/env bash
# The README's test command: set up .venv if needed, lint the tree (ruff.toml), build the docs site strictly
# (a broken link or a page missing from mkdocs.yml's nav fails), then run the whole CPU test suite.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup_env.sh"
cd "$root"
.venv/bin/python -m ruff check rollplex_megatron tests benchmarks
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
NO_MKDOCS_2_WARNING=1 .venv/bin/python -m mkdocs build --strict --quiet --site-dir "$site"
rm -rf "$site"
exec .venv/bin/python -m pytest -q --durations=30 tests "$@"
