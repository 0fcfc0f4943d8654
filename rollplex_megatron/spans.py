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
from contextlib import contextmanager
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
            row = out.setdefault(name, {"count": 0, "host_s": 0.0, "gpu_s": None})
            row["count"] += 1
            row["host_s"] += host
            if events is not None:
                events[1].synchronize()
                row["gpu_s"] = (row["gpu_s"] or 0.0) + events[0].elapsed_time(events[1]) / 1e3
        return out


def merge(into: dict[str, dict], more: dict[str, dict]) -> dict[str, dict]:
    """`more`'s parts added to `into`'s (a phase that runs more than once a step: one update per mini-batch)."""
    for name, row in more.items():
        acc = into.setdefault(name, {"count": 0, "host_s": 0.0, "gpu_s": None})
        acc["count"] += row["count"]
        acc["host_s"] += row["host_s"]
        if row["gpu_s"] is not None:
            acc["gpu_s"] = (acc["gpu_s"] or 0.0) + row["gpu_s"]
    return into


@contextmanager
def collect():
    """Record the parts marked in the enclosed code (this thread); yields the `Parts`."""
    parts = Parts()
    token = _ACTIVE.set(parts)
    try:
        yield parts
    finally:
        _ACTIVE.reset(token)


@contextmanager
def span(name: str | None):
    """Mark the enclosed code as part `name` of the phase being collected (nothing when none is, or with no
    name)."""
    parts = _ACTIVE.get()
    if parts is None or name is None:
        yield
        return
    events = None
    if torch.cuda.is_available() and not torch.cuda.is_current_stream_capturing():
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        events[0].record()
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if events is not None:
            events[1].record()
        parts.rows.append((name, time.perf_counter() - t0, events))
