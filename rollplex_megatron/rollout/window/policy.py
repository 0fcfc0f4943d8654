"""The one place where the decode-window mechanism is decided: `auto` from the measured table
(`window_policy.json`, built by `window-policy` from a decode-window benchmark JSON) and the
parallel-layout limits. The table judges mechanisms by the wall time of decode plus its side work
(docs/design.md §2: the mechanism that makes the step shortest wins), not by a hidden-share /
slowdown pair; `after` (no window: decode, then the items) is among the candidates and is the reference a
window must beat, so `auto` is never slower than no window where the table measured it."""
from __future__ import annotations

import json
import math
from pathlib import Path

from rollplex_megatron.rollout.window.mechanisms import MECHANISMS

POLICY_PATH = Path(__file__).with_name("window_policy.json")


def choices() -> tuple[str, ...]:
    """The values `mode.window` accepts: the registered mechanisms and `auto`."""
    return tuple(MECHANISMS) + ("auto",)


def check_mechanism(name: str, tp: int, pp: int) -> None:
    """`mode.window` is known, and side-work mechanisms run only at tp=pp=1."""
    if name not in choices():
        raise ValueError(f"mode.window must be one of {choices()}, got {name!r}")
    if name != "auto" and MECHANISMS[name].side and (tp > 1 or pp > 1):
        raise ValueError(f"mode.window={name} runs side work on another thread and CUDA stream, whose TP "
                         f"collectives and pipeline sends could interleave with the decode's in a different order "
                         f"on each rank; it needs parallel.tp=1 and parallel.pp=1 (got tp={tp}, pp={pp}); use "
                         f"mode.window=interleave")


def layout_mechanism(name: str, tp: int, pp: int, cuda: bool = True) -> str:
    """The mechanism a run at (tp, pp) uses for `mode.window`: `auto` is `interleave` at tp or pp > 1 (side work
    needs tp=pp=1, and the table measured one rank) and without CUDA (the table measured a GPU; a CPU run keeps
    the window it always had), else left for the measured table at each wave."""
    check_mechanism(name, tp, pp)
    return "interleave" if name == "auto" and (tp > 1 or pp > 1 or not cuda) else name


MARGIN = 0.02  # a mechanism must beat after's wall time (no window) by this share to be chosen (run-to-run noise)


def build_policy(bench: dict, source: str, margin: float = MARGIN) -> dict:
    """The table `auto` reads, from a decode-window benchmark JSON: per case (decode batch and workload
    shape), the wall time of decode plus its side work under each mechanism, `after` (no window) among them,
    and the winner: the fastest, if it beats `after` by more than `margin`, else `after`. A case that did
    not run `after` has its time as what `after` runs: decode alone, then the items alone. Raises ValueError on a
    JSON without rows or with a wall time that is not a positive number."""
    env = bench.get("environment", {})
    if not bench["rows"]:
        raise ValueError(f"window-policy: {source} has no rows (no case ran); a table from it would choose nothing")
    rows = []
    for r in bench["rows"]:
        walls = {spec: m["after_prefill_s"] for spec, m in r["mechanisms"].items() if "after_prefill_s" in m}
        walls.setdefault("after", r["decode_alone"]["after_prefill_s"] + r["items_alone_s"])
        bad = {k: v for k, v in walls.items()
               if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0}
        if bad:
            raise ValueError(f"window-policy: {source}, case {r['case']!r}: wall times must be positive seconds, got "
                             f"{bad}; rerun the benchmark for that case")
        for spec in walls:
            mech, _, sms = spec.partition(":")
            if mech not in MECHANISMS or (sms and (mech != "green" or not sms.isdigit())):
                raise ValueError(f"window-policy: {source}, case {r['case']!r}: {spec!r} is not a mechanism (one of "
                                 f"{sorted(MECHANISMS)}, green as green:SMS); rerun benchmarks/decode_window.py")
        best = min(walls, key=walls.get)
        win = best if walls[best] < (1 - margin) * walls["after"] else "after"
        mech, _, sms = win.partition(":")
        rows.append({"case": r["case"], "shape": r["case"].split("_")[0], "batch": r["batch"],
                     "wall_s": walls, "decode_alone_s": r["decode_alone"]["after_prefill_s"],
                     "items_alone_s": r["items_alone_s"], "mechanism": mech, "green_sms": int(sms or 0),
                     "gain_vs_after": 1 - walls[win] / walls["after"]})
    return {"source": source, "commit": env.get("commit", ""), "date": env.get("date", ""),
            "device": env.get("device", env.get("gpu", "")), "margin": margin,
            "rule": "per case, the mechanism with the shortest wall time of decode plus side work (graph captures "
                    "included), if it beats after (no window; unless measured, decode alone plus the items alone) "
                    "by more than `margin`, else after; mode.window=auto takes the row of the nearest decode batch "
                    "(of the workload shape, when given)",
            "rows": rows}


def policy_mechanism(batch: int, path: Path = POLICY_PATH, shape: str = "") -> tuple[str, int]:
    """The measured table's (mechanism, green SMs) for a decode batch of `batch` samples: the winner of the
    row at the nearest batch size (of `shape`, e.g. uniform or longtail, when the table has it), the larger gain
    over `after` between two as near; ("interleave", 0) without a table."""
    if not path.is_file():
        return "interleave", 0
    rows = json.loads(path.read_text()).get("rows", [])
    if shape:
        rows = [r for r in rows if r.get("shape") == shape] or rows
    if not rows:
        return "interleave", 0
    best = min(rows, key=lambda r: (abs(r["batch"] - batch), -r.get("gain_vs_after", r.get("gain_vs_interleave", 0.0))))
    return best["mechanism"], int(best.get("green_sms", 0))
