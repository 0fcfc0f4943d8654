"""Named parts of a phase, timed without synchronising the device.

A part is marked with `with span("name"):` in the code that does the work (the prefix forward, the schedule,
the prefix backward, ...). It is recorded only inside `collect()` (the trainer's `PhaseTimer` opens one per
phase); elsewhere `span` does nothing. Each part records its host seconds and, on CUDA, two timing events on
the current stream, at its start and end: after the phase's synchronisation their elapsed time is the GPU time
the stream spent on the work issued inside the part (plus any time it sat idle waiting for the host to issue
more). A part whose host seconds exceed its GPU seconds is paced by the host.

No event is recorded while the current stream captures a CUDA graph. The collection is per thread (a context
variable): parts issued from another thread (the decode window's issuer) are not recorded.
"""
from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar

import torch

_ACTIVE: ContextVar["Parts | None"] = ContextVar("rollplex_parts", default=None)


class Parts:
    """The parts recorded inside one `collect()`."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, float, tuple | None]] = []  # (name, host seconds, (start, end) events or None)

    def summary(self) -> dict[str, dict]:
        """Per part name: how often it ran, its host seconds and (CUDA) its GPU seconds, summed. Reads the
        events: call after the phase's work has been synchronised."""
        out: dict[str, dict] = {}
        for name, host, events in self.rows:
            gpu = None
            if events is not None:
                events[1].synchronize()
                gpu = events[0].elapsed_time(events[1]) / 1e3
            _add(out, name, 1, host, gpu)
        return out


def merge(into: dict[str, dict], more: dict[str, dict]) -> dict[str, dict]:
    """`more`'s parts added to `into`'s (a phase that runs more than once a step: one update per mini-batch)."""
    for name, row in more.items():
        _add(into, name, row["count"], row["host_s"], row["gpu_s"])
    return into


def _add(into: dict[str, dict], name: str, count: int, host: float, gpu: float | None) -> None:
    acc = into.setdefault(name, {"count": 0, "host_s": 0.0, "gpu_s": None})
    acc["count"] += count
    acc["host_s"] += host
    if gpu is not None:
        acc["gpu_s"] = (acc["gpu_s"] or 0.0) + gpu


@contextmanager
def collect():
    """Record the parts marked in the enclosed code (this thread); yields the `Parts`."""
    parts = Parts()
    token = _ACTIVE.set(parts)
    try:
        yield parts
    finally:
        _ACTIVE.reset(token)


_NOTHING = nullcontext()


def span(name: str | None):
    """Mark the enclosed code as part `name` of the phase being collected; outside a collection, or with no name,
    one shared do-nothing context (core attention asks on every call)."""
    parts = _ACTIVE.get()
    if parts is None or name is None:
        return _NOTHING
    return _Span(parts, name)


class _Span:
    """One recorded part: host seconds, and on CUDA (not while capturing a graph) its two timing events."""

    def __init__(self, parts: Parts, name: str) -> None:
        self.parts, self.name, self.events = parts, name, None

    def __enter__(self):
        if torch.cuda.is_available() and not torch.cuda.is_current_stream_capturing():
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        self.t0 = time.perf_counter()

    def __exit__(self, *exc) -> bool:
        if self.events is not None:
            self.events[1].record()
        self.parts.rows.append((self.name, time.perf_counter() - self.t0, self.events))
        return False
