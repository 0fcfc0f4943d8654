"""The decode window: prefix-stage work queued by the trainer, run by the engine while it decodes.

Mechanisms (DESIGN section 6 says why none is free on an H200; `benchmarks/decode_window.py`
measures each):
- `interleave` (the no-overlap reference): after each decode step the hook runs up to
  `items_per_step` queued items on the decode stream;
- `stream`: the same items launched on a low-priority side stream while decode runs on a
  high-priority stream, so the GPU may overlap them with the (CUDA-graph) decode steps;
- `tail`: `stream`, but items start only once the active decode batch has shrunk to
  `tail_fraction` of the wave's samples (the long tail of response lengths, where decode leaves the
  most of the GPU idle); whatever is left runs when decoding ends;
- `green`: like `stream`, with the side stream on a green context that owns `green_sms` SMs of
  the device (driver API, disjoint from the rest; `rollout/green.py`). Decode keeps the whole device.
- `auto`: the mechanism a measured table (`window_policy.json`, from the decode-window benchmark)
  says meets the targets at the wave's batch size; `interleave` where nothing does.
Whatever is left when decoding ends runs on the decode stream. Items that ran on a side stream are
joined to the decode stream (`on_idle`) before the engine returns, so their outputs are ready for
the phases after the rollout (the trainer also synchronises the device at phase boundaries, so
tensors an item allocated on the side stream are not reused early).
"""
from __future__ import annotations

import json
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

POLICY_PATH = Path(__file__).with_name("window_policy.json")


@dataclass
class WorkItem:
    """One unit of prefix work (e.g. the reference prefix stage of one group)."""

    name: str
    fn: Callable[[], Any]
    result: Any = None
    done: bool = False
    seconds: float = 0.0  # host seconds to issue (and, on the decode stream, to run) the item
    in_window: bool = False  # ran during decode (True) or after it (False)


def policy_mechanism(batch: int, path: Path = POLICY_PATH) -> str:
    """The measured table's mechanism for a decode batch of `batch` samples (interleave if none wins)."""
    if not path.is_file():
        return "interleave"
    table = json.loads(path.read_text())
    rows = [r for r in table.get("winners", []) if r["mechanism"] != "interleave"]
    if not rows:
        return "interleave"
    best = min(rows, key=lambda r: abs(r["batch"] - batch))
    return best["mechanism"]


@dataclass
class DecodeWindow:
    """DecodeHooks implementation that drains a work queue while the engine decodes."""

    mechanism: str = "interleave"
    items_per_step: int = 1
    tail_fraction: float = 0.25  # tail: start side work when active <= this fraction of the wave
    green_sms: int = 32  # green: SMs of the side work's partition
    queue: deque = field(default_factory=deque)
    finished: list = field(default_factory=list)

    def __post_init__(self) -> None:
        from rollplex_megatron.config import WINDOW_MECHANISMS

        if self.mechanism not in WINDOW_MECHANISMS:
            raise ValueError(f"decode-window mechanism {self.mechanism!r} is not one of {WINDOW_MECHANISMS}")
        if not 0 < self.tail_fraction <= 1:
            raise ValueError(f"mode.window_tail_fraction must be in (0, 1], got {self.tail_fraction}")
        self._side = self._decode = None
        self._wave_start = 0
        self._resolved = self.mechanism if self.mechanism != "auto" else None

    def submit(self, name: str, fn: Callable[[], Any]) -> WorkItem:
        """Queue `fn`; its result lands on the returned item."""
        item = WorkItem(name, fn)
        self.queue.append(item)
        return item

    # --- streams -------------------------------------------------------------------------------
    def _streams(self):
        if self._side is None and torch.cuda.is_available() and self._resolved in ("stream", "tail", "green"):
            lo, hi = torch.cuda.Stream.priority_range() if hasattr(torch.cuda.Stream, "priority_range") else (0, -1)
            self._decode = torch.cuda.Stream(priority=hi)
            if self._resolved == "green":
                from rollplex_megatron.rollout.green import green_stream

                self._side = green_stream(self.green_sms)
            else:
                self._side = torch.cuda.Stream(priority=lo)
        return self._side

    def decode_stream(self):
        """The stream the engine decodes on (a high-priority one for side-stream mechanisms)."""
        self._streams()
        return self._decode

    def on_wave(self, samples: int) -> None:
        """Called when a wave starts decoding `samples` samples (resolves `auto`)."""
        self._wave_start = samples
        if self._resolved is None:
            self._resolved = policy_mechanism(samples)

    # --- hooks ---------------------------------------------------------------------------------
    def _run(self, item: WorkItem, in_window: bool, side: bool) -> None:
        t0 = time.perf_counter()
        if side and self._side is not None:
            self._side.wait_stream(torch.cuda.current_stream())  # inputs written before the item
            ctx = torch.cuda.stream(self._side)
        else:
            ctx = nullcontext()
        with ctx:
            item.result = item.fn()
        item.seconds, item.done, item.in_window = time.perf_counter() - t0, True, in_window
        self.finished.append(item)

    def on_decode_step(self, step: int, active: int) -> None:
        """Run up to `items_per_step` items while samples are still decoding."""
        mech = self._resolved or "interleave"
        if mech == "tail" and active > self.tail_fraction * max(self._wave_start, 1):
            return
        side = mech in ("stream", "tail", "green")
        for _ in range(self.items_per_step):
            if not self.queue or active == 0:
                return
            self._run(self.queue.popleft(), True, side)

    def on_idle(self) -> None:
        """Run every item still queued (decode is over) and join the side stream."""
        while self.queue:
            self._run(self.queue.popleft(), False, False)
        if self._side is not None:
            torch.cuda.current_stream().wait_stream(self._side)

    def stats(self) -> dict:
        """Items and host seconds spent inside and after the decode window."""
        inside = [i for i in self.finished if i.in_window]
        after = [i for i in self.finished if not i.in_window]
        return {"window_mechanism": self._resolved or self.mechanism, "items_in_window": len(inside),
                "items_after": len(after), "window_s": sum(i.seconds for i in inside),
                "after_s": sum(i.seconds for i in after)}
