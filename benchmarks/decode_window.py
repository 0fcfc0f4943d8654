"""Decode-window microbenchmark: does prefix work hide inside the rollout's decode?

3B shapes, bf16, random weights. Each case is a batch of groups of G=8 samples decoding on the
embedded engine (CUDA-graph decode), and one reference prefix stage per group (the motion_long
prompt: 1039 prefix tokens, 4096 video patches) as the side work. Measured per case:
- decode alone (the engine's decode loop, no items);
- items alone (every reference prefix run back to back on the default stream);
- both, under each window mechanism: the rollout's wall time after its prefill (decode loop plus
  items left for the end), and the decode loop's own time.
hidden = (decode alone + items alone - both) / items alone: the share of the prefix work the window
hid; window_ratio = (decode alone + items alone) / both (the issue's window figure). decode_slowdown = decode
loop with the window / decode alone - 1 (for `interleave` the items run inside the loop, so its slowdown is
the items' time: the no-overlap reference; `after` runs them all once decoding ends, the same work in series
without the window). Both are
reported; the mechanism is chosen by the wall time of decode plus its side work (`policy` in the
output: `rollout/window/policy.build_policy`, the table `python -m rollplex_megatron window-policy
--from OUT` writes for mode.window=auto). Both are wall
times with the CUDA-graph captures in them (each rollout captures its own graphs); the figures
without the capture time are kept as *_excl_capture but not judged: a capture's time depends on
the side work running beside it.
`--graphs`: each item is a replay of its CUDA graph (mode.window_graphs), captured in the warm-up; the run's
capture and replay counts are in `prefix_graphs`. `--keep-decode`: the engine keeps its decode state and graphs
between rollouts (rollout.keep_decode_state), so after the warm-up no decode graph is captured inside a window.
Cases: uniform lengths (every sample `--new-tokens`) at several batch sizes, and a long-tail case
(per-group lengths from a lognormal, so the active batch shrinks). The targets of the issue are
hidden >= 0.30 with decode_slowdown <= 0.10; `winners` lists the rows that meet both (kept as a
record; `auto` no longer reads it).

    python -m torch.distributed.run --nproc_per_node 1 benchmarks/decode_window.py --out decode_window_3b.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from functools import partial

import torch

from rollplex_megatron.runtime import sync


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2_5_vl_3b")
    ap.add_argument("--task", default="motion_long")
    ap.add_argument("--batches", default="16,64,128")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--tail-batch", type=int, default=64)
    ap.add_argument("--mechanisms", default="interleave,after,stream,tail,green:32,green:64")
    ap.add_argument("--repeats", type=int, default=2, help="runs per measurement (the fastest counts)")
    ap.add_argument("--profile-item", action="store_true", help="only profile one reference prefix item")
    ap.add_argument("--keep-decode", action="store_true",
                    help="rollout.keep_decode_state: the decode graphs outlive a rollout (captured at warm-up)")
    ap.add_argument("--graphs", action="store_true",
                    help="items as CUDA graph replays (mode.window_graphs: prefix/graphs.py), captured at warm-up")
    ap.add_argument("--out", default="")
    a = ap.parse_args()

    from rollplex_megatron.attention.kv_store import KVStore
    from rollplex_megatron.dist import init_parallel
    from rollplex_megatron.envs.motion import MotionEnv
    from rollplex_megatron.models.qwen25vl import build_model
    from rollplex_megatron.recipes import load_run_config
    from rollplex_megatron.rollout.embedded import EmbeddedEngine
    from rollplex_megatron.rollout.engine import RolloutRequest
    from rollplex_megatron.rollout.sampling import SamplingParams
    from rollplex_megatron.rollout.window import DecodeWindow
    from rollplex_megatron.runtime import environment_record
    from rollplex_megatron.prefix.graphs import PrefixGraphs
    from rollplex_megatron.trainer.modes.rollplex import reference_prefix_item

    prefix_graphs = PrefixGraphs() if a.graphs else None
    _reference_prefix = partial(reference_prefix_item, graphs=prefix_graphs)

    gpu = torch.cuda.is_available()
    dtype = "bfloat16" if gpu else "float32"
    cfg = load_run_config([f"model={a.model}", f"dtype={dtype}", f"task={a.task}"])
    init_parallel(1, 1, 0, "nccl" if gpu else "gloo")
    actor, ref = build_model(cfg.model, dtype).eval(), build_model(cfg.model, dtype).eval()
    env = MotionEnv(cfg.task, cfg.model)
    G, params = a.group_size, SamplingParams()
    max_new = a.new_tokens * 2
    engine = EmbeddedEngine(actor, cfg.model, 4096, max_new, kv_cache_gib=60.0, keep_decode_state=a.keep_decode)

    def requests(batch, lengths):
        return [RolloutRequest(env.prompt(env.episode(i)), G, lengths[i], (), seed=i) for i in range(batch // G)]

    def items_alone(reqs):
        store = KVStore()
        sync()
        t0 = time.perf_counter()
        for i, r in enumerate(reqs):
            _reference_prefix(ref, [r.prompt], store, [i])
        sync()
        return time.perf_counter() - t0

    def rollout(reqs, window=None):
        store = KVStore()
        if window is not None:
            for i, r in enumerate(reqs):
                window.submit(f"ref[{i}]", partial(_reference_prefix, ref, [r.prompt], store, [i]))
        sync()
        t0 = time.perf_counter()
        out = engine.generate(reqs, params, hooks=window)
        sync()
        st = out.stats
        return {"after_prefill_s": time.perf_counter() - t0 - st["prefill_s"], "decode_loop_s": st["decode_s"],
                "graph_error": engine.graph_error,
                "prefill_s": st["prefill_s"], "graphs_captured": st["graphs_captured"], "capture_s": st["capture_s"],
                **(window.stats() if window is not None else {})}

    if a.profile_item:
        return profile_item(a, env, ref, requests(G, [a.new_tokens]), _reference_prefix, KVStore, environment_record)
    cases = [(f"uniform_b{b}", b, [a.new_tokens] * (b // G)) for b in (int(x) for x in a.batches.split(","))]
    g = torch.Generator().manual_seed(0)
    n_tail = a.tail_batch // G
    tail = [max(8, min(max_new, int(math.exp(math.log(a.new_tokens / 2) + 0.8 * float(torch.randn(1, generator=g))))))
            for _ in range(n_tail)]
    cases.append((f"longtail_b{a.tail_batch}", a.tail_batch, tail))
    rows, winners = [], []
    for name, batch, lengths in cases:
        reqs = requests(batch, lengths)
        rollout(reqs)  # warm-up: lazy init, allocator
        items_alone(reqs)
        alone = min((rollout(reqs) for _ in range(a.repeats)), key=lambda r: r["after_prefill_s"])
        t_items = min(items_alone(reqs) for _ in range(a.repeats))
        row = {"case": name, "batch": batch, "lengths": lengths, "decode_alone": alone, "items_alone_s": t_items,
               "items": len(reqs), "mechanisms": {}}
        base = alone["after_prefill_s"] - alone["capture_s"]
        for spec in a.mechanisms.split(","):
            mech, _, sms = spec.partition(":")
            try:
                runs = [rollout(reqs, DecodeWindow(mech, 1, 0.25, int(sms or 32))) for _ in range(a.repeats)]
                res = min(runs, key=lambda r: r["after_prefill_s"])
            except Exception as e:  # a mechanism the machine refuses is a result, not a crash
                cause = f" (cause: {type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ is not None else ""
                row["mechanisms"][spec] = {"error": f"{type(e).__name__}: {e}{cause}"[:2000]}
                print(name, spec, row["mechanisms"][spec], flush=True)
                continue
            # judged on wall times with the graph captures left in (both runs capture the same graphs):
            # a capture's time depends on the side work running beside it, so subtracting it biases
            # the result; the capture-free figures are kept for reference only
            res["hidden"] = (alone["after_prefill_s"] + t_items - res["after_prefill_s"]) / t_items
            res["window_ratio"] = (alone["after_prefill_s"] + t_items) / res["after_prefill_s"]
            res["decode_slowdown"] = res["decode_loop_s"] / alone["decode_loop_s"] - 1
            both = res["after_prefill_s"] - res["capture_s"]
            res["hidden_excl_capture"] = (base + t_items - both) / t_items
            res["decode_slowdown_excl_capture"] = ((res["decode_loop_s"] - res["capture_s"])
                                                   / (alone["decode_loop_s"] - alone["capture_s"]) - 1)
            res["meets_targets"] = res["hidden"] >= 0.30 and res["decode_slowdown"] <= 0.10
            row["mechanisms"][spec] = res
            if res["meets_targets"]:
                winners.append({"batch": batch, "case": name, "mechanism": mech, "green_sms": int(sms or 0),
                                "hidden": res["hidden"], "decode_slowdown": res["decode_slowdown"]})
            print(name, spec, {k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}, flush=True)
        rows.append(row)
        print(json.dumps({"case": name, "decode_alone_s": base, "items_alone_s": t_items}), flush=True)
    res = {"command": "python " + " ".join(sys.argv), "rows": rows, "winners": winners,
           "targets": {"hidden_min": 0.30, "decode_slowdown_max": 0.10}, "window_graphs": a.graphs,
           "keep_decode_state": a.keep_decode, "decode_attention": engine.attention, "fused_layer": engine.fused_layer,
           "prefix_graphs": prefix_graphs.take_stats() if prefix_graphs is not None else None,
           "environment": environment_record()}
    from rollplex_megatron.rollout.window.policy import build_policy

    # the policy judges each mechanism against interleave; a run of other mechanisms alone keeps its rows
    res["policy"] = build_policy(res, a.out or "decode_window.py") if "interleave" in a.mechanisms.split(",") else None
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    chosen = [(r["case"], r["mechanism"]) for r in res["policy"]["rows"]] if res["policy"] else "no interleave run"
    print(json.dumps({"winners": winners, "policy": chosen}))
    return 0


def profile_item(a, env, ref, reqs, item_fn, KVStore, environment_record) -> int:
    """One reference prefix item under torch.profiler: host time to issue it against GPU kernel time."""
    from torch.profiler import ProfilerActivity, profile

    prompt = reqs[0].prompt
    for _ in range(2):
        item_fn(ref, [prompt], KVStore(), [0])  # warm-up
    sync()
    t0 = time.perf_counter()
    item_fn(ref, [prompt], KVStore(), [0])
    issue = time.perf_counter() - t0  # returns once the host has issued every kernel
    sync()
    total = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        item_fn(ref, [prompt], KVStore(), [0])
        sync()
    ev = prof.key_averages()
    kernels = [e for e in ev if e.device_type == torch.autograd.DeviceType.CUDA]
    res = {"command": "python " + " ".join(sys.argv), "item": "reference prefix stage of one group",
           "prefix_tokens": int(prompt.input_ids.numel() - 1),
           "host_issue_s": issue, "item_wall_s": total,
           "gpu_kernel_s": sum(e.self_device_time_total for e in kernels) / 1e6,
           "kernel_launches": sum(e.count for e in kernels),
           "note": "host_issue_s: time until the call returns without a device sync (the host has issued "
                   "every kernel); when it is close to item_wall_s the host, not the GPU, paces the item",
           "environment": environment_record()}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "environment"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
