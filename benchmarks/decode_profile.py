"""Where an embedded-engine decode step spends its time: host work against GPU kernel time.

Builds the preset with random weights, generates `groups` x G samples of `new_tokens` tokens (no stop
token), and profiles the decode steps of a second generate call with torch.profiler. Reports per
decode step: wall time, summed GPU kernel time, kernel launches, and the CPU operators with the
most self time. GPU busy far below wall time means the step is bound by the host (launches).

    python -m torch.distributed.run --nproc_per_node 1 benchmarks/decode_profile.py --out prof.json
"""
from __future__ import annotations

import argparse
import json
import sys

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2_5_vl_3b")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--grid", default="2,16,16")
    ap.add_argument("--text-tokens", type=int, default=896)
    ap.add_argument("--unshared", action="store_true", help="every sample its own request (G=1 groups)")
    ap.add_argument("--cuda-graphs", action="store_true", help="profile graph replays (default: eager steps)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()

    sys.path.insert(0, "benchmarks")
    from decode_vs_hf import cuda_kernels, prompts, random_model
    from torch.profiler import ProfilerActivity, profile

    from rollplex_megatron.rollout.embedded import EmbeddedEngine
    from rollplex_megatron.rollout.engine import RolloutRequest
    from rollplex_megatron.rollout.sampling import SamplingParams
    from rollplex_megatron.runtime import environment_record

    cfg, model, gpu = random_model(a.preset)
    ps = prompts(cfg, a.groups, tuple(int(x) for x in a.grid.split(",")), a.text_tokens)
    eng = EmbeddedEngine(model, cfg, ps[0].input_ids.numel(), a.new_tokens, kv_cache_gib=40.0,
                         cuda_graphs=a.cuda_graphs)
    if a.unshared:
        reqs = [RolloutRequest(p, 1, a.new_tokens, (), seed=i * a.group_size + j)
                for i, p in enumerate(ps) for j in range(a.group_size)]
    else:
        reqs = [RolloutRequest(p, a.group_size, a.new_tokens, (), seed=i) for i, p in enumerate(ps)]
    params = SamplingParams(1.0, 1.0, 0)
    eng.generate(reqs, params)  # warm-up
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])

    def profiled(n_new: int):
        rs = [RolloutRequest(r.prompt, r.n, n_new, (), seed=r.seed) for r in reqs]
        with profile(activities=acts) as prof:
            out = eng.generate(rs, params)
            if gpu:
                torch.cuda.synchronize()
        events, kernels = prof.key_averages(), cuda_kernels(prof)
        per_kernel = {e.key: (e.self_device_time_total, e.count) for e in kernels}
        return out, events, sum(e.self_device_time_total for e in kernels), sum(e.count for e in kernels), per_kernel

    one, _, gpu_one, launches_one, k_one = profiled(1)  # prefill + one step: subtracted below
    out, events, gpu_all, launches_all, k_all = profiled(a.new_tokens)
    steps = out.stats["decode_steps"] - one.stats["decode_steps"]
    decode_s = out.stats["decode_s"] - one.stats["decode_s"]
    cpu_top = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CPU),
                     key=lambda e: -e.self_cpu_time_total)[:15]
    res = {"command": "python " + " ".join(sys.argv), "preset": a.preset, "batch": a.groups * a.group_size,
           "prompt_tokens": int(ps[0].input_ids.numel()), "decode_steps_compared": steps,
           "decode_step_wall_ms": 1e3 * decode_s / steps,
           "decode_step_gpu_kernel_ms": (gpu_all - gpu_one) / 1e3 / steps,
           "kernel_launches_per_decode_step": (launches_all - launches_one) / steps,
           "top_cpu_ops_self_ms_whole_call": {e.key: round(e.self_cpu_time_total / 1e3, 2) for e in cpu_top},
           "unshared": a.unshared, "cuda_graphs": eng.cuda_graphs, "decode_attention": eng.attention,
           "fused_layer": eng.fused_layer,
           "top_kernels_ms_per_decode_step": dict(sorted(
               ((k[:120], round((t - k_one.get(k, (0, 0))[0]) / 1e3 / steps, 3)) for k, (t, _) in k_all.items()),
               key=lambda kv: -kv[1])[:25]),
           "note": ("both calls run under torch.profiler, whose overhead inflates wall time; per-step numbers "
                    "are (call with new_tokens) minus (call with 1 new token), divided by the extra steps"),
           "environment": environment_record()}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps({k: res[k] for k in ("batch", "decode_steps_compared", "decode_step_wall_ms",
                                          "decode_step_gpu_kernel_ms", "kernel_launches_per_decode_step")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
