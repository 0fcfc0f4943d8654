#!/usr/bin/env bash
# Launch a rollplex command under torchrun: scripts/torchrun.sh NPROC_PER_NODE COMMAND [args...]
# e.g. scripts/torchrun.sh 4 smoke parallel=tp2_pp2   (gloo on CPU, NCCL on GPU)
#
# One host by default (--standalone). Several hosts: run the same line on every host with
#   NNODES=N NODE_RANK=i RDZV_ENDPOINT=host0:port   (host0: the first node, reachable from every node)
# or inside a SLURM allocation (srun, one task per node): SLURM_NNODES, SLURM_NODEID and the first
# host of SLURM_JOB_NODELIST are read when NNODES is unset (port: RDZV_PORT, default 29500).
# The rendezvous is torchrun's static one (--nnodes/--node-rank/--master-addr/--master-port), so
# global ranks are node-major (rank = node_rank * NPROC_PER_NODE + local rank) and megatron's
# tensor-parallel groups, built from consecutive ranks, stay inside a node when NPROC_PER_NODE is a
# multiple of parallel.tp (checked at start-up).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
n=${1:?usage: torchrun.sh NPROC_PER_NODE COMMAND [args...]}; shift
if ! [[ "$n" =~ ^[1-9][0-9]*$ ]]; then
  echo "torchrun.sh: NPROC_PER_NODE=$n is not a process count (a positive integer)" >&2; exit 2
fi
py=${PYTHON_BIN:-$root/.venv/bin/python}
[ -x "$py" ] || py=python3
if [ -z "${NNODES:-}" ] && [ -n "${SLURM_NNODES:-}" ] && [ "${SLURM_NNODES}" -gt 1 ]; then
  NNODES=$SLURM_NNODES
  NODE_RANK=$SLURM_NODEID
  RDZV_ENDPOINT=${RDZV_ENDPOINT:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1):${RDZV_PORT:-29500}}
fi
if [ -n "${NNODES:-}" ] && ! [[ "$NNODES" =~ ^[1-9][0-9]*$ ]]; then
  echo "torchrun.sh: NNODES=$NNODES is not a node count (a positive integer)" >&2; exit 2
fi
if [ -z "${NNODES:-}" ] || [ "$NNODES" -eq 1 ]; then
  exec "$py" -m torch.distributed.run --standalone --nproc_per_node "$n" -m rollplex_megatron "$@"
fi
: "${NODE_RANK:?NNODES=$NNODES needs NODE_RANK (0..NNODES-1) on every node}"
if ! [[ "$NODE_RANK" =~ ^[0-9]+$ ]] || [ "$NODE_RANK" -ge "$NNODES" ]; then
  echo "torchrun.sh: NODE_RANK=$NODE_RANK is not in 0..$((NNODES - 1)) (NNODES=$NNODES)" >&2; exit 2
fi
: "${RDZV_ENDPOINT:?NNODES=$NNODES needs RDZV_ENDPOINT=host:port of node 0}"
[[ "$RDZV_ENDPOINT" == *:* ]] || RDZV_ENDPOINT="$RDZV_ENDPOINT:${RDZV_PORT:-29500}"
exec "$py" -m torch.distributed.run --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc_per_node "$n" \
  --master-addr "${RDZV_ENDPOINT%:*}" --master-port "${RDZV_ENDPOINT##*:}" -m rollplex_megatron "$@"
