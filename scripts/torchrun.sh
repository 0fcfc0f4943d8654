#!/usr/bin/env bash
# Launch a rollplex command under torchrun on this host: scripts/torchrun.sh NPROC COMMAND [args...]
# e.g. scripts/torchrun.sh 4 smoke parallel=tp2_pp2   (gloo on CPU, NCCL on GPU)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
n=${1:?usage: torchrun.sh NPROC COMMAND [args...]}; shift
py=${PYTHON_BIN:-$root/.venv/bin/python}
[ -x "$py" ] || py=python3
exec "$py" -m torch.distributed.run --standalone --nproc_per_node "$n" -m rollplex_megatron "$@"
