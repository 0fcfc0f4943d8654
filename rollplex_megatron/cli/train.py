"""`train`: check and lock the run directory, launch the GRPO trainer (local processes or
torchrun), then write the report over the whole run.

With `--modes`, each mode trains from the same seed into `<run dir>/<mode>/`, and one report
compares them (reward curves, per-phase time per step). Every check of the run directory
(`checkpoint/run_dir.py`) runs before a process starts; SIGTERM stops after the current step
with a checkpoint (exit 0), so `train.resume=true` continues. Ctrl-C (SIGINT) does the same (exit 130),
and a second Ctrl-C kills the workers at once. A user function (a reward) still running seconds after
the signal is abandoned, and with it the step, which is not saved (exit 143 for SIGTERM, 130 for
SIGINT): one line names the last checkpoint and the command that continues from it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import torch

from rollplex_megatron.checkpoint import run_dir as R
from rollplex_megatron.checkpoint import train_state
from rollplex_megatron.config import RunConfig
from rollplex_megatron.data import build_source, source_name
from rollplex_megatron.runtime import drop_allocator_default
from rollplex_megatron.dist import LocalRunError, check_launch, exit_with_parent, launch_on_ranks, under_torchrun
from rollplex_megatron.memory.machine import check_run_fits
from rollplex_megatron.checkpoint.files import atomic_write_text
from rollplex_megatron.recipes import load_run_config, resumed_config, to_yaml
from rollplex_megatron.report import plot_runs, read_metrics, summarize
from rollplex_megatron.rollout.sglang.engine import import_sglang
from rollplex_megatron.trainer.loop import train_rank
from rollplex_megatron.rollout.embedded import check_decode_settings
from rollplex_megatron.trainer.runtime import cap_allocator, memory_plan
from rollplex_megatron.trainer.modes import MODES
from rollplex_megatron.trainer.tracking import check_tracking


class _Launcher:
    """The launcher's side of a run: worker pids in the lock, SIGTERM forwarded to the workers. The first
    Ctrl-C (SIGINT) is taken as a SIGTERM (no KeyboardInterrupt: the workers stop at the step's end and
    write their checkpoint); a Ctrl-C after a stop signal kills the workers at once."""

    def __init__(self, locks: list[R.RunLock]):
        self.locks, self.pids, self.preempted, self.killed = locks, [], False, False
        self.signal = ""  # the first stop signal's name
        self._old = {s: signal.signal(s, self._on_term) for s in (signal.SIGTERM, signal.SIGINT)}

    def _on_term(self, signum, frame) -> None:
        first, self.preempted = not self.preempted, True
        if first:
            self.signal = signal.Signals(signum).name
            threading.Thread(target=self._resend, name="sigterm-resend", daemon=True).start()
        if signum == signal.SIGINT and not first:
            self._kill()
            return
        if signum == signal.SIGINT:  # os.write: print() is not safe inside a signal handler
            os.write(2, b"Ctrl-C: stopping after this step with a checkpoint; Ctrl-C again stops now, unsaved\n")
        self._forward()

    def _kill(self) -> None:
        """Kill the workers (a second Ctrl-C): the step they run is lost, the checkpoints on disk stay whole."""
        self.killed = True
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _resend(self) -> None:
        """Workers ignore SIGTERM until their trainer installs its handler (dist.run_local's
        defer_sigterm): re-send it until this launch is over, so a signal sent while they import counts."""
        while self.preempted and self.pids:
            time.sleep(0.5)
            self._forward()

    def _forward(self) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def started(self, pids: list[int]) -> None:
        """run_local's on_start: record the workers."""
        self.pids = pids
        for lock in self.locks:
            lock.add_workers(pids)
        if self.preempted:  # SIGTERM came while the workers were starting
            self._forward()

    def close(self) -> None:
        """Give SIGTERM and SIGINT their previous handlers back."""
        for s, old in self._old.items():
            signal.signal(s, old)

    def exit_code(self, saved: bool) -> int:
        """0 for a run that ended at a checkpoint without Ctrl-C, else 128 + the signal (the shell's convention)."""
        if self.signal == "SIGINT" or (self.preempted and not saved):
            return 128 + signal.Signals[self.signal].value
        return 0


def _launch(cfg: RunConfig, launcher: _Launcher) -> dict:
    """This rank's result under torchrun, rank 0's otherwise (`preempted_at` is agreed by all ranks)."""
    return launch_on_ranks(train_rank, cfg.parallel.world_size, cfg, on_start=launcher.started,
                           defer_sigterm=True)[0]


def _plan(cfg: RunConfig, root: Path, modes: list[str] | None, launcher: bool = True) -> list[RunConfig]:
    """One config per mode to train, each checked against its run directory (nothing written; `launcher`: this
    process locks the directories, see `check_start`)."""
    plans = []
    for name in modes or [cfg.mode.name]:
        out = root / name if modes else root
        mcfg = dataclasses.replace(cfg, mode=dataclasses.replace(cfg.mode, name=name),
                                   train=dataclasses.replace(cfg.train, out=str(out)))
        if modes and cfg.train.resume:  # a comparison run resumes mode by mode
            latest = R.published_checkpoint(out)
            if latest is not None and train_state.read_meta(latest)["step"] == cfg.train.steps:
                continue  # this mode finished before the interruption
            if latest is None and not any((out / f).exists() for f in R.RUN_FILES):
                mcfg = dataclasses.replace(mcfg, train=dataclasses.replace(mcfg.train, resume=False))
        R.check_start(out, mcfg.train.resume, mcfg.train.steps, to_yaml(mcfg), launcher)
        plans.append(mcfg)
    return plans


def _saved_config(root: Path, modes: list[str] | None) -> str | None:
    """The config the run at `root` was trained with (its latest checkpoint's; with --modes the first mode's that
    has one), or None without a checkpoint."""
    for out in [root / m for m in modes] if modes else [root]:
        latest = R.published_checkpoint(out)
        if latest is not None:
            return train_state.read_meta(latest)["config"]
    return None


def _check_kind(root: Path, modes: list[str] | None) -> None:
    """A run of one mode keeps its files at the top of train.out, a --modes comparison one folder per mode: a
    command of the other kind would mix its files in and replace the summary and report of the run there."""
    R.check_place(root)
    root = root.resolve()
    inside = next((p for p in root.parents if (p / "config.yaml").is_file() and (p / train_state.CHECKPOINTS).is_dir()
                   and not R.forbidden_place(p)), None)  # a run there is refused now: one made before is no run
    if inside is not None:  # its files would mix with that run's (an export or a resume there reads them)
        raise ValueError(f"train.out={root} lies inside the run {inside}; choose a folder outside it")
    if (root / "config.json").is_file() and any(root.glob("*.safetensors")):
        raise ValueError(f"train.out={root} is a Hugging Face model folder; choose a new folder for the run (give "
                         f"the model as train.init_hf={root})")
    top = next((f for f in R.RUN_FILES if (root / f).exists()), None)
    if modes and top:
        raise ValueError(f"train.out={root} holds a run of one mode ({top} at its top); --modes trains each mode "
                         f"into train.out/<mode>: choose a new train.out, or resume that run without --modes")
    inner = next((m for m in MODES if any((root / m / f).exists() for f in R.RUN_FILES)), None)
    if not modes and inner:
        raise ValueError(f"train.out={root} holds a --modes comparison ({inner}/); a run of one mode writes its "
                         f"files at the top of train.out: choose a new train.out, or resume it with --modes")
    R.check_foreign(root, MODES)


def _config(overrides: list[str], modes: list[str] | None) -> RunConfig:
    """The run's config with every check that needs no process (bad input fails here)."""
    cfg = load_run_config(overrides)  # train.init_hf: the model is the checkpoint's (recipes.model_from_hf)
    if cfg.train.out:  # before anything reads the folder
        _check_kind(Path(cfg.train.out), modes)
    saved = _saved_config(Path(cfg.train.out), modes) if cfg.train.resume and cfg.train.out else None
    if saved is not None:  # a resume continues the saved run: what this command line sets goes on top
        cfg = resumed_config(cfg, overrides, saved)
    cfg.check_training()
    bad = [m for m in modes or [] if m not in MODES]
    if bad:
        raise ValueError(f"--modes: unknown mode(s) {bad}; choose from {', '.join(MODES)}")
    if not cfg.train.out and Path(cfg.run_dir).exists() and not Path(cfg.run_dir).is_dir():
        raise ValueError(f"run_dir={cfg.run_dir} is a file; run_dir is the folder new runs are made in: choose a "
                         f"folder (or set train.out)")
    twice = sorted({m for m in modes or [] if modes.count(m) > 1})
    if twice:
        raise ValueError(f"--modes: {', '.join(twice)} given twice; each mode trains once, into train.out/<mode>")
    if modes and "disaggregated" in modes:
        raise ValueError("--modes: disaggregated runs on parallel.rollout_ranks more processes than the other modes; "
                         "train it in a launch of its own (mode=disaggregated parallel.rollout_ranks=N)")
    check_launch(cfg.parallel)
    check_tracking(cfg.train.wandb)
    if cfg.train.init_hf and cfg.data.source == "auto" and not cfg.data.train_files:  # said, not assumed
        print(f"note: no data.train_files: the run trains the built-in rendered task (task.question="
              f"{cfg.task.question}) on train.init_hf's model; give data.train_files=[...] for your data, or "
              f"data.source=rendered to say this is meant", file=sys.stderr)
    if cfg.rollout.engine == "sglang":
        import_sglang()  # missing or too old: one line before any process starts or the model is built
        drop_allocator_default()  # SGLang's memory saver refuses expandable segments (a user's setting stays)
    source = build_source(cfg)  # bad data settings (a task/model mismatch, ...) fail before any process starts
    if not torch.cuda.is_available():  # CPU: the ranks share this host's memory; a batch it cannot hold fails here
        cap_allocator(cfg.memory.cap_gib)  # a cap is refused here (no GPU), before the ranks load megatron
        if cfg.rollout.engine == "embedded":
            check_decode_settings(cfg)  # the decode kernels a CPU cannot run, likewise
        for name in modes or [cfg.mode.name]:
            mcfg = dataclasses.replace(cfg, mode=dataclasses.replace(cfg.mode, name=name))
            check_run_fits(mcfg, source, memory_plan(mcfg, source))
    return cfg


def _report(root: Path, plans: list[RunConfig], modes: list[str] | None, cfg: RunConfig) -> None:
    """summary.json and report.png over every recorded step of each mode (resumed segments too)."""
    names = modes or [cfg.mode.name]
    paths = {n: root / n / R.METRICS if modes else root / R.METRICS for n in names}
    runs = {n: read_metrics(p) for n, p in paths.items() if p.exists()}
    runs = {n: recs for n, recs in runs.items() if recs}
    val_runs = {n: read_metrics(paths[n], kind="val") for n in runs}
    if not runs:
        return
    chance = chance_acc = None  # known for the rendered tasks; a dataset's is not
    if source_name(cfg) == "rendered":
        source = build_source(cfg)
        chance, chance_acc = source.chance_reward, source.chance_accuracy
    summary = {name: summarize(recs) for name, recs in runs.items()}
    for name, recs in runs.items():
        recs = sorted(recs, key=lambda r: r["step"])
        k = max(1, len(recs) // 5)
        summary[name]["accuracy_first20"] = sum(r["accuracy"] for r in recs[:k]) / k
        summary[name]["accuracy_last20"] = sum(r["accuracy"] for r in recs[-k:]) / k
        if val_runs[name]:
            summary[name]["val"] = {"first": val_runs[name][0], "last": val_runs[name][-1]}
    png = plot_runs(runs, str(root / "report.png"), chance=chance, val_runs=val_runs)
    atomic_write_text(root / "summary.json", json.dumps({"chance_reward": chance, "chance_accuracy": chance_acc,
                                                         "modes": summary}, indent=1))
    for name, s in summary.items():
        rnd = f"; random-answer policy {chance:.2f}" if chance is not None else ""
        acc = f" (chance {chance_acc:.2f})" if chance_acc is not None else ""
        print(f"{name}: reward {s['reward_first20']:.3f} -> {s['reward_last20']:.3f} (first -> last 20% of steps"
              f"{rnd}), accuracy {s['accuracy_first20']:.3f} -> {s['accuracy_last20']:.3f}{acc}; "
              f"{s['step_time_s']:.2f} s/step, {100 * s['data_share']:.1f}% waiting for data")
        if "val" in s:
            print(f"{name}: val/reward_mean {s['val']['first']['val/reward_mean']:.3f} (step "
                  f"{s['val']['first']['step']}) -> {s['val']['last']['val/reward_mean']:.3f} "
                  f"(step {s['val']['last']['step']})")
    print(f"report: {png}")


def main(overrides: list[str], modes: list[str] | None = None) -> int:
    """Train one mode (or several in turn), write report.png and summary.json, print the run dir last."""
    cfg = _config(overrides, modes)
    root = Path(cfg.train.out or os.path.join(cfg.run_dir, time.strftime("%Y%m%d-%H%M%S") + "-train")).resolve()
    rank0 = not under_torchrun() or os.environ["RANK"] == "0"
    plans = _plan(cfg, root, modes, rank0)
    if under_torchrun():
        exit_with_parent()  # a rank whose torchrun agent was killed stops writing
    dirs = list(dict.fromkeys([root] + [Path(p.train.out) for p in plans])) if rank0 else []
    fresh = [d for d in dirs if not d.exists()]  # created by this start: removed again if it fails before writing
    try:
        return _train(cfg, root, plans, modes, dirs, rank0)
    except BaseException:
        for d in reversed(fresh):  # the modes' directories before the root that holds them
            R.remove_if_unused(d)
        raise


def _train(cfg: RunConfig, root: Path, plans: list[RunConfig], modes: list[str] | None, dirs: list[Path],
           rank0: bool) -> int:
    """`main`'s launch: lock `dirs` (rank 0), train each plan, report."""
    with ExitStack() as stack:
        locks = []
        for d in dirs:  # the launcher (rank 0 under torchrun) holds every directory it writes
            locks.append(stack.enter_context(R.RunLock(d)))
            R.clean_interrupted(d, locks[-1])
        launcher = _Launcher(locks)
        stack.callback(launcher.close)
        stopped = None
        for mcfg in plans:
            try:
                res = _launch(mcfg, launcher)
            except LocalRunError as e:
                if not launcher.preempted:
                    raise
                return _stopped_mid_step(launcher, Path(mcfg.train.out), root, modes, e)
            stopped = res.get("preempted_at")
            launcher.pids = []  # this mode's workers have exited
            if stopped or launcher.preempted:
                break
        if not rank0:
            return 0
        _report(root, plans, modes, cfg)
        if stopped or launcher.preempted:
            where = f"after step {stopped}" if stopped else f"({launcher.signal} came as the run ended)"
            print(f"stopped by {launcher.signal} {where}: checkpoint written; continue with "
                  f"{_resume_command(root, modes)}")
    print(root)
    return launcher.exit_code(saved=True)


def _resume_command(root: Path, modes: list[str] | None) -> str:
    """The overrides that continue the run at `root` from its latest checkpoint."""
    return f"train.resume=true train.out={root}" + (f" --modes {','.join(modes)}" if modes else "")


def _stopped_mid_step(launcher: _Launcher, out: Path, root: Path, modes: list[str] | None, error: LocalRunError) -> int:
    """A stop signal ended the launch inside a step (a user function abandoned, a second Ctrl-C, or a rank that
    failed meanwhile): one line naming the last checkpoint and how to continue from it; no traceback."""
    latest = R.published_checkpoint(out)
    how = "the workers were killed by a second Ctrl-C" if launcher.killed else error.summary
    if latest is None:
        saved = "no checkpoint was written yet, so nothing can be resumed: start the run again"
    else:
        saved = (f"the last checkpoint is step {train_state.read_meta(latest)['step']} ({latest}); continue with "
                 f"{_resume_command(root, modes)}")
    print(f"stopped by {launcher.signal} inside a step ({how}); that step was not saved: {saved}", file=sys.stderr)
    return launcher.exit_code(saved=False)
