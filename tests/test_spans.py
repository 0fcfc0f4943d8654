"""Named parts of a phase (`rollplex_megatron/spans.py`): recorded only inside a phase, each where its work runs."""
import threading

import pytest

from rollplex_megatron import spans

TOP = {"memory", "prefix_forward", "schedule", "prefix_recompute", "prefix_backward", "finalize_grads",
       "optimizer_step"}  # the parts not nested in another ("forward" and "loss" run inside "schedule", "attention"
# inside forwards)


def test_parts_are_recorded_inside_a_collection_only_and_per_thread():
    with spans.span("outside"):
        pass
    seen = {}

    def other_thread():
        with spans.span("issuer"):  # a thread of its own has no collection (the decode window's issuer)
            seen["ran"] = True

    with spans.collect() as parts:
        with spans.span("a"):
            with spans.span("b"):
                t = threading.Thread(target=other_thread)
                t.start()
                t.join()
        with spans.span("b"):
            pass
    with spans.span("after"):
        pass
    got = parts.summary()
    assert seen["ran"] and set(got) == {"a", "b"}
    assert got["a"]["count"] == 1 and got["b"]["count"] == 2 and got["a"]["gpu_s"] is None  # no CUDA here
    assert got["a"]["host_s"] >= got["b"]["host_s"] / 2 >= 0
    total = spans.merge(spans.merge({}, got), got)
    assert total["b"]["count"] == 4 and total["a"]["host_s"] == pytest.approx(2 * got["a"]["host_s"])


def _check_records(run, groups: int, prefix: bool):
    for rec in run["records"]:
        parts, times = rec["phase_parts"], rec["phase_times"]
        assert set(parts) == set(times)  # every phase has its parts, and no parts lie outside a phase
        for phase, rows in parts.items():
            top = sum(r["host_s"] for n, r in rows.items() if n in TOP)
            assert 0 < top <= times[phase], (phase, rows, times[phase])  # inside the phase's own wall time
            assert rows["memory"]["count"] == 1  # the residency actions at its entry
            assert set(rows) <= TOP | {"forward", "loss", "attention"}, rows
        upd, opt = parts["update"], parts["optimizer"]
        assert set(opt) == {"memory", "optimizer_step"}  # the optimizer step is not in the update, and back
        assert upd["forward"]["count"] == upd["loss"]["count"] == len(run["micro_batches"][-1])
        assert upd["schedule"]["count"] == 1 and upd["finalize_grads"]["count"] == 1
        assert upd["schedule"]["host_s"] >= upd["forward"]["host_s"] + upd["loss"]["host_s"]
        layers, blocks = 4, 4  # the tiny model's LLM layers and vision blocks
        inner = upd["schedule"]["host_s"] + upd.get("prefix_recompute", {}).get("host_s", 0)
        assert upd["attention"]["host_s"] < inner
        ro = parts["rollout"]  # the prefills' attention (LLM and vision) only: decode steps record none
        assert ro["attention"]["count"] == (layers + blocks) * ro["prefix_forward"]["count"]
        # the response stage's forwards (LLM layers; serial's full sequences also run the vision tower), and each
        # recomputed prefix (LLM and vision)
        recomputed = upd.get("prefix_recompute", {}).get("count", 0)
        per_forward = layers if prefix else layers + blocks
        assert upd["attention"]["count"] == per_forward * upd["forward"]["count"] + (layers + blocks) * recomputed
        if prefix:  # one prefix backward per group, each through its recomputed forward (memory.plan=phase)
            assert upd["prefix_backward"]["count"] == upd["prefix_recompute"]["count"] == groups
            assert parts["rollout"]["prefix_forward"]["count"] >= groups  # the actor prefill (and window items)
        else:
            assert not {"prefix_backward", "prefix_recompute", "prefix_forward"} & set(upd)


def test_trainer_records_each_phase_parts(serial_run, rollplex_run):
    """The trainer tests' serial and rollplex runs (3 steps each, 8 groups a step): each phase's parts."""
    _check_records(serial_run, 8, prefix=False)
    _check_records(rollplex_run, 8, prefix=True)
