"""Several test cases in one spawned job: each process start (spawn, imports, model build) costs seconds
on CPU, so cases that need the same layout and patch nothing run one after another in one `run_local`
job, each on its own fresh objects, and every test reads its own case's result (or its error)."""
from __future__ import annotations

import traceback


def in_turn(calls: dict, catch: bool = True) -> dict:
    """`{key: (fn, args)}`: each `fn(*args)` in this process, in order; per key `{"value": ...}` or, if it
    raised, `{"error": traceback}` (the other cases still run, as they would in jobs of their own).
    `catch=False` for jobs of several ranks: a case failing on one rank fails the job (the other ranks may
    wait in that case's collectives), as a job of its own would."""
    out = {}
    for key, (fn, args) in calls.items():
        try:
            out[key] = {"value": fn(*args)}
        except Exception:  # noqa: BLE001 - reported by `case` in the test that reads it
            if not catch:
                raise
            out[key] = {"error": traceback.format_exc()}
    return out


def case(results: dict, key):
    """One case's result from `in_turn`'s; its error fails the test that reads it, with the traceback."""
    r = results[key]
    if "error" in r:
        raise AssertionError(f"case {key!r} failed in its job:\n{r['error']}")
    return r["value"]


def cases(per_rank: list[dict], key) -> list:
    """`case` on every rank's results (a job of several ranks)."""
    return [case(r, key) for r in per_rank]
