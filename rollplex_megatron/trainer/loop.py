"""The step loop: `run_step` is one line per phase (the mode runs them), `train_rank` the run.

Modes (trainer/modes/): serial | prefix_shared | rollplex | disaggregated, chosen once from `mode.name`.
The embedded engine runs the actor's modules in place (no weight sync after the step); a rollout at its
own TP refreshes its bound tensors (`weight_refresh`), and disaggregated sends the weights to the
rollout ranks (`weight_transfer`), once after the step's optimizer steps.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from rollplex_megatron import user_code
from rollplex_megatron.checkpoint import run_dir, train_state
from rollplex_megatron.config import RunConfig
from rollplex_megatron.data import fingerprint
from rollplex_megatron.dist import init_parallel, layouts, train_world
from rollplex_megatron.checkpoint.files import atomic_write_text
from rollplex_megatron.recipes import to_yaml
from rollplex_megatron.rollout.disaggregated import RemoteRollout, RolloutWorker
from rollplex_megatron.runtime import sync
from rollplex_megatron.trainer.metrics import PhaseTimer, peak_bytes, reduce_metrics
from rollplex_megatron.trainer.modes import Mode, get_mode
from rollplex_megatron.trainer.runtime import Runtime
from rollplex_megatron.trainer.tracking import Tracker
from rollplex_megatron.trainer.validation import evaluate


def run_step(rt: Runtime, mode: Mode, step: int) -> dict:
    """One RL step; returns its metrics record. The mode prepares (rollout and scoring phases), then
    `train.ppo_epochs` passes over its `train.ppo_mini_batches` mini-batches, one update and one
    optimizer step each; the learning-rate schedule advances once per RL step."""
    rt.memory.new_step()
    rt.data_seconds = 0.0
    t = PhaseTimer(rt.memory, profile=rt.cfg.train.profile_step == step + 1, profile_phases=rt.cfg.train.profile_phases)
    t0 = time.perf_counter()
    prep = mode.prepare(rt, step, t)
    rt.last_batch = prep.batch  # kept for inspection (tests compare rollouts across modes)
    res, opts, n = [], [], rt.cfg.train.ppo_epochs * len(prep.minis)
    for k in range(n):
        with t("update"):
            res.append(mode.update(rt, prep, k % len(prep.minis), fresh=k == 0))
        with t("optimizer", then=None if k == n - 1 else "update"):  # another mini-batch's update comes next
            opts.append(rt.optimizer_step(advance=k == n - 1))
    if rt.engine.weights_phase:  # a rollout model of its own: bound views refreshed, or weights sent to its ranks
        with t(rt.engine.weights_phase, residency="optimizer"):  # right after the optimizer step: no transition
            rt.sync_rollout_weights()
    sync()
    peak, src = peak_bytes(t)
    seconds = time.perf_counter() - t0
    return {"step": step + 1, "mode": mode.name, **reduce_metrics(rt, prep, res),
            "grad_norm": sum(o["grad_norm"] for o in opts) / n, "lr": opts[0]["lr"], "optimizer_steps": n,
            "step_time_s": seconds,
            "data_time_s": rt.data_seconds, "data_share": rt.data_seconds / seconds,
            "phase_times": t.times, "phase_parts": t.parts, "phase_peak_bytes": t.peaks, "peak_mem_bytes": peak,
            "peak_mem_source": src,
            "memory_plan": rt.cfg.memory.plan, "memory_released": sorted(rt.memory.released),
            "auto_choices": rt.plan.get("auto_choices", {}),  # the sizes the planner chose (trainer.runtime.auto_sizes)
            "prefix_recompute": rt.recompute, "phase_managed_bytes": dict(rt.memory.phase_bytes),
            "offload_bytes": dict(rt.memory.copy_bytes), "host_allocations": rt.memory.host_allocations,
            "rollout": prep.stats, "rollout_layout": rt.plan.get("rollout_layout"),
            **({"profile": {"top": t.kernel_table(), "by_count": t.kernel_table(key="count"),
                         "by_cpu": t.kernel_table(key="cpu_ms"),
                         "busy": t.totals}} if t.profile else {})}


def _run_dir(cfg: RunConfig) -> Path:
    """Rank 0 names the run directory; every rank gets the same path."""
    name = [cfg.train.out or os.path.join(cfg.run_dir, time.strftime("%Y%m%d-%H%M%S") + f"-train-{cfg.mode.name}")]
    if dist.get_world_size(train_world()) > 1:
        dist.broadcast_object_list(name, src=0, group=train_world())
    path = Path(name[0]).resolve()
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier(group=train_world())
    return path


class Preemption:
    """SIGTERM (SLURM's preemption signal) or SIGINT (Ctrl-C) asks for a stop: the current step finishes, every
    rank agrees on the step to stop after, a checkpoint is written and the ranks return normally. A user
    function (a reward) still running `user_code.STOP_GRACE_S` after the signal is abandoned instead: the rank
    raises `UserCodeStopped` mid-step, and nothing of that step is saved."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.asked = False
        # replaces a launcher's SIG_IGN (dist.run_local's defer_sigterm), or its own handler under torchrun
        self._old = {s: signal.signal(s, self._on_term) for s in self.SIGNALS}

    def _on_term(self, signum, frame) -> None:
        self.asked = True
        user_code.ask_stop()

    def agreed(self, dev) -> bool:
        """Collective: True on every rank when any rank was asked to stop."""
        flag = torch.tensor([int(self.asked)], dtype=torch.int32, device=dev)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=train_world())
        return bool(int(flag))

    def close(self) -> None:
        """Give SIGTERM and SIGINT their previous handlers back."""
        for s, old in self._old.items():
            signal.signal(s, old)
        user_code.clear_stop()


def train_rank(cfg: RunConfig) -> dict:
    """Train on this rank until `train.steps` (or a SIGTERM); rank 0 writes metrics.jsonl and the
    config, every rank its checkpoint shard. The launcher has checked and locked the run directory."""
    preempt = Preemption()
    bar = tracker = rt = None
    init_parallel(cfg.parallel.tp, cfg.parallel.pp, cfg.seed, cfg.parallel.backend, cfg.rollout.tp,
                  cfg.parallel.rollout_ranks)
    if layouts().role == "rollout":  # mode=disaggregated: this rank decodes until the training ranks stop it
        try:
            return {"rollout_rank": RolloutWorker(cfg, layouts()).serve(), "records": [], "run_dir": None}
        finally:
            preempt.close()
    try:
        rt = Runtime(cfg)
        mode = get_mode(cfg.mode.name)()
        run = _run_dir(cfg)
        start, rank0 = 0, dist.get_rank() == 0
        # what the rows were at the start (they are read then): recorded in every checkpoint's meta.json
        data_prints = fingerprint.fingerprint(cfg.data.train_files) if rank0 else {}
        if cfg.train.resume:
            latest = train_state.latest_checkpoint(run)
            if latest is None:
                raise FileNotFoundError(f"train.resume=true but {run} has no checkpoint")
            # start-up released what the plan releases: each group comes back only while its state is loaded
            start, extra = train_state.load_checkpoint(latest, rt.ddp.module, rt.ref, rt.optimizer, rt.memory.holding)
            rt.record_setup_peak()
            restore_scheduler(rt.scheduler, extra, start)
            if rt.engine.weights_phase:  # the rollout model was bound (or sent weights) before the load
                rt.sync_rollout_weights()
            rt.data_cursor = extra.get("data_cursor", start)  # checkpoints before dynamic sampling: one batch a step
        if rank0:
            run_dir.truncate_metrics(run, start)  # steps after the checkpoint are trained again
            atomic_write_text(run / "config.yaml", to_yaml(cfg))  # a kill mid-write leaves the old file whole
            atomic_write_text(run / "memory_plan.json", json.dumps(rt.plan, indent=1))
        metrics_path = run / run_dir.METRICS
        bar = _progress(cfg, start, rank0)
        if rank0 and (cfg.train.tensorboard or cfg.train.wandb):
            tracker = Tracker(run, cfg.train.tensorboard, cfg.train.wandb, dataclasses.asdict(cfg), run.name, start)
        records, stopped = [], None
        if cfg.train.val_every and cfg.val.before_train and start == 0:
            rt.memory.enter("rollout")  # validation decodes under the rollout's residency
            _log(metrics_path, evaluate(rt, 0), bar, rank0, tracker)
        for step in range(start, cfg.train.steps):
            rec = run_step(rt, mode, step)
            profile = rec.pop("profile", None)  # the profiled step's kernel table goes beside metrics.jsonl
            if profile is not None and rank0:
                (run / f"profile_step{step + 1}.json").write_text(json.dumps(
                    {"step": step + 1, "mode": mode.name, "phase_times": rec["phase_times"],
                     "top_ops_per_phase": profile["top"],
                     "most_run_ops_per_phase": profile["by_count"],  # a host-bound phase shows here
                     "host_heavy_ops_per_phase": profile["by_cpu"],
                     "busy_per_phase": profile["busy"]}, indent=1))  # summed self times: GPU or host bound
            records.append(rec)
            _log(metrics_path, rec, bar, rank0, tracker)
            last = step + 1 == cfg.train.steps
            if cfg.train.val_every and ((step + 1) % cfg.train.val_every == 0 or last):
                rt.memory.enter("rollout")
                _log(metrics_path, evaluate(rt, step + 1), bar, rank0, tracker)
            stop = preempt.agreed(rt.dev)
            every = cfg.train.save_every and (step + 1) % cfg.train.save_every == 0
            if (last and cfg.train.save_final) or stop or every:
                # released classes are written from their host copies (no device memory past the last phase's)
                train_state.save_checkpoint(run, step + 1, rt.ddp.module, rt.ref, rt.optimizer,
                                            {"lr_scheduler": rt.scheduler.state_dict(), "data_cursor": rt.data_cursor},
                                            to_yaml(cfg), data_prints, host=rt.memory.host_reader())
            if stop:  # every rank agreed: the launcher starts nothing after this run either
                stopped = step + 1
                break
    finally:
        preempt.close()
        if rt is not None and isinstance(rt.engine, RemoteRollout):
            rt.engine.close()  # the rollout ranks leave their loop
        if bar is not None:
            bar.close()
        if tracker is not None:
            tracker.close()
    return {"run_dir": str(run), "records": records, "preempted_at": stopped}


def restore_scheduler(scheduler, extra: dict, step: int) -> None:
    """The checkpoint's learning-rate schedule state (checkpoints written before it existed held a
    constant rate: the schedule is then advanced to `step`); it must stand at the checkpoint's step."""
    if "lr_scheduler" in extra:
        scheduler.load_state_dict(extra["lr_scheduler"])
    else:
        scheduler.step(increment=step)
    if scheduler.num_steps != step:
        raise ValueError(f"the checkpoint's learning-rate schedule is at step {scheduler.num_steps}, its weights at "
                         f"{step}; the checkpoint is inconsistent")


def _log(path: Path, rec: dict, bar, rank0: bool, tracker=None) -> None:
    """Rank 0 appends one record (a step's, or a validation run's) to metrics.jsonl, the trackers, and
    shows it."""
    if not rank0:
        return
    with path.open("a") as f:
        f.write(json.dumps(rec) + "\n")
    if tracker is not None:
        tracker.log(rec)
    _show(bar, rec)


def _progress(cfg: RunConfig, start: int, rank0: bool):
    """Rank 0's progress bar on a terminal; None (plain step lines) elsewhere: without a terminal (a log file,
    a pipe, SLURM's output) the bar's carriage-return frames would fill the log."""
    if not (rank0 and cfg.train.progress and sys.stdout.isatty() and sys.stderr.isatty()):  # tqdm draws on stderr
        return None
    return tqdm(total=cfg.train.steps, initial=start, desc=f"train[{cfg.mode.name}]", unit="step", dynamic_ncols=True)


def _show(bar, rec: dict) -> None:
    if rec.get("kind") == "val":
        per = " ".join(f"{k[4:]}={v:.3f}" for k, v in rec.items() if k.startswith("val/") and k.endswith("reward_mean"))
        return (print if bar is None else bar.write)(f"val after step {rec['step']}: {per}")
    phases = " ".join(f"{k}={v:.2f}s" for k, v in rec["phase_times"].items())
    kl = f"kl {rec['kl']:.2e} (k1 {rec['kl_k1']:+.2e}) " if "kl" in rec else ""  # absent without the reference
    line = (f"step {rec['step']:4d} reward {rec['reward_mean']:.3f} acc {rec['accuracy']:.3f} {kl}"
            f"loss {rec['loss']:+.3e} "
            f"entropy {rec['entropy']:.2f} | {rec['step_time_s']:.2f}s: {phases}")
    if bar is None:
        print(line, flush=True)
    else:
        bar.update(1)
        bar.set_postfix(reward=f"{rec['reward_mean']:.3f}")
        bar.write(line)
