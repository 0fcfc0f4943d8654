"""The bridge's wire: messages between the trainer and SGLang's scheduler process, and a link with timeouts.

Transport: `multiprocessing.connection` (a socket with an auth key) and torch's reductions on
multiprocessing's pickler, so a tensor in a message crosses as a handle, not as bytes: a CUDA tensor
as a CUDA IPC handle of its allocation (the receiver's tensor aliases the sender's memory), a CPU
tensor through shared memory. Nothing here copies a tensor.

One RL step is a handshake: `BeginStep` (the step's jobs announced by count) -> `Job`s, at most
`depth` unanswered at a time (the bounded queue) -> a `Result` or `Failed` per job -> `EndStep` ->
`StepDone`. Jobs run between SGLang's decode steps; those left run when SGLang is idle, but only
after `Drain` (the trainer's word that the rollout's decoding is over: SGLang is also idle between
the step's start and its first batch, which is no decode window). `Drain(step)` is sent from another
thread than the step's `BeginStep` and may arrive before it; the scheduler keeps the latest drained
step, so a drain is never lost to the step it belongs to. Every wait has a timeout that
names the step and the item it waited for, and a closed connection (the other process died or shut
down) is an error naming them too, so neither side hangs on the other.

Finding the trainer: this project's trainer starts SGLang itself and hands its schedulers the listeners'
addresses (`ROLLPLEX_SGLANG_BRIDGE=host:port,...`, one per SGLang TP rank). Where another framework starts
SGLang (verl's server replicas, whose processes cannot be handed each trainer rank's address), the setting
names a rendezvous directory instead (`ROLLPLEX_SGLANG_BRIDGE=dir:PATH`, node-local): each trainer rank
writes its address and key to `PATH/<device>.json` (`publish`) and the scheduler on the same device reads
it (`device_slot`: the CUDA device's UUID). There SGLang keeps its own weights (the framework syncs them),
so the scheduler binds none (`binds_weights`).
"""
from __future__ import annotations

import json
import math
import os
import secrets
import socket
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path

import torch
import torch.multiprocessing  # noqa: F401  (registers torch's tensor reductions on multiprocessing's pickler)

ENV_ADDRESS = "ROLLPLEX_SGLANG_BRIDGE"  # host:port[,host:port...] (a listener per SGLang TP rank) | dir:PATH
RENDEZVOUS = "dir:"  # ENV_ADDRESS's prefix for a rendezvous directory
ENV_KEY = "ROLLPLEX_SGLANG_BRIDGE_KEY"  # hex auth key of the listeners
ENV_TIMEOUT = "ROLLPLEX_SGLANG_BRIDGE_TIMEOUT"  # seconds a side waits for the other (default 600)
DEFAULT_TIMEOUT_S = 600.0


class BridgeError(RuntimeError):
    """The other side of the bridge failed, closed, or sent something out of order."""


class BridgeTimeout(BridgeError):
    """The other side of the bridge did not answer in time."""


@dataclass
class Hello:
    """Scheduler -> trainer, once: who connected."""

    tp_rank: int
    tp_size: int
    pid: int
    version: str  # the SGLang release (or "stand-in")


@dataclass
class ModuleHandles:
    """The modules window jobs run on: how to build each (meta device) and its parameters as handles."""

    model_cfg: object  # ModelConfig
    dtype: str
    megatron: dict
    tp: int  # the training TP the shards belong to
    params: dict[str, dict] = field(default_factory=dict)  # module name -> {parameter name: tensor}
    window: dict = field(default_factory=dict)  # DecodeWindow settings (mechanism, items_per_step, ...)


@dataclass
class WeightHandles:
    """Trainer -> scheduler, once, while SGLang loads: this rank's tensors for SGLang's parameters."""

    named: list  # [(SGLang parameter name, tensor)]


@dataclass
class Job:
    """Trainer -> scheduler: one prefix stage to run in the decode window."""

    step: int
    index: int  # position in the step's job order (the same on every rank)
    name: str
    module: str  # a key of ModuleHandles.params ("reference", "actor")
    prompt: object  # prefix.batch.Prompt (its tensors cross as handles)


@dataclass
class Result:
    """Scheduler -> trainer: the prefix K/V of one job, per layer, as handles of the scheduler's tensors."""

    step: int
    index: int
    kv: dict  # layer -> (k, v) [P,1,Ng,D]
    seconds: float
    in_window: bool  # ran while SGLang decoded (else: drained when SGLang went idle)


@dataclass
class Failed:
    """Scheduler -> trainer: a job raised."""

    step: int
    index: int
    name: str
    error: str


@dataclass
class BeginStep:
    """Trainer -> scheduler: a step with `jobs` jobs starts."""

    step: int
    jobs: int


@dataclass
class Drain:
    """Trainer -> scheduler: the rollout's decoding is over; jobs left may run when SGLang is idle."""

    step: int


@dataclass
class EndStep:
    """Trainer -> scheduler: every job of the step has been sent."""

    step: int


@dataclass
class StepDone:
    """Scheduler -> trainer: every job of the step has run; the window's statistics."""

    step: int
    stats: dict


@dataclass
class Ack:
    """Either way: the last message was taken."""

    what: str


def timeout_s() -> float:
    """The bridge's wait limit (`ROLLPLEX_SGLANG_BRIDGE_TIMEOUT`, seconds)."""
    raw = os.environ.get(ENV_TIMEOUT, "")
    try:
        return float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{ENV_TIMEOUT}={raw!r} is not a number of seconds; set it to e.g. 600") from None


class Link:
    """One end of a bridge connection: send, and receive with a timeout and a named wait."""

    def __init__(self, conn: Connection, peer: str, timeout: float | None = None):
        self.conn, self.peer = conn, peer
        self.timeout = timeout_s() if timeout is None else timeout
        self._lock = threading.Lock()

    def send(self, msg) -> None:
        """Send one message (tensors as handles); safe from several threads."""
        try:
            with self._lock:
                self.conn.send(msg)
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError) as e:
            raise BridgeError(f"{self.peer} closed the bridge before {type(msg).__name__} could be sent "
                              f"({type(e).__name__}); it died or shut down") from e

    def recv(self, waiting_for: str, timeout: float | None = None):
        """The next message; `waiting_for` names the step and item in the error if none comes
        (`timeout`: seconds, None for the link's limit, math.inf to wait as long as the connection lives)."""
        limit = self.timeout if timeout is None else timeout
        try:
            ready = self.conn.poll(None if limit == math.inf else limit)
        except (EOFError, OSError) as e:
            raise BridgeError(f"{self.peer} closed the bridge while {waiting_for} was pending; it died or "
                              f"shut down") from e
        if not ready:
            raise BridgeTimeout(f"no reply from {self.peer} within {limit:g} s while waiting for {waiting_for}; "
                                f"raise {ENV_TIMEOUT} if the work is that long, else the other side is stuck")
        try:
            return self.conn.recv()
        except (EOFError, OSError, ConnectionResetError) as e:
            raise BridgeError(f"{self.peer} closed the bridge while {waiting_for} was pending; it died or "
                              f"shut down") from e

    def close(self) -> None:
        """Close the connection (the other side sees EOF)."""
        self.conn.close()


def new_key() -> str:
    """A fresh auth key for the listeners (hex)."""
    return secrets.token_hex(16)


def listen(host: str = "127.0.0.1", key: str | None = None) -> tuple[Listener, str]:
    """A trainer-side listener on a free port; returns it and its address as host:port."""
    lst = Listener((host, 0), authkey=bytes.fromhex(key or os.environ[ENV_KEY]))
    return lst, f"{lst.address[0]}:{lst.address[1]}"


def rendezvous_dir() -> Path | None:
    """The rendezvous directory ENV_ADDRESS names (`dir:PATH`), else None."""
    value = os.environ.get(ENV_ADDRESS, "")
    return Path(value[len(RENDEZVOUS):]) if value.startswith(RENDEZVOUS) else None


def binds_weights() -> bool:
    """Whether the scheduler takes its parameters from the trainer (this project's trainer starts SGLang), or
    keeps SGLang's own (a rendezvous: the framework that started SGLang syncs its weights)."""
    return rendezvous_dir() is None


def device_slot(tp_rank: int) -> str:
    """The name of the device this process computes on, the same in a trainer rank and in the SGLang scheduler
    on that device: the current CUDA device's UUID; on CPU the host and the TP rank."""
    if torch.cuda.is_available():
        return f"gpu-{torch.cuda.get_device_properties(torch.cuda.current_device()).uuid}"
    return f"cpu-{socket.gethostname()}-tp{tp_rank}"


def check_private(path: Path, what: str) -> None:
    """The rendezvous folder and its files open a channel of pickles into SGLang's scheduler (the address and the
    key a file names): each must be this user's and writable by no one else (a file: readable by no one else), so
    no other account on the host can plant a listener the scheduler would trust. Raises BridgeError naming it."""
    st = path.lstat()
    mask = 0o077 if what == "file" else 0o022
    problem = ("a symbolic link" if path.is_symlink() else
               f"owned by uid {st.st_uid}, not this user ({os.getuid()})" if st.st_uid != os.getuid() else
               f"mode {st.st_mode & 0o777:o}, open to other users" if st.st_mode & mask else "")
    if problem:
        fix = ("use a folder of your own that only you can write (mkdir -m 700 DIR) in "
               f"{ENV_ADDRESS}=dir:DIR" if what == "folder" else "remove it; the trainer writes its own")
        raise BridgeError(f"{ENV_ADDRESS}: the rendezvous {what} {path} is {problem}: a listener named there would "
                          f"be trusted with the scheduler's pickles; {fix}")


def publish(directory: Path, slot: str, address: str, key: str, model_path: str | None = None) -> Path:
    """Trainer side: write this rank's listener for the scheduler on its device (written aside and renamed, so
    a reader never sees half a file; readable by this user only: it holds the auth key). `model_path`: only a
    scheduler serving that checkpoint connects (not another SGLang server of the job on the same device, such
    as a reward model's). A file of a run before is replaced: the newest trainer on a device is the one. The
    folder is made private (mode 700) and must be this user's and writable by no one else (`check_private`)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_private(directory, "folder")
    path = directory / f"{slot}.json"
    tmp = directory / f".{slot}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"address": address, "key": key, "pid": os.getpid(), "model_path": model_path}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def _rendezvous_link(tp_rank: int, model_path: str | None, timeout: float | None) -> Link | None:
    """Scheduler side under a rendezvous: the link to the trainer rank on this device, or None when this
    scheduler has none (no file for its device: no trainer rank there; a file for another checkpoint: this is
    another of the job's SGLang servers; a listener that is gone: a file left by an earlier run). Trainer ranks
    publish before the framework starts SGLang, so there is nothing to wait for."""
    directory = rendezvous_dir()
    path = directory / f"{device_slot(tp_rank)}.json"
    if not path.exists():
        return None
    check_private(directory, "folder")
    check_private(path, "file")
    entry = json.loads(path.read_text())
    if model_path and entry.get("model_path") and entry["model_path"] != model_path:
        return None
    host, port = entry["address"].rsplit(":", 1)
    try:
        conn = Client((host, int(port)), authkey=bytes.fromhex(entry["key"]))
    except ConnectionRefusedError:
        return None
    return Link(conn, "the trainer", timeout)


def connect(tp_rank: int, timeout: float | None = None, model_path: str | None = None) -> Link | None:
    """Scheduler side: connect to the trainer listener of SGLang TP rank `tp_rank` (from the environment: the
    address list, or the rendezvous file of this device: None when it names no trainer for this scheduler)."""
    if rendezvous_dir() is not None:
        return _rendezvous_link(tp_rank, model_path, timeout)
    addrs = [a for a in os.environ.get(ENV_ADDRESS, "").split(",") if a]
    if tp_rank >= len(addrs):
        raise BridgeError(f"{ENV_ADDRESS} lists {len(addrs)} address(es) but this is SGLang TP rank {tp_rank}; the "
                          f"trainer must listen once per SGLang TP rank")
    host, port = addrs[tp_rank].rsplit(":", 1)
    if ENV_KEY not in os.environ:
        raise BridgeError(f"{ENV_KEY} is not set; the trainer sets it next to {ENV_ADDRESS}")
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ[ENV_KEY]))
    return Link(conn, "the trainer", timeout)
