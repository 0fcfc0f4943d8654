"""The compute stream's wait at rollplex's rollout entry under `memory.copy_streams` 1 and 2: the manager offloads
`--main-gib` of fp32 masters (device to host) and prefetches `--ref-gib` of bf16 reference (host to device) in one
`enter("rollout")`; the wait is the CUDA-event time on the compute stream from before the entry to a kernel queued
right after it. At 3B the entry moves about 45 GB out and 7.5 GB in (Adam states and masters out, the reference in).
A last row times a tiny kernel issued after an unrelated copy (does the compute stream wait for a copy it does
not depend on? `benchmarks/gpu_memory_streams.sh` runs this file with and without CUDA_DEVICE_MAX_CONNECTIONS=1).
GPU only; one JSON (`--out`), whose environment record holds the CUDA variables it ran under."""
import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.cuda_timing import write_result  # noqa: E402
from tests.memory_streams_case import manager  # noqa: E402


def entry_wait_ms(copy_streams: int, main_gib: float, ref_gib: float, repeats: int) -> dict:
    mm, main, ref = manager(copy_streams, main_gib, ref_gib)
    mm.enter("optimizer")  # the reference's first offload; the masters stay
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats + 1):  # the first cycle is left out (the masters' host buffers are pinned there)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        mm.enter("rollout")
        ref[0].add_(0)  # the first use of the reference on the compute stream
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
        mm.enter("optimizer")
        torch.cuda.synchronize()
    del mm, main, ref
    torch.cuda.empty_cache()
    steady = times[1:]
    return {"copy_streams": copy_streams, "main_gib": main_gib, "ref_gib": ref_gib, "first_ms": times[0],
            "median_ms": statistics.median(steady), "min_ms": min(steady), "max_ms": max(steady)}


def unrelated_wait_ms(gib: float, repeats: int) -> dict:
    """A device-to-host copy of `gib` on a stream of its own, then one tiny kernel on the compute stream that
    depends on nothing: the compute stream's time from before the copy was issued to the kernel's end, against
    the copy's own time. Near zero when the streams run side by side; about the copy's time when the hardware
    queue they share makes the kernel wait (CUDA_DEVICE_MAX_CONNECTIONS=1)."""
    n = int(gib * 2**30)
    src, dst = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, pin_memory=True)
    side, y = torch.cuda.Stream(), torch.zeros(1, device="cuda")
    compute, copy = [], []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        a, b, c0, c1 = (torch.cuda.Event(enable_timing=True) for _ in range(4))
        a.record()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            c0.record(side)
            dst.copy_(src, non_blocking=True)
            c1.record(side)
        y.add_(1)
        b.record()
        torch.cuda.synchronize()
        compute.append(a.elapsed_time(b))
        copy.append(c0.elapsed_time(c1))
    return {"what": "a tiny kernel issued after an unrelated device-to-host copy", "gib": gib,
            "compute_stream_ms": statistics.median(compute[1:]), "copy_ms": statistics.median(copy[1:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--main-gib", type=float, default=16.0)
    ap.add_argument("--ref-gib", type=float, default=4.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    rows = [entry_wait_ms(n, a.main_gib, a.ref_gib, a.repeats) for n in (1, 2)]
    rows.append({"one_over_two": rows[0]["median_ms"] / rows[1]["median_ms"]})
    rows.append(unrelated_wait_ms(a.main_gib, a.repeats))
    res = write_result(a.out, rows, vars(a))
    print(res["rows"])


if __name__ == "__main__":
    main()
