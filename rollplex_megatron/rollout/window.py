"""The decode window: prefix-stage work queued by the trainer, run by the engine while it decodes.

Mechanism `interleave` (the no-overlap reference): after each decode step the engine's hook runs
up to `items_per_step` queued items on the decode stream; whatever is left runs when decoding ends.
The other mechanisms of DESIGN section 6 (second stream, green-context SM partitions, long-tail
widening) plug in behind the same hooks once measured; the config accepts only what exists.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class WorkItem:
    """One unit of prefix work (e.g. the reference prefix stage of one group)."""

    name: str
    fn: Callable[[], Any]
    result: Any = None
    done: bool = False
    seconds: float = 0.0
    in_window: bool = False  # ran during decode (True) or after it (False)


@dataclass
class DecodeWindow:
    """DecodeHooks implementation that drains a work queue between decode steps."""

    mechanism: str = "interleave"
    items_per_step: int = 1
    queue: deque = field(default_factory=deque)
    finished: list = field(default_factory=list)

    def __post_init__(self) -> None:
        from rollplex_megatron.config import WINDOW_MECHANISMS

        if self.mechanism not in WINDOW_MECHANISMS:
            raise ValueError(f"decode-window mechanism {self.mechanism!r} is not implemented {WINDOW_MECHANISMS}")

    def submit(self, name: str, fn: Callable[[], Any]) -> WorkItem:
        """Queue `fn`; its result lands on the returned item."""
        item = WorkItem(name, fn)
        self.queue.append(item)
        return item

    def _run(self, item: WorkItem, in_window: bool) -> None:
        t0 = time.perf_counter()
        item.result = item.fn()
        item.seconds, item.done, item.in_window = time.perf_counter() - t0, True, in_window
        self.finished.append(item)

    def on_decode_step(self, step: int, active: int) -> None:
        """Run up to `items_per_step` items while samples are still decoding."""
        for _ in range(self.items_per_step):
            if not self.queue or active == 0:
                return
            self._run(self.queue.popleft(), True)

    def on_idle(self) -> None:
        """Run every item still queued (decode is over)."""
        while self.queue:
            self._run(self.queue.popleft(), False)

    def stats(self) -> dict:
        """Items and seconds spent inside and after the decode window."""
        inside = [i for i in self.finished if i.in_window]
        after = [i for i in self.finished if not i.in_window]
        return {"items_in_window": len(inside), "items_after": len(after),
                "window_s": sum(i.seconds for i in inside), "after_s": sum(i.seconds for i in after)}
