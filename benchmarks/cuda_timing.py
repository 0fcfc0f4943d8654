"""What the kernel benchmarks share: one call timed with CUDA events, and the result JSON written beside its
command, settings and environment record."""
from __future__ import annotations

import json
import statistics
import sys

import torch


def time_call(call, repeats: int, warmup: int, prepare=tuple) -> dict:
    """`call(*prepare())` after `warmup` untimed calls: median / min / max milliseconds between CUDA events around
    each call (`prepare` runs outside them), and the peak memory allocated during the repeats above what was
    allocated before them."""
    for _ in range(warmup):
        call(*prepare())
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        args = prepare()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        call(*args)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
            "peak_above_inputs_gib": (torch.cuda.max_memory_allocated() - base) / 2**30}


def write_result(out: str, rows: list, settings: dict) -> dict:
    """The benchmark's JSON (`out`; empty: not written): its command, rows, settings and environment."""
    from rollplex_megatron.runtime import environment_record

    res = {"command": "python " + " ".join(sys.argv), "rows": rows, "settings": settings,
           "environment": environment_record()}
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=2)
    return res
