"""Kernel time of one CUDA-graph decode step per case (shared prefix 16 groups x 8 = batch 128, 8 x 8,
the tail 8 x 1; unshared 128 x 1), for each decode attention and sampling kernel pair (attention:
math = fp32 torch, flash = varlen flash kernels + torch merge, triton = split-K/V kernels; sampling:
torch = sampling.py's tensors, triton = the fused draw). Kernel count per step reported. `nolayer` in a path's
options runs megatron's layer modules where the engine would run the fused layer path (models/decode_layers.py),
so one run profiles both.

3B shapes, bf16, random weights, the decode_vs_hf prompt shape (1026 tokens). One eager prefill
gives a prefix K/V that every group reuses (the numbers do not matter, only the shapes), so no
128-request prefill runs. The step is captured once, replayed `--replays` times for the wall time,
then a few replays run under torch.profiler for the kernels' share of the step.

    python -m torch.distributed.run --nproc_per_node 1 benchmarks/decode_step_profile.py --out prof.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2_5_vl_3b")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--paths", default="flash:torch,triton:torch:norope,triton:triton:norope,triton:triton:nolayer,"
                                       "triton:triton",
                    help="decode_attention:sampling_kernel[:opts] to profile; opts joined by +: norope (the Triton "
                         "attention without the fused RoPE and cache write), nonorm (torch's RMSNorm), nolayer "
                         "(megatron's layer modules instead of the fused layer path, models/decode_layers.py; "
                         "norope and nonorm turn it off too), noskip (the Triton response kernel runs the key blocks "
                         "past each sample's length masked instead of skipping them, attention/triton_decode.py "
                         "skip_empty=False), gated / all (rollout.decode_gemm: the layer path's fc1 and activation, or "
                         "every layer GEMM, as models/triton_linear.py's kernels at steps of at most 32 samples), "
                         "threelaunch (the "
                         "attention's prefix and response programs in kernels of their own, one_launch=False)")
    ap.add_argument("--cases", default="shared_16x8,shared_8x8,shared_8x1,unshared_128x1",
                    help="name_GROUPSxSAMPLES: groups sharing one prefix each, samples per group")
    ap.add_argument("--split-halves", action="store_true",
                    help="also profile with every LLM linear run as two GEMMs over views of its halves (the split-GEMM "
                         "executor of weights/split.py, as a rollout at another TP runs gathered or permuted linears)")
    ap.add_argument("--split-only", default="",
                    help="with --split-halves: only linears whose name ends so (e.g. linear_fc1: the gated fc1 a "
                         "rollout at 2x the training TP splits)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()

    sys.path.insert(0, "benchmarks")
    from decode_vs_hf import cuda_kernels, prompts, random_model
    from torch.profiler import ProfilerActivity, profile

    from rollplex_megatron.attention.kv_store import KVStore
    from rollplex_megatron.attention.triton_decode import triton_shared_prefix_decode_attention
    from rollplex_megatron.rollout import embedded
    from rollplex_megatron.prefix.batch import Group
    from rollplex_megatron.prefix.execution import prefix_forward
    from rollplex_megatron.rollout.embedded import DecodeCache, EmbeddedEngine, _DecodeState, _WaveDecoder
    from rollplex_megatron.rollout.engine import RolloutRequest
    from rollplex_megatron.rollout.sampling import SamplingParams
    from rollplex_megatron.runtime import environment_record

    cfg, model, gpu = random_model(a.preset)
    dtype = torch.bfloat16 if gpu else torch.float32
    prompt = prompts(cfg, 1, (2, 16, 16), 896)[0]
    one = KVStore()
    with torch.no_grad():
        prefix_forward(model, [Group(prompt, [], torch.zeros(0))], one, keep_graph=False)
    rows = {}
    shapes = [(c, *map(int, c.rsplit("_", 1)[1].split("x"))) for c in a.cases.split(",")]
    pairs = [(p + ":").split(":")[:3] for p in a.paths.split(",")]
    cases = [(f"{case}_{attn}_{samp}" + (f"_{opt}" if opt else ""), groups, n, attn, samp, opt)
             for attn, samp, opt in pairs for case, groups, n in shapes]
    if a.split_halves:
        cases += [(f"{c[0]}_split", *c[1:]) for c in cases]
    for name, groups, n, impl, samp, opt in cases:
        if name.endswith("_split") and not getattr(model, "_split_halves", False):
            split_halves(model, a.split_only)
        skip = "noskip" not in opt.split("+")
        embedded.triton_shared_prefix_decode_attention = partial(triton_shared_prefix_decode_attention, skip_empty=skip,
                                                                 one_launch="threelaunch" not in opt.split("+"))
        eng = EmbeddedEngine(model, cfg, 4096, a.max_new, kv_cache_gib=60.0, decode_attention=impl,
                             sampling_kernel=samp, fused_rope="norope" not in opt, fused_norm="nonorm" not in opt,
                             fused_layer="nolayer" not in opt,
                             decode_gemm=next((g for g in ("gated", "all") if g in opt.split("+")), "torch"))
        store = KVStore(leaves={(layer, g): kv for (layer, _), kv in one.leaves.items() for g in range(groups)})
        reqs = [RolloutRequest(prompt, n, a.max_new, (), seed=g) for g in range(groups)]
        cache = DecodeCache.for_wave(store, list(range(groups)), [n] * groups, a.max_new, dtype)
        dec = _WaveDecoder(eng, reqs, _DecodeState((), cache), SamplingParams())
        key = (dec.n_rows, dec._s_max(dec.n_rows), dec.window(0))
        with torch.no_grad():
            dec._run_step(*key)  # capture (GPU) or eager
            torch.cuda.synchronize() if gpu else None
            t0 = time.perf_counter()
            for _ in range(a.replays):
                dec._run_step(*key)
            torch.cuda.synchronize() if gpu else None
            step_ms = 1e3 * (time.perf_counter() - t0) / a.replays
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
            with profile(activities=acts) as prof:
                for _ in range(3):
                    dec._run_step(*key)
                torch.cuda.synchronize() if gpu else None
        kernels = cuda_kernels(prof)
        total = sum(e.self_device_time_total for e in kernels) / 3 / 1e3
        top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:30]
        rows[name] = {"groups": groups, "samples_per_group": n, "decode_attention": eng.attention,
                      "sampling_kernel": "triton" if dec.fused_sampling else "torch", "fused_rope": eng.fused_rope,
                      "fused_norm": eng.fused_norm, "fused_layer": eng.fused_layer, "layer_error": eng.layer_error,
                      "decode_gemm": eng.decode_gemm,
                      "skip_empty_response_blocks": skip and impl == "triton",
                      "one_launch_attention": "threelaunch" not in opt.split("+") and impl == "triton",
                      "step_ms": step_ms,
                      "kernel_ms_per_step": total, "kernels_per_step": sum(e.count for e in kernels) / 3,
                      "cuda_graphs": eng.cuda_graphs, "graph_error": eng.graph_error, "window": key[2],
                      "top_kernel_launches_per_step": {e.key[:140]: e.count / 3 for e in top},
                      "top_kernels_ms_per_step": {e.key[:140]: round(e.self_device_time_total / 3 / 1e3, 3)
                                                  for e in top}}
        print(json.dumps({name: {k: v for k, v in rows[name].items() if not k.startswith("top_")}}), flush=True)
        print(json.dumps(dict(list(rows[name]["top_kernels_ms_per_step"].items())[:8])), flush=True)
        del dec, cache, store
    res = {"command": "python " + " ".join(sys.argv), "preset": a.preset, "split_only": a.split_only,
           "prompt_tokens": int(prompt.input_ids.numel()), "rows": rows,
           "environment": environment_record()}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def split_halves(model, only: str = "") -> None:
    """Install the split-GEMM executor on every decoder linear: two local runs (the halves of the weight
    along its TP dim), no remote piece; the same numbers up to the row-parallel sum's order."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from rollplex_megatron.weights import split

    for name, mod in model.language_model.decoder.named_modules():
        if isinstance(mod, (ColumnParallelLinear, RowParallelLinear)) and name.endswith(only):
            dim = 0 if isinstance(mod, ColumnParallelLinear) else 1
            n = mod.weight.shape[dim]
            halves = [("local", 0, n // 2), ("local", n // 2, n - n // 2)]
            split.install(mod, mod.weight.data, mod.weight.data[:0], halves, dim)
    model._split_halves = True


if __name__ == "__main__":
    raise SystemExit(main())
