"""Probe (GPU): a decode-window item as a CUDA graph: does it capture, what does a replay cost, is it exact?

The item is one group's reference prefix stage at 3B (random weights, bf16): the vision tower on a video of
`--grid` patches plus the LLM prefix forward that records each layer's K/V (`PrefixContext(mode="record")`),
as the window runs it (the prompt's ids and pixels on the device, its grid on the host). Measured, eager: the
host time until the call returns, the GPU time (CUDA events), the kernel count (torch.profiler) and where the
item makes the host wait for the device (torch's sync debug mode: each such place breaks a capture). Then the
window's graphed items (`prefix/graphs.py`, mode.window_graphs): the first item of a bucket runs eagerly and is
captured; a replay's host and GPU time; and the K/V of replays against eager forwards, which must be equal (same
kernels, same shapes): the captured prompt, another prompt of the bucket, and a pack of two groups captured on
one pair of prompts and replayed on another. A capture that fails records the exception and the traceback's
tail. One JSON to --out.

    python -m torch.distributed.run --nproc_per_node 1 benchmarks/window_item_graph_probe.py --out probe.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import traceback

import torch


def timed(fn, reps: int) -> dict:
    """Medians over `reps` calls of `fn`: host seconds until it returns, and GPU seconds between CUDA events
    around it (the device synchronised after each call)."""
    torch.cuda.synchronize()
    host, gpu = [], []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
        e1.record()
        torch.cuda.synchronize()
        gpu.append(e0.elapsed_time(e1) / 1e3)
    return {"host_s_median": statistics.median(host), "gpu_s_median": statistics.median(gpu)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2_5_vl_3b")
    ap.add_argument("--grid", default="4,32,32", help="video grid t,h,w (4,32,32: the video_long suite's 8 frames)")
    ap.add_argument("--text-tokens", type=int, default=15)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("window_item_graph_probe: needs a CUDA device (it captures CUDA graphs)", file=sys.stderr)
        return 2

    sys.path.insert(0, "benchmarks")
    from decode_vs_hf import cuda_kernels, prompts, random_model
    from torch.profiler import ProfilerActivity, profile

    from rollplex_megatron.attention.kv_store import KVStore
    from rollplex_megatron.attention.prefix import PrefixContext
    from rollplex_megatron.prefix.execution import unwrap
    from rollplex_megatron.prefix.graphs import PrefixGraphs
    from rollplex_megatron.trainer.modes import rollplex as X
    from rollplex_megatron.runtime import environment_record

    cfg, model, _ = random_model(a.preset)
    m, dev = unwrap(model), torch.device("cuda")
    ps_ = prompts(cfg, 3, tuple(int(x) for x in a.grid.split(",")), a.text_tokens)
    # as the window holds a prompt: pixels on the device; ids and grid on the host (the stage moves the ids
    # over itself and reads only host values: the placeholder check, the vision tower's window plan)
    ps_ = [dataclasses.replace(p, pixel_values_videos=p.pixel_values_videos.to(dev, torch.bfloat16)) for p in ps_]
    p = ps_[0]

    def item(store: KVStore):
        with torch.no_grad():
            return m.prefix_stage([p], PrefixContext(mode="record", store=store, group=0, keep_graph=False), None)

    for _ in range(3):
        item(KVStore())
    eager_times = timed(lambda: item(KVStore()), a.reps)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        item(KVStore())
        torch.cuda.synchronize()
    kernels = cuda_kernels(prof)
    syncs = []  # where the eager item makes the host wait for the device (each one breaks a capture)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            item(KVStore())
        syncs = sorted({f"{w.filename}:{w.lineno}: {str(w.message)[:200]}" for w in caught
                        if "synchroniz" in str(w.message)})
    finally:
        torch.cuda.set_sync_debug_mode("default")
    res = {"command": "python " + " ".join(sys.argv), "preset": a.preset, "grid": a.grid,
           "prefix_tokens": int(p.input_ids.numel()) - 1,
           "eager": {**eager_times, "kernels": sum(e.count for e in kernels),
                     "kernel_s": sum(e.self_device_time_total for e in kernels) / 1e6},
           "host_syncs": syncs}
    try:  # the window's graphed items (prefix/graphs.py): capture, replay time, K/V against eager
        graphs = PrefixGraphs()
        for pack in ([0], [1], [0, 1]):  # one group (bucket A), another group of it, a pack of two (bucket B)
            graphs.record(m, [ps_[i] for i in pack], KVStore(), pack)  # first of its bucket: eager, then captured
        res["capture"] = graphs.take_stats()
        res["graph"] = {**timed(lambda: graphs.record(m, [ps_[0]], KVStore(), [0]), a.reps),
                        "kv_max_abs_diff_vs_eager": {}}
        for name, pack, order in (("same_prompt", [0], [0]), ("other_prompt_same_bucket", [0], [2]),
                                  ("pack_of_two_swapped", [0, 1], [2, 0])):
            replayed, eager = KVStore(), KVStore()
            graphs.record(m, [ps_[i] for i in order], replayed, pack)
            X.reference_prefix_item(m, [ps_[i] for i in order], eager, pack, pack_tokens=1 << 30)
            res["graph"]["kv_max_abs_diff_vs_eager"][name] = max(
                float((replayed.leaves[k][i].float() - eager.leaves[k][i].float()).abs().max())
                for k in eager.leaves for i in (0, 1))
        res["graph"]["stats"] = graphs.take_stats()
    except Exception as e:  # noqa: BLE001 - what cannot be captured is the probe's finding
        res["capture_error"] = f"{type(e).__name__}: {e}"[:2000]
        res["traceback_tail"] = traceback.format_exc()[-4000:]
    res["environment"] = environment_record()
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
