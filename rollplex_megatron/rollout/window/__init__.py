"""The decode window: prefix-stage work queued by the trainer, run by the engine while it decodes.

Mechanisms (docs/design.md §6 says why none is free on an H200; `benchmarks/decode_window.py`
measures each):
- `interleave` (the no-overlap reference): after each decode step the hook runs up to
  `items_per_step` queued items on the decode stream;
- `after` (no window, the control): every item runs on the decode stream once decoding ends;
- `stream`: the same items launched on a low-priority side stream while decode runs on a
  high-priority stream, so the GPU may overlap them with the (CUDA-graph) decode steps. The items
  are issued by an issuer thread, not by the decode loop: one reference prefix item takes the host
  about twice as long to issue as its kernels run (`window_item_profile_3b.json`), so issuing it
  between decode steps stalls decode for that long. The decode thread only replays graphs and
  waits on the device, both with the GIL released; the switch interval is shortened while the
  issuer runs so the decode thread gets the GIL back promptly;
- `tail`: `stream`, but the issuer starts only once the active decode batch has shrunk to
  `tail_fraction` of the wave's samples (the long tail of response lengths, where decode leaves the
  most of the GPU idle); whatever is left runs when decoding ends;
- `green`: like `stream`, with the side stream on a green context that owns `green_sms` SMs of
  the device (driver API, disjoint from the rest; `rollout/green.py`). Decode keeps the whole device.
- `auto` (the default): the mechanism a measured table (`window_policy.json`, from the decode-window benchmark)
  says is fastest at the wave's batch size, `after` among the candidates, so never slower than no window there;
  `interleave` at tp or pp > 1 and on CPU (`policy.layout_mechanism`).
Whatever is left when decoding ends runs on the decode stream. Items that ran on a side stream are
joined to the decode stream (`on_idle`) before the engine returns, so their outputs are ready for
the phases after the rollout (the trainer also synchronises the device at phase boundaries, so
tensors an item allocated on the side stream are not reused early). An item runs under the grad
mode that was on when it was submitted (grad mode is per thread).
"""
from __future__ import annotations

import sys
import threading
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from rollplex_megatron.rollout.engine import DecodeHooks
from rollplex_megatron.rollout.window.mechanisms import MECHANISMS, WindowMechanism
from rollplex_megatron.rollout.window.policy import (POLICY_PATH, check_mechanism, choices, layout_mechanism,
                                                     policy_mechanism)

__all__ = ["DecodeWindow", "WorkItem", "WindowMechanism", "MECHANISMS", "choices", "POLICY_PATH",
           "check_mechanism", "layout_mechanism", "policy_mechanism"]


@dataclass
class WorkItem:
    """One unit of prefix work (e.g. the reference prefix stage of one group)."""

    name: str
    fn: Callable[[], Any]
    result: Any = None
    done: bool = False
    seconds: float = 0.0  # host seconds to issue (and, on the decode stream, to run) the item
    events: tuple | None = None  # CUDA: timing events around its work on the stream it ran on
    in_window: bool = False  # ran during decode (True) or after it (False)
    grad: bool = field(default_factory=torch.is_grad_enabled)  # grad mode at submit time
    job: Any = None  # the item as data (`jobs.PrefixJob`), for an engine that runs it in another process


@dataclass
class DecodeWindow(DecodeHooks):
    """DecodeHooks implementation that drains a work queue while the engine decodes; how items
    share the GPU is the mechanism's (`mechanisms.py`), which one runs is the policy's (`policy.py`)."""

    mechanism: str = "interleave"
    items_per_step: int = 1
    tail_fraction: float = 0.25  # tail: start side work when active <= this fraction of the wave
    green_sms: int = 32  # green: SMs of the side work's partition
    switch_interval_s: float = 1e-4  # GIL switch interval while the issuer thread runs
    policy_path: Path = POLICY_PATH  # the measured table `auto` reads
    queue: deque = field(default_factory=deque)
    finished: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.mechanism not in choices():
            raise ValueError(f"decode-window mechanism {self.mechanism!r} is not one of {choices()}")
        if not 0 < self.tail_fraction <= 1:
            raise ValueError(f"mode.window_tail_fraction must be in (0, 1], got {self.tail_fraction}")
        self._side = self._decode = None
        self._issuer: threading.Thread | None = None
        self._issuing = threading.Lock()  # held by the issuer per item, and by the engine while it captures
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._interval = 0.0  # the switch interval to restore when the issuer stops
        self._started = threading.Event()  # the issuer has taken its first item (or found none)
        self._wave_start = 0
        self._resolved = self.mechanism if self.mechanism != "auto" else None
        self._mech = MECHANISMS[self._resolved]() if self._resolved else None

    @classmethod
    def from_config(cls, mode, parallel, rollout_tp: int = 0) -> "DecodeWindow":
        """The window of a run: `mode.window*` settings at the run's parallel layout (a rollout at its
        own TP counts as TP > 1: its items' collectives must keep the decode thread's order)."""
        tp = max(parallel.tp, rollout_tp)
        mechanism = layout_mechanism(mode.window, tp, parallel.pp, torch.cuda.is_available())
        return cls(mechanism, mode.window_items_per_step, mode.window_tail_fraction, mode.window_green_sms)

    def submit(self, name: str, fn: Callable[[], Any], job: Any = None) -> WorkItem:
        """Queue `fn` (and its description as data, `job`); its result lands on the returned item."""
        item = WorkItem(name, fn, job=job)
        self.queue.append(item)
        return item

    def take_items(self) -> list[WorkItem]:
        """Hand the queue to an engine that runs the items in its own process (the SGLang bridge)."""
        items = list(self.queue)
        self.queue.clear()
        return items

    def ran_elsewhere(self, items: list[WorkItem]) -> None:
        """Those items are done (their results, times and in-window flags set by that engine)."""
        self.finished.extend(items)

    # --- streams -------------------------------------------------------------------------------
    def _streams(self):
        if self._side is None and torch.cuda.is_available() and self._mech is not None and self._mech.side:
            _, hi = torch.cuda.Stream.priority_range()
            self._decode = torch.cuda.Stream(priority=hi)
            self._side = self._mech.side_stream(self)
        return self._side

    def decode_stream(self):
        """The stream the engine decodes on (a high-priority one for side-stream mechanisms)."""
        self._streams()
        return self._decode

    def on_wave(self, samples: int) -> None:
        """Called when a wave starts decoding `samples` samples (resolves `auto`)."""
        self._wave_start = samples
        if self._mech is not None:
            self._mech.on_wave(self)
        if self._resolved is None:
            self._resolved, sms = policy_mechanism(samples, self.policy_path)
            self.green_sms = sms or self.green_sms
            self._mech = MECHANISMS[self._resolved]()

    # --- hooks ---------------------------------------------------------------------------------
    def _run(self, item: WorkItem, in_window: bool, side: bool) -> None:
        t0 = time.perf_counter()
        if side and self._side is not None:
            ctx = torch.cuda.stream(self._side)
        else:
            ctx = nullcontext()
        timed = torch.cuda.is_available()
        with ctx, torch.set_grad_enabled(item.grad):
            if timed:  # on the stream the item runs on (the side stream, or the decode stream)
                item.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                item.events[0].record()
            item.result = item.fn()
            if timed:
                item.events[1].record()
        item.seconds, item.done, item.in_window = time.perf_counter() - t0, True, in_window
        self.finished.append(item)

    def _issue(self, device) -> None:
        """Issuer thread: run queued items on the side stream until the queue is empty or decode ends."""
        try:
            if device is not None:
                torch.cuda.set_device(device)
            while True:
                with self._issuing:
                    if self._stop.is_set() and self._started.is_set():
                        return
                    try:
                        item = self.queue.popleft()
                    except IndexError:
                        return
                    finally:
                        self._started.set()
                    self._run(item, True, True)
        except BaseException as e:  # re-raised on the decode thread (next step, or on_idle)
            self._error = e
        finally:
            self._started.set()

    def _start_issuer(self) -> None:
        side = self._streams()
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())  # the items' inputs were written before decode
        device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self._interval = sys.getswitchinterval()
        sys.setswitchinterval(self.switch_interval_s)
        self._issuer = threading.Thread(target=self._issue, args=(device,), name="decode-window-issuer", daemon=True)
        self._issuer.start()

    def capture_guard(self):
        """Held while the engine captures a decode graph: the issuer finishes issuing its current
        item and starts no other, so no other thread makes CUDA calls during the capture."""
        return self._issuing

    def on_decode_step(self, step: int, active: int) -> None:
        """interleave: run up to `items_per_step` items now; side mechanisms: start the issuer thread (each
        when the mechanism's `may_start` allows)."""
        self._raise_issuer_error()
        if active == 0 or not self.queue:
            return
        if self._mech is not None and self._mech.side:
            if self._issuer is None and self._mech.may_start(self, active):
                self._start_issuer()
            return
        if self._mech is not None and not self._mech.may_start(self, active):
            return
        for _ in range(self.items_per_step):
            if not self.queue:
                return
            self._run(self.queue.popleft(), True, False)

    def _raise_issuer_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            self.abort()
            raise RuntimeError(f"a decode-window item failed on the issuer thread: {type(err).__name__}: "
                               f"{err}") from err

    def abort(self) -> None:
        """Stop and join the issuer thread, restoring the switch interval (also when decode fails)."""
        if self._issuer is not None:
            self._stop.set()
            self._issuer.join()
            sys.setswitchinterval(self._interval)
            self._issuer = None
            self._stop.clear()
            self._started.clear()

    def on_idle(self) -> None:
        """Decode is over: stop and join the issuer (once it has taken its first item, so an issuer
        that was started always runs one item in the window), run every item still queued, join
        the side stream."""
        if self._issuer is not None:
            self._started.wait()
        self.abort()
        self._raise_issuer_error()
        if self._side is not None:  # items left run after those issued on the side stream, not beside them (a
            torch.cuda.current_stream().wait_stream(self._side)  # graphed item's replays share its input tensors)
        while self.queue:
            self._run(self.queue.popleft(), False, False)

    def stats(self) -> dict:
        """Items and host seconds spent inside and after the decode window; on CUDA also each part's GPU span
        (`*_gpu_s`: from an item's first to its last work on its stream, summed; beside decode on a side stream
        it includes waiting for the SMs decode holds), so a host-bound item shows as host seconds > GPU span."""
        inside = [i for i in self.finished if i.in_window]
        after = [i for i in self.finished if not i.in_window]
        out = {"window_mechanism": self._resolved or self.mechanism, "items_in_window": len(inside),
               "items_after": len(after), "window_s": sum(i.seconds for i in inside),
               "after_s": sum(i.seconds for i in after)}
        if any(i.events for i in self.finished):
            out["window_gpu_s"], out["after_gpu_s"] = (_gpu_span(inside), _gpu_span(after))
        return out


def _gpu_span(items: list[WorkItem]) -> float:
    """Seconds between each item's timing events, summed (waits for them: the items ran before the rollout
    returned)."""
    total = 0.0
    for i in items:
        if i.events:
            i.events[1].synchronize()
            total += i.events[0].elapsed_time(i.events[1]) / 1e3
    return total
