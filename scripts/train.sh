#!/usr/bin/env bash
# GRPO training under torchrun with NPROC processes (gloo on CPU, NCCL on GPU):
#   scripts/train.sh NPROC [hydra overrides]
# e.g. scripts/train.sh 2 parallel.dp=2 mode=serial      scripts/train.sh 2 parallel.tp=2 mode=rollplex
# NPROC must equal parallel.tp * parallel.pp * parallel.dp.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
n=${1:?usage: train.sh NPROC [hydra overrides]}; shift
exec bash "$root/scripts/torchrun.sh" "$n" train "$@"
