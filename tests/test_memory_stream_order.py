"""The memory manager's copy streams under simulated CUDA ordering (tests/stream_order.py): over the trainer's phase
sequence in every mode, with one and two copy streams, classes brought back ahead, several mini-batches a step, Adam's
states created late and a checkpoint's restore, no copy, free or read can race; and each of the manager's ordering
calls, dropped, is caught (the CPU path runs its copies synchronously, so only this can fail on an ordering error)."""
import itertools

import pytest

from rollplex_megatron.memory.auto import AHEAD_CLASSES, phase_before
from tests.stream_order import Sim, patched, trainer_steps

MODES = ("serial", "prefix_shared", "rollplex")


def _aheads(mode):
    every = {name: phase_before(name, mode) for name in AHEAD_CLASSES}
    return [None, {"reference_weights": every["reference_weights"]}, every]


def _cases():
    for mode, copy_streams, minis, (lazy, sync, ckpt, extras) in itertools.product(
            MODES, (1, 2), (1, 3), [(True, False, False, False), (False, True, True, False), (True, False, True, True),
                                    (False, False, False, True)]):
        for ahead in _aheads(mode):
            yield mode, ahead, copy_streams, minis, lazy, sync, ckpt, extras


def _run(monkeypatch, drop=frozenset(), cases=None):
    """[(case, hazards)] for the cases that have any."""
    found = []
    for case in cases or list(_cases()):
        sim = Sim(frozenset(drop))
        with monkeypatch.context() as m:
            patched(m, sim)
            hazards = trainer_steps(sim, *case)
        if hazards:
            found.append((case, hazards))
    return found


def test_no_copy_free_or_read_can_race(monkeypatch):
    found = _run(monkeypatch)
    assert not found, found[0]


@pytest.mark.parametrize("drop", ["record_stream", "compute_wait_event", "copy_wait_event", "copy_wait_stream"])
def test_each_ordering_call_dropped_is_caught(monkeypatch, drop):
    """record_stream at the offload; the compute stream's wait for a copy in; a copy's wait for its class's
    previous copy; a copy's wait for the compute stream's earlier work."""
    found = _run(monkeypatch, {drop})
    assert found, drop
