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
"""
from __future__ import annotations

import math
import os
import secrets
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection, Listener

import torch.multiprocessing  # noqa: F401  (registers torch's tensor reductions on multiprocessing's pickler)

ENV_ADDRESS = "ROLLPLEX_SGLANG_BRIDGE"  # host:port[,host:port...]: the trainer's listener per SGLang TP rank
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


def connect(tp_rank: int, timeout: float | None = None) -> Link:
    """Scheduler side: connect to the trainer listener of SGLang TP rank `tp_rank` (from the environment)."""
    addrs = [a for a in os.environ.get(ENV_ADDRESS, "").split(",") if a]
    if tp_rank >= len(addrs):
        raise BridgeError(f"{ENV_ADDRESS} lists {len(addrs)} address(es) but this is SGLang TP rank {tp_rank}; the "
                          f"trainer must listen once per SGLang TP rank")
    host, port = addrs[tp_rank].rsplit(":", 1)
    if ENV_KEY not in os.environ:
        raise BridgeError(f"{ENV_KEY} is not set; the trainer sets it next to {ENV_ADDRESS}")
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ[ENV_KEY]))
    return Link(conn, "the trainer", timeout)
