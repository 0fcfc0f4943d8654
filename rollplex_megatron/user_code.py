"""User functions named by dotted path ("package.module:function", e.g. `reward.fn`) run in a worker process,
with a time limit per call, and a stop signal (SIGTERM/SIGINT) that does not wait for them forever.

Why a process: the user's code may never return. A thread cannot be stopped (join(timeout) leaves it running,
holding whatever it holds); SIGALRM interrupts Python bytecode but not C code that keeps the GIL (a regular
expression backtracking catastrophically, a C extension's loop), works only in the main thread and collides
with the user's own alarms. A process can always be killed, whatever it runs. The cost is one round trip per
call (~0.1 ms) and the rule that arguments and results are pickled (a reward's str, ground truth and dict in,
a float or dict out).

The worker starts on the first call with the caller's sys.path (as PYTHONPATH), imports each function itself,
ignores SIGINT and SIGTERM (the trainer decides what a signal means; a terminal's Ctrl-C does not reach it, it
has a session of its own) and dies with its caller (Linux PR_SET_PDEATHSIG, else a watcher thread, and EOF on
its socket). A call past its limit, or one still running `STOP_GRACE_S` after `ask_stop` (the trainer's signal
handler), kills the worker; the next call starts a fresh one.

    python -m rollplex_megatron.user_code FD PARENT_PID   (started by `UserFunctions`, not by hand)
"""
from __future__ import annotations

import ctypes
import importlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from multiprocessing.connection import Connection
from typing import Any

STOP_GRACE_S = 5.0  # a call still running this long after a stop signal is abandoned (SLURM waits 30 s to kill)
_POLL_S = 0.05  # how often a waiting caller looks at its deadlines (a result wakes it at once)
_STOP_AT: float | None = None  # time.monotonic() of the stop signal in this process, None without one


class UserCodeError(RuntimeError):
    """A user function raised, or returned what the caller cannot use (the message names the function, the row
    and the fix): the user's to mend, printed as one line by the command line."""


class UserCodeTimeout(RuntimeError):
    """A user function ran past its time limit (the worker running it was killed)."""


class UserCodeStopped(RuntimeError):
    """A user function was still running `STOP_GRACE_S` after a stop signal (the worker running it was killed)."""


def ask_stop() -> None:
    """A stop signal came (safe in a signal handler): calls running `STOP_GRACE_S` after it are abandoned."""
    global _STOP_AT
    if _STOP_AT is None:
        _STOP_AT = time.monotonic()


def clear_stop() -> None:
    """Forget a stop signal (a run that handled it is over)."""
    global _STOP_AT
    _STOP_AT = None


def resolve(spec: str):
    """The object named "package.module:attr.path" (the caller has checked the name: `rewards.load_function`)."""
    module_name, _, attr = spec.partition(":")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


class UserFunctions:
    """Calls of the functions named `specs`, each in this caller's worker process (see the module docstring)."""

    def __init__(self, specs: list[str]):
        self.specs = list(dict.fromkeys(specs))
        self._proc = self._conn = None
        self._finalizer = None

    def call(self, spec: str, args: tuple, limit_s: float = 0.0) -> Any:
        """`spec(*args)` in the worker; UserCodeTimeout past `limit_s` seconds (0: no limit), UserCodeStopped
        after a stop signal, RuntimeError when the worker dies; the function's own exception is raised as it is
        (its traceback in the worker as a note)."""
        if self._proc is not None and self._proc.poll() is not None:  # it died while idle (its parent thread ended:
            self.close()  # PR_SET_PDEATHSIG follows the thread that started it): a fresh one takes over
        if self._conn is None:
            self._start()
        ok, value, remote_tb = self._request(("call", spec, args), limit_s)
        if ok:
            return value
        if remote_tb:
            value.add_note(f"in the user-function worker:\n{remote_tb}")
        raise value

    def close(self) -> None:
        """Stop the worker (a later call starts a new one)."""
        if self._finalizer is not None:
            self._finalizer()
        self._proc = self._conn = self._finalizer = None

    def _start(self) -> None:
        """Start the worker and import every function there (not timed: a heavy import is not a slow call)."""
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        with theirs:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "rollplex_megatron.user_code", str(theirs.fileno()), str(os.getpid())],
                pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        self._conn = Connection(ours.detach())
        self._finalizer = weakref.finalize(self, _kill, self._proc, self._conn)
        for spec in self.specs:
            ok, value, remote_tb = self._request(("load", spec, ()), 0.0)
            if not ok:
                raise RuntimeError(f"{spec}: the worker could not import it ({value!r})\n{remote_tb}")

    def _request(self, message: tuple, limit_s: float) -> tuple:
        """Send `message`, wait for its reply; any way out but the reply kills the worker, so a later call never
        reads a stale reply."""
        start, done = time.monotonic(), False
        try:
            self._conn.send(message)
            while not self._conn.poll(_POLL_S):
                self._check(start, limit_s)
            reply, done = self._conn.recv(), True
            return reply
        except (EOFError, OSError):
            code = self._proc.poll() if self._proc is not None else None
            raise RuntimeError(f"the user-function worker died (exit code {code}); the function ended its process "
                               "(os._exit, a crash, running out of memory)") from None
        finally:
            if not done:
                self.close()

    def _check(self, start: float, limit_s: float) -> None:
        """Raise when the running call is past its limit or past the grace after a stop signal."""
        now = time.monotonic()
        if limit_s and now - start >= limit_s:
            raise UserCodeTimeout(f"did not return within {limit_s:g} s")
        if _STOP_AT is not None and now - max(start, _STOP_AT) >= STOP_GRACE_S:
            raise UserCodeStopped(f"was still running {STOP_GRACE_S:g} s after the stop signal")


def _kill(proc: subprocess.Popen, conn: Connection) -> None:
    """End a worker, busy or idle (it ignores SIGTERM), and reap it."""
    conn.close()
    proc.kill()
    proc.wait()


# --- The worker process -------------------------------------------------------------------------------------------
def _die_with(parent: int) -> None:
    """Exit as soon as `parent` dies: the kernel's parent-death signal (Linux, works while this process runs C
    code), and a watcher thread elsewhere."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (AttributeError, OSError):
        pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _reply(conn: Connection, kind: str, spec: str, args: tuple, fns: dict) -> None:
    """Load or call `spec`; send (ok, value or exception, worker traceback or None)."""
    try:
        if spec not in fns:
            fns[spec] = resolve(spec)
        reply = (True, fns[spec](*args) if kind == "call" else None, None)
    except Exception as e:  # the user's exception goes back to the caller, which raises it
        reply = (False, e, traceback.format_exc())
    try:
        conn.send(reply)
    except Exception as e:  # an unpicklable result or exception: send() pickles before it writes anything
        what = "result" if reply[0] else f"exception {type(reply[1]).__name__}: {reply[1]}"
        conn.send((False, TypeError(f"its {what} cannot be pickled ({type(e).__name__}: {e}); return a float or "
                                    "a dict of numbers"), reply[2]))


def serve(fd: int, parent: int) -> None:
    """The worker's loop: requests from the socket `fd` until it closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with(parent)
    if os.getppid() != parent:  # the parent died before the death signal was set
        return
    conn, fns = Connection(fd), {}
    while True:
        try:
            kind, spec, args = conn.recv()
        except (EOFError, OSError, pickle.UnpicklingError):
            return
        _reply(conn, kind, spec, args, fns)


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
