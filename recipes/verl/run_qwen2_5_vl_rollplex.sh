#!/usr/bin/env bash
# verl's PPO driver with the Rollplex recipe; extra arguments are Hydra overrides of verl's config.
#   bash recipes/verl/run_qwen2_5_vl_rollplex.sh data.train_files=train.parquet data.val_files=val.parquet \
#     actor_rollout_ref.model.path=Qwen/Qwen2.5-VL-3B-Instruct trainer.n_gpus_per_node=8
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# The settings verl has no default for, checked before Ray starts (without them the driver waits on Ray's workers)
for key in data.train_files data.val_files actor_rollout_ref.model.path; do
  case " $* " in
    *" $key="* | *" +$key="* | *" ++$key="*) ;;
    *) echo "run_qwen2_5_vl_rollplex.sh: set $key=... (see the usage at the top of this script)" >&2; exit 2 ;;
  esac
done
python3 -c "import verl" 2>/dev/null || {
  echo "run_qwen2_5_vl_rollplex.sh: verl is not installed in this python3 (docs/guides/verl.md: which release, how)" >&2; exit 2; }
export VERL_ENGINE_VENDOR=rollplex  # the driver's own processes; the recipe sets it for Ray's workers
exec python3 -m verl.trainer.main_ppo --config-path="$here" --config-name=qwen2_5_vl_rollplex "$@"
