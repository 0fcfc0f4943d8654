"""Decode-window mechanisms: how queued prefix work shares the GPU with decode (docs/design.md §6).

A mechanism decides where items run (the decode stream between steps, or a side stream fed by an
issuer thread), on which side stream, and when the issuer may start. A new mechanism is one class
here (or in its own file) plus one line in `MECHANISMS`.
"""
from __future__ import annotations

import torch

from rollplex_megatron.rollout.green import green_stream


class WindowMechanism:
    """The contract; the base is the no-overlap reference (`interleave`)."""

    name = "interleave"
    side = False  # items are issued on a side stream by the issuer thread (else: on the decode thread)

    def side_stream(self, window):
        """The stream side work runs on (CUDA only; None: no side stream)."""
        return None

    def may_start(self, window, active: int) -> bool:
        """Whether items may start now, with `active` samples still decoding (side mechanisms: the issuer
        thread; else: the next items on the decode thread). Items left when decoding ends run then."""
        return True

    def on_wave(self, window) -> None:
        """A new wave starts decoding."""


class Interleave(WindowMechanism):
    """After each decode step, up to `items_per_step` queued items run on the decode stream."""


class After(WindowMechanism):
    """No window: every item runs on the decode stream once decoding ends (still inside the rollout phase).
    The control beside the others: the rollplex step with its prefix work in series, all else equal."""

    name = "after"

    def may_start(self, window, active: int) -> bool:  # noqa: D102
        return False


class Stream(WindowMechanism):
    """Items on a low-priority side stream, issued by an issuer thread while decode runs on a
    high-priority stream (the GPU may overlap them with the CUDA-graph decode steps)."""

    name, side = "stream", True

    def side_stream(self, window):  # noqa: D102
        lo, _ = torch.cuda.Stream.priority_range()
        return torch.cuda.Stream(priority=lo)


class Tail(Stream):
    """`stream`, started once the active batch has shrunk to `tail_fraction` of the wave."""

    name = "tail"

    def may_start(self, window, active: int) -> bool:  # noqa: D102
        return active <= window.tail_fraction * max(window._wave_start, 1)

    def on_wave(self, window) -> None:  # noqa: D102
        window.abort()  # a new wave starts at full batch: tail work waits for this wave's tail again


class Green(Stream):
    """`stream` with the side stream on a green context owning `green_sms` SMs (driver API)."""

    name = "green"

    def side_stream(self, window):  # noqa: D102
        return green_stream(window.green_sms)


MECHANISMS: dict[str, type[WindowMechanism]] = {m.name: m for m in (Interleave, After, Stream, Tail, Green)}
