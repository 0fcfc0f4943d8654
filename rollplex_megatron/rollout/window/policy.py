"""The one place where the decode-window mechanism is decided: `auto` from the measured table
(`window_policy.json`, written by the decode-window benchmark) and the parallel-layout limits."""
from __future__ import annotations

import json
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


def layout_mechanism(name: str, tp: int, pp: int) -> str:
    """The mechanism a run at (tp, pp) uses for `mode.window`: `auto` is `interleave` at tp or
    pp > 1 (side work needs tp=pp=1), else left for the measured table at each wave."""
    check_mechanism(name, tp, pp)
    return "interleave" if name == "auto" and (tp > 1 or pp > 1) else name


def policy_mechanism(batch: int, path: Path = POLICY_PATH) -> tuple[str, int]:
    """The measured table's (mechanism, green SMs) for a decode batch of `batch` samples: the winner
    measured at the nearest batch size, its partition size with it; ("interleave", 0) if none won."""
    if not path.is_file():
        return "interleave", 0
    table = json.loads(path.read_text())
    rows = [r for r in table.get("winners", []) if r["mechanism"] != "interleave"]
    if not rows:
        return "interleave", 0
    best = min(rows, key=lambda r: (abs(r["batch"] - batch), -r.get("hidden", 0.0)))
    return best["mechanism"], int(best.get("green_sms", 0))
