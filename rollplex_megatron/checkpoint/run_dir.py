"""A training run directory: what it holds, who may write it, how a start or a resume treats it.

Layout of `<run>/`:
  .lock              held (fcntl) by the launcher while the run trains; holds its pid, host and
                     worker pids, so that a busy directory names its owner
  config.yaml        the resolved config in force (rewritten on resume: only RESUMABLE settings differ)
  memory_plan.json   the planner's bytes per phase and class
  metrics.jsonl      one line per step; on resume cut back to the checkpoint's step
  checkpoints/       atomic checkpoints (train_state.py)
  summary.json, report.png   over every step of the run, all resumed segments included

Every check here runs in the launcher before a process starts, so a refused start changes nothing.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import zipfile
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from rollplex_megatron.checkpoint import train_state
from rollplex_megatron.models.qwen25vl.hf import atomic_write_text
from rollplex_megatron.config import RunConfig, flat_settings

LOCK = ".lock"
METRICS = "metrics.jsonl"
RUN_FILES = ("config.yaml", METRICS, train_state.CHECKPOINTS)

# Settings that may differ from the checkpoint's on resume: they change how a step executes or
# what is written, not what it computes (the modes and memory plans give the same update).
# Everything else (lr, loss, batch, seed, model, task, ...) is refused on resume.
RESUMABLE = ("train.steps", "train.save_every", "train.save_final", "train.resume", "train.out",
             "train.progress", "run_dir", "mode.", "memory.", "rollout.cuda_graphs", "rollout.keep_decode_state",
             "rollout.decode_attention", "rollout.sampling_kernel", "train.logprob_kernel", "train.norm_kernel",
             "train.rope_kernel", "workload.prefix_pack_tokens", "parallel.backend",
             "smoke.", "verify.", "plan.",
             "train.val_every", "val.", "data.val_files", "data.prefetch",  # evaluation, prefetch, trackers,
             "train.tensorboard", "train.wandb",  # the profiler: what a step computes stays the same
             "train.profile_step", "train.profile_phases")


class RunDirError(ValueError):
    """The run directory cannot be used as asked; the message names the way out."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc, Linux), to tell a reused pid apart."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _same_process(pid: int, started: int | None) -> bool:
    """`pid` is alive and (where /proc tells) is the process recorded, not a later one with its pid."""
    return _pid_alive(pid) and (started is None or _start_time(pid) in (None, started))


class RunLock:
    """Exclusive lock of a run directory for one launcher (and the workers it records).

    The kernel releases the fcntl lock when its holder dies, so a lock left by a killed launcher is
    stale by construction; its file still names the pids, and live workers of a dead launcher (they
    exit within a fraction of a second, `dist.exit_with_parent`) still block a new start.
    """

    def __init__(self, run: Path):
        self.path = Path(run) / LOCK
        self.fd: int | None = None
        self.info: dict = {}

    def acquire(self) -> "RunLock":
        """Take the lock or raise RunDirError naming its holder."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            held = self._read()
            raise RunDirError(f"{self.path.parent} is in use by pid {held.get('pid')} on {held.get('host')} "
                              f"(lock {self.path}); wait for that run to end or stop it") from None
        old = self._read()
        here = socket.gethostname()
        workers = old.get("workers", [])
        starts = old.get("worker_starts") or [None] * len(workers)
        alive = [p for p, t in zip(workers, starts) if old.get("host") == here and _same_process(p, t)]
        if alive:
            os.close(fd)
            raise RunDirError(f"{self.path.parent}: worker process(es) {alive} of the earlier launcher pid "
                              f"{old.get('pid')} are still running; stop them before starting again")
        self.fd = fd
        self.info = {"pid": os.getpid(), "host": here, "workers": [], "worker_starts": []}
        self._write()
        return self

    @staticmethod
    def in_use(run: Path) -> dict | None:
        """The holder's record ({"pid", "host", ...}) when a launcher holds `run`'s lock now, else None (a probe
        that creates nothing; the launcher still takes the lock itself)."""
        path = Path(run) / LOCK
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:  # no lock file: never started there
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                return json.loads(path.read_text() or "{}") or {"pid": None}
            except (OSError, ValueError):
                return {"pid": None}
        finally:
            os.close(fd)  # closing releases a lock taken here
        return None

    def add_workers(self, pids: list[int]) -> None:
        """Record the worker processes this launcher started (the current ones: earlier modes' exited)."""
        self.info["workers"] = list(pids)
        self.info["worker_starts"] = [_start_time(p) for p in pids]
        self._write()

    def release(self) -> None:
        """Unlock; the file stays (removing it would race with a launcher that opened it)."""
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def _read(self) -> dict:
        try:
            return json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}

    def _write(self) -> None:
        data = json.dumps(self.info).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)
        os.fsync(self.fd)

    def __enter__(self) -> "RunLock":
        return self.acquire() if self.fd is None else self

    def __exit__(self, *exc) -> None:
        self.release()


def resume_changes(saved_yaml: str, config_yaml: str) -> list[tuple[str, object, object]]:
    """(setting, checkpoint value, new value) for every setting that differs and may not on resume.
    A setting newer than the checkpoint (absent from its config) counts as unchanged at its default."""
    old, new = flat_settings(yaml.safe_load(saved_yaml) or {}), flat_settings(yaml.safe_load(config_yaml) or {})
    defaults = flat_settings(yaml.safe_load(OmegaConf.to_yaml(OmegaConf.structured(RunConfig))))
    keys = sorted(set(old) | set(new))
    return [(k, old.get(k), new.get(k)) for k in keys
            if old.get(k) != new.get(k) and not (k not in old and k in defaults and new.get(k) == defaults[k])
            and not any(k == r or (r.endswith(".") and k.startswith(r)) for r in RESUMABLE)]


def _schedule_change(saved_yaml: str, config_yaml: str, at_step: int) -> str:
    """Why a resume with another train.steps would change the learning rates of the steps already trained: the
    decay length is train.steps (optim.lr_decay_steps=0) under a decaying style; "" when it would not."""
    old, new = flat_settings(yaml.safe_load(saved_yaml) or {}), flat_settings(yaml.safe_load(config_yaml) or {})
    before, after = old.get("train.steps"), new.get("train.steps")
    if before == after or new.get("optim.lr_decay_steps") or new.get("optim.lr_decay_style") == "constant":
        return ""
    way = f"resume with train.steps={before}, or " if before > at_step else ""  # else that schedule has ended
    return (f"train.steps is {after} here but {before}, and optim.lr_decay_steps=0 decays the learning rate "
            f"({new.get('optim.lr_decay_style')}) over train.steps, so the steps already trained followed a "
            f"{before}-step schedule that a {after}-step run would not; {way}start a new run with "
            f"optim.lr_decay_steps set (such a run may be extended)")


def check_start(run: Path, resume: bool, steps: int, config_yaml: str, launcher: bool = True) -> int:
    """Before any process starts: the step this run starts at, or RunDirError with the way out. `launcher`: this
    process will take the directory's lock (rank 0); the other torchrun ranks only read, and may find that lock
    held already."""
    run = Path(run)
    if run.exists() and not run.is_dir():
        raise RunDirError(f"train.out={run} is a file, not a run directory; choose another train.out")
    holder = RunLock.in_use(run) if launcher else None
    if holder is not None:  # before reading it: a live run's directory is not advice to remove (no checkpoint yet)
        raise RunDirError(f"{run} is in use by pid {holder.get('pid')} on {holder.get('host')} (lock {run / LOCK}); "
                          f"wait for that run to end or stop it")
    held = [f for f in RUN_FILES if (run / f).exists()]
    latest = train_state.latest_checkpoint(run) if run.is_dir() else None
    if latest is None and held:
        unpublished = sorted(p.name for p in (run / train_state.CHECKPOINTS).glob("step_*")
                             if ".tmp-" not in p.name) if (run / train_state.CHECKPOINTS).is_dir() else []
        why = f" ({', '.join(unpublished)} written but never published as latest: the run stopped while saving)" \
            if unpublished else ""
        raise RunDirError(f"train.out={run} holds a run ({', '.join(held)}) that stopped before its first "
                          f"checkpoint{why}, so there is nothing to resume; remove that directory or choose a new "
                          f"train.out")
    if not resume:
        if held:
            raise RunDirError(f"train.out={run} already holds a run ({', '.join(held)}); continue it with "
                              f"train.resume=true, or choose a new train.out")
        return 0
    if latest is None:
        raise RunDirError(f"train.resume=true but {run} has no checkpoint to resume from; drop train.resume "
                          f"to start a new run there, or point train.out at the run to continue")
    meta = train_state.read_meta(latest)
    missing = [train_state.rank_file_name(r) for r in range(meta["world_size"])
               if not (latest / train_state.rank_file_name(r)).is_file()]
    if missing:
        raise RunDirError(f"train.resume=true but {latest} lacks {', '.join(missing)} of its world size "
                          f"{meta['world_size']} (the checkpoint was damaged after it was written); restore those "
                          f"files, or resume from an earlier checkpoint by writing its directory name (step_...) "
                          f"into {run / train_state.CHECKPOINTS / train_state.LATEST}")
    if steps <= meta["step"]:
        raise RunDirError(f"train.steps={steps} but {latest.name} is at step {meta['step']}; set train.steps "
                          f"above {meta['step']} to continue the run")
    damaged = [n for r in range(meta["world_size"])
               if not zipfile.is_zipfile(latest / (n := train_state.rank_file_name(r)))]
    if damaged:  # torch.save's zip format: a truncated file has no central directory
        raise RunDirError(f"train.resume=true but {latest}/{damaged[0]} is not a readable checkpoint file (truncated "
                          f"or damaged after it was written); restore it, or resume from an earlier checkpoint by "
                          f"writing its directory name (step_...) into "
                          f"{run / train_state.CHECKPOINTS / train_state.LATEST}")
    changed = resume_changes(meta["config"], config_yaml)
    if changed:
        k, old, new = changed[0]
        more = f" (and {', '.join(c[0] for c in changed[1:])})" if len(changed) > 1 else ""
        raise RunDirError(f"train.resume=true: {k} is {new!r} here but {old!r} in {latest.name}{more}; a resumed "
                          f"run keeps what a step computes (README, Resume: the settings that may change); set "
                          f"{k}={old!r} (the checkpoint's) or start a new run with another train.out")
    schedule = _schedule_change(meta["config"], config_yaml, int(meta["step"]))  # after `changed`: a new style is that
    if schedule:
        raise RunDirError(f"train.resume=true: {schedule} in {latest.name}")
    return int(meta["step"])


def remove_if_unused(run: Path) -> bool:
    """Remove a run directory a failed start created and left with nothing but its (released) lock file, so a
    start refused by a worker's check leaves no empty run behind; anything else in it is kept."""
    run = Path(run)
    if not run.is_dir() or any(p.name != LOCK for p in run.iterdir()) or RunLock.in_use(run) is not None:
        return False
    (run / LOCK).unlink(missing_ok=True)
    try:
        run.rmdir()
    except OSError:  # something appeared meanwhile: it stays
        return False
    return True


def clean_interrupted(run: Path, lock: RunLock) -> list[str]:
    """With the lock held: remove what interrupted saves left (`checkpoints/*.tmp-*`, `.*.tmp-*`)."""
    assert lock.fd is not None, "clean_interrupted needs the run directory's lock"
    run, removed = Path(run), []
    for p in list((run / train_state.CHECKPOINTS).glob("*.tmp-*")) + list(run.glob(".*.tmp-*")):
        shutil.rmtree(p) if p.is_dir() else p.unlink()
        removed.append(p.name)
    return removed


def truncate_metrics(run: Path, step: int) -> int:
    """Keep the records of steps 1..`step` (a crash after a record but before its checkpoint would
    otherwise log that step twice); returns how many lines were dropped."""
    path = Path(run) / METRICS
    if not path.exists():
        return 0
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    whole = lines
    if lines:
        try:
            json.loads(lines[-1])
        except ValueError:  # a crash in the middle of appending the last record
            whole = lines[:-1]
    keep = [ln for ln in whole if json.loads(ln)["step"] <= step]
    if len(keep) != len(lines):
        atomic_write_text(path, "".join(ln + "\n" for ln in keep))
    return len(lines) - len(keep)
