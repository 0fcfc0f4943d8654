"""`train`: launch the GRPO trainer (local processes or torchrun), then write the report.

With `--modes`, each mode trains from the same seed into `<run dir>/<mode>/`, and one report
compares them (reward curves, per-phase time per step).
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

from rollplex_megatron.config import MODES, RunConfig


def _launch(cfg: RunConfig) -> dict:
    import torch.distributed as dist

    from rollplex_megatron.dist import run_local, under_torchrun
    from rollplex_megatron.trainer import train_rank

    if under_torchrun():
        out = train_rank(cfg)
        return out if dist.get_rank() == 0 else {}
    return run_local(train_rank, cfg.parallel.world_size, cfg)[0]


def main(overrides: list[str], modes: list[str] | None = None) -> int:
    """Train one mode (or several in turn), write report.png and summary.json, print the run dir last."""
    import torch.distributed as dist

    from rollplex_megatron.envs.motion import MotionEnv
    from rollplex_megatron.recipes import load_run_config
    from rollplex_megatron.report import plot_runs, summarize

    cfg = load_run_config(overrides)  # every config error surfaces here, before processes start
    cfg.check_training()
    if cfg.train.init_hf:
        from rollplex_megatron.checkpoint.hf import HFCheckpoint
        from rollplex_megatron.config import check_model_parallel

        cfg.model = HFCheckpoint(cfg.train.init_hf).model_config()
        check_model_parallel(cfg.model, cfg.parallel)
    bad = [m for m in modes or [] if m not in MODES]
    if bad:
        raise SystemExit(f"--modes: unknown mode(s) {bad}; choose from {', '.join(MODES)}")
    MotionEnv(cfg.task, cfg.model)  # task/model mismatch fails before any process starts
    root = Path(cfg.train.out or os.path.join(cfg.run_dir, time.strftime("%Y%m%d-%H%M%S") + "-train")).resolve()
    runs = {}
    for name in modes or [cfg.mode.name]:
        out = root / name if modes else root
        mcfg = dataclasses.replace(cfg, mode=dataclasses.replace(cfg.mode, name=name),
                                   train=dataclasses.replace(cfg.train, out=str(out)))
        res = _launch(mcfg)
        if not (dist.is_initialized() and dist.get_rank() != 0):
            runs[name] = res["records"]
    if dist.is_initialized() and dist.get_rank() != 0:
        return 0  # rank 0 writes the report
    # Reward of a policy that always names a direction, uniformly at random: correct 1/4 of the time.
    chance = MotionEnv.chance + cfg.task.format_reward
    summary = {name: summarize(recs) for name, recs in runs.items()}
    for name, recs in runs.items():
        k = max(1, len(recs) // 5)
        summary[name]["accuracy_first20"] = sum(r["accuracy"] for r in recs[:k]) / k
        summary[name]["accuracy_last20"] = sum(r["accuracy"] for r in recs[-k:]) / k
    png = plot_runs(runs, str(root / "report.png"), chance=chance)
    (root / "summary.json").write_text(json.dumps({"chance_reward": chance, "chance_accuracy": MotionEnv.chance,
                                                   "modes": summary}, indent=1))
    for name, s in summary.items():
        print(f"{name}: reward {s['reward_first20']:.3f} -> {s['reward_last20']:.3f} (first -> last 20% of steps; "
              f"random-direction policy {chance:.2f}), accuracy {s['accuracy_first20']:.3f} -> "
              f"{s['accuracy_last20']:.3f} (chance {MotionEnv.chance:.2f}); {s['step_time_s']:.2f} s/step")
    print(f"report: {png}")
    print(root)
    return 0
