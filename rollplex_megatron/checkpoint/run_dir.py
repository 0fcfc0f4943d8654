"""A training run directory: what it holds, who may write it, how a start or a resume treats it.

Layout of `<run>/`:
  .lock              held (fcntl) by the launcher while the run trains; holds its pid, host and
                     worker pids, so that a busy directory names its owner
  config.yaml        the resolved config in force (rewritten on resume: only resumable settings differ)
  memory_plan.json   the planner's bytes per phase and class
  metrics.jsonl      one line per step; on resume cut back to the checkpoint's step
  checkpoints/       atomic checkpoints (train_state.py)
  summary.json, report.png   over every step of the run, all resumed segments included

Every check here runs in the launcher before a process starts, so a refused start changes nothing. train.out
is never a filesystem root, the home folder, this package's checkout or a non-empty folder that holds no run
(`check_place`, `check_foreign`); a `latest` that is missing or damaged beside a complete checkpoint is answered
with the command that publishes it (`published_checkpoint`), never with advice to remove the run.
"""
from __future__ import annotations

import fcntl
import json
import os
import shlex
import shutil
import socket
import sys
import zipfile
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from rollplex_megatron.checkpoint import train_state
from rollplex_megatron.data import fingerprint
from rollplex_megatron.checkpoint.files import atomic_write_text
from rollplex_megatron.config import RunConfig, flat_settings
from rollplex_megatron.schema import resumable

LOCK = ".lock"
METRICS = "metrics.jsonl"
RUN_FILES = ("config.yaml", METRICS, train_state.CHECKPOINTS)
# The folder that holds this package: its repository checkout (or site-packages for an installed one)
CHECKOUT = Path(__file__).resolve().parents[2]


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
            and not resumable(RunConfig, k)]  # settings flagged resumable in config.py's metadata


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


def forbidden_place(path: Path) -> str:
    """Why `path` may never hold a run (the filesystem root, the home folder, this package's checkout), or ""."""
    path = Path(path).expanduser().resolve()
    try:
        home = Path.home().resolve()
    except RuntimeError:  # no HOME and no password entry: there is no home folder to protect
        home = None
    if path.parent == path:
        return "a filesystem root"
    if path == home:
        return "the home folder"
    if path == CHECKOUT:
        return "the folder that holds the rollplex_megatron package (its checkout)"
    return ""


def check_place(out: Path) -> None:
    """Refuse a train.out that is a filesystem root, the home folder or this package's checkout: a run writes its
    files and its lock at the top of train.out, and every later run inside that folder would be refused."""
    why = forbidden_place(out)
    if why:
        raise RunDirError(f"train.out={out} is {why}; a run writes config.yaml, checkpoints/ and its lock at the top "
                          f"of train.out: give the run a folder of its own (e.g. train.out=runs/NAME)")


def is_run(path: Path, modes=()) -> bool:
    """`path` holds a run of this project: a run's files or lock at its top, or a --modes comparison (`modes`: the
    mode names, one folder each)."""
    path = Path(path)
    return any((path / f).exists() for f in (*RUN_FILES, LOCK)) \
        or any((path / m / f).exists() for m in modes for f in RUN_FILES)


def check_foreign(out: Path, modes=()) -> None:
    """Refuse a train.out that is a non-empty folder holding no run of this project (the run would mix its files
    with the folder's); a missing or empty folder, or a run's own (to resume), is fine."""
    out = Path(out)
    if not out.is_dir() or is_run(out, modes):
        return
    names = sorted(p.name for p in out.iterdir())
    if names:
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise RunDirError(f"train.out={out} is a folder that holds other files ({shown}) and no run of this "
                          f"project; a run needs a folder of its own: choose a new or empty folder")


def _whole(step_dir: Path) -> bool:
    """`step_dir` holds a complete checkpoint: meta.json of its step, and every rank file its world size names,
    each a readable torch (zip) file."""
    try:
        meta = train_state.read_meta(step_dir)
        world, step = int(meta["world_size"]), int(meta["step"])
    except (OSError, ValueError, KeyError, TypeError):  # no meta.json, or a damaged one
        return False
    files = [step_dir / train_state.rank_file_name(r) for r in range(world)]
    return world > 0 and step == int(step_dir.name[5:]) and all(f.is_file() and zipfile.is_zipfile(f) for f in files)


def complete_steps(run: Path) -> list[Path]:
    """The `step_N` directories of `run` that hold a complete checkpoint (`_whole`), newest first."""
    root = Path(run) / train_state.CHECKPOINTS
    steps = [p for p in root.glob("step_*") if p.name[5:].isascii() and p.name[5:].isdigit()]
    return sorted((p for p in steps if _whole(p)), key=lambda p: int(p.name[5:]), reverse=True)


def publish_command(run: Path, step_dir: Path) -> str:
    """The shell command that makes `step_dir` the checkpoint a resume of `run` starts from."""
    return f"echo {step_dir.name} > {shlex.quote(str(Path(run) / train_state.CHECKPOINTS / train_state.LATEST))}"


def published_checkpoint(run: Path) -> Path | None:
    """The checkpoint `checkpoints/latest` names, or None when the run has none. A `latest` that is missing or
    damaged while a step directory holds a complete checkpoint is a RunDirError naming that checkpoint and the
    command that publishes it: a directory that holds a checkpoint is never advice to remove."""
    run = Path(run)
    if not run.is_dir():
        return None
    pointer = run / train_state.CHECKPOINTS / train_state.LATEST
    try:
        latest = train_state.latest_checkpoint(run)
    except FileNotFoundError as e:  # names no complete step: edited, or its step removed
        latest, damage = None, str(e)
    else:
        damage = f"{pointer} is missing" if not pointer.exists() else f"{pointer} is not a file"
    if latest is not None:
        return latest
    whole = complete_steps(run)
    if whole:
        meta = train_state.read_meta(whole[0])
        raise RunDirError(f"train.out={run}: {damage}, but {whole[0].name} holds a complete checkpoint (step "
                          f"{meta['step']}: meta.json and its {meta['world_size']} rank file(s)); publish it with "
                          f"`{publish_command(run, whole[0])}`, then start again with train.resume=true")
    if pointer.exists() or pointer.is_symlink():
        raise RunDirError(f"train.out={run}: {damage}, and no step directory holds a complete checkpoint (meta.json "
                          f"and every rank file); restore the checkpoint's files, or choose a new train.out")
    return None


def _earlier(run: Path, latest: Path) -> str:
    """The way back to the newest complete checkpoint before `latest`, for a message."""
    older = [p for p in complete_steps(run) if int(p.name[5:]) < int(latest.name[5:])]
    if not older:
        return " (no earlier checkpoint is complete)"
    return (f", or resume from an earlier checkpoint: {older[0].name} is the newest complete one (publish it with "
            f"`{publish_command(run, older[0])}`)")


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
    latest = published_checkpoint(run)  # a complete checkpoint that `latest` does not name: how to publish it
    if latest is None and held:
        unpublished = sorted(p.name for p in (run / train_state.CHECKPOINTS).glob("step_*")
                             if ".tmp-" not in p.name) if (run / train_state.CHECKPOINTS).is_dir() else []
        why = f" ({', '.join(unpublished)} written but never published as latest: the run stopped while saving)" \
            if unpublished else ""
        if any((run / train_state.CHECKPOINTS / n / train_state.META).is_file() for n in unpublished):
            raise RunDirError(f"train.out={run} holds a run whose checkpoints are incomplete{why}: a rank file is "
                              f"missing or damaged; restore the checkpoint's files, or choose a new train.out")
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
                          f"files{_earlier(run, latest)}")
    if steps <= meta["step"]:
        raise RunDirError(f"train.steps={steps} but {latest.name} is at step {meta['step']}; set train.steps "
                          f"above {meta['step']} to continue the run")
    damaged = [n for r in range(meta["world_size"])
               if not zipfile.is_zipfile(latest / (n := train_state.rank_file_name(r)))]
    if damaged:  # torch.save's zip format: a truncated file has no central directory
        raise RunDirError(f"train.resume=true but {latest}/{damaged[0]} is not a readable checkpoint file (truncated "
                          f"or damaged after it was written); restore it{_earlier(run, latest)}")
    changed = resume_changes(meta["config"], config_yaml)
    if changed:
        k, old, new = changed[0]
        more = f" (and {', '.join(c[0] for c in changed[1:])})" if len(changed) > 1 else ""
        raise RunDirError(f"train.resume=true: {k} is {new!r} here but {old!r} in {latest.name}{more}; a resumed "
                          f"run keeps what a step computes (docs/guides/run-directories.md, Resume); set "
                          f"{k}={old!r} (the checkpoint's) or start a new run with another train.out")
    schedule = _schedule_change(meta["config"], config_yaml, int(meta["step"]))  # after `changed`: a new style is that
    if schedule:
        raise RunDirError(f"train.resume=true: {schedule} in {latest.name}")
    _check_data(meta, config_yaml, latest)
    return int(meta["step"])


def _check_data(meta: dict, config_yaml: str, latest: Path) -> None:
    """The data files the checkpoint trained on are unchanged (checkpoints before the fingerprint: not checked)."""
    data = (yaml.safe_load(config_yaml) or {}).get("data") or {}
    try:
        fingerprint.check_unchanged(meta.get("data") or {}, list(data.get("train_files") or []),
                                    bool(data.get("accept_changed_files")), latest.name)
    except ValueError as e:
        raise RunDirError(str(e)) from None


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
        if p.is_symlink():  # never followed: a save makes no links, so this one goes and its target stays
            target = os.readlink(p)
            p.unlink()
            print(f"note: removed the link {p} (named like an interrupted save's leftover; its target {target} is "
                  f"kept)", file=sys.stderr)
        elif p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()
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
