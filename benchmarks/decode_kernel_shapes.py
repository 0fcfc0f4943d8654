"""The decode step's two kernel classes in isolation, at a preset's shapes (GPU machine): what the step's GEMMs and
its attention achieve per call, and what the attention's programs' grain changes.

- GEMMs: each linear of a decoder layer (linear_qkv, linear_proj, linear_fc1 with the gated halves, linear_fc2) and
  the output layer, as `F.linear` (cuBLAS) in bf16 at M = 8..128 rows (the decode batch), and beside it at
  --triton-rows `models/triton_linear.py`'s `small_m_linear` at each tiling of TRITON_CONFIGS (linear_fc1+act:
  cuBLAS then `silu_mul` against `small_m_gated`): microseconds a call and the weight bytes over that time (TB/s),
  against the card's bound given by --tbps, with each Triton result's difference from cuBLAS's. Each call reads
  another copy of the weight (a ring past the L2, as a step's layers do). The step profile
  (`decode_step_profile.py`) shows these GEMMs at 1.5-2.6 TB/s on an H100; this says which shapes lose.
- Attention: `triton_shared_prefix_decode_attention` at the shared-prefix cases of the step profile (groups x
  samples), one prefix of --prefix tokens a group and --resp response keys a sample, for every pair of
  `prefix_split` / `resp_split` given (with `one_launch` where asked: both parts in one kernel): microseconds a
  call, the K/V bytes read over that time, and the output's norm-relative difference from the first split's (the
  same terms in another order: rounding only; one launch: the same bits).
Each figure is the median over --repeats CUDA-graph replays of --calls back-to-back calls (a layer's worth of
launches, as in the step's graph), timed with CUDA events.

    python benchmarks/decode_kernel_shapes.py --preset qwen2_5_vl_3b --tbps 3.35 --out shapes.json
    python benchmarks/decode_kernel_shapes.py --check   # CPU: the interpreter, tiny shapes, numbers only
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch


def _graph_time_us(fn, calls: int, repeats: int) -> float:
    """Median microseconds of one call of `fn`, from CUDA-graph replays of `calls` calls."""
    fn()  # compile / warm
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


# Triton candidates timed beside cuBLAS: (block_n, block_k, split_k, num_warps, num_stages)
TRITON_CONFIGS = [(16, 256, 1, 4, 4), (32, 256, 1, 4, 4), (32, 128, 1, 4, 4), (64, 128, 1, 4, 3), (16, 256, 2, 4, 4),
                  (32, 256, 2, 4, 4), (32, 256, 4, 4, 4), (64, 128, 4, 4, 3), (16, 512, 4, 4, 3)]
RING_BYTES = 512 << 20  # weights cycled through within a graph: well past the L2 (50 MB on an H100), as in a step


def _ring(shape, nbytes_each: int, calls: int, device: str = "cuda") -> list[torch.Tensor]:
    """Distinct bf16 weights enough that a graph of `calls` calls reads each from HBM, not from the L2 (one set
    off CUDA)."""
    n = max(1, min(calls, -(-RING_BYTES // nbytes_each))) if device == "cuda" else 1
    return [torch.randn(*shape, device=device, dtype=torch.bfloat16) * shape[-1] ** -0.5 for _ in range(n)]


def gemm_rows(m, rows: list[int], tbps: float, calls: int, repeats: int, triton_configs=TRITON_CONFIGS,
              triton_rows: tuple[int, ...] = (8, 16, 32), device: str = "cuda") -> list[dict]:
    """Each decode linear of model config `m` at each M: us a call, TB/s of its weight, share of the bound, for
    cuBLAS (`F.linear`) and each Triton `small_m_linear` config (with its norm-relative difference from cuBLAS);
    off CUDA (the interpreter) the differences only."""
    from rollplex_megatron.models.triton_layer import silu_mul
    from rollplex_megatron.models.triton_linear import small_m_gated, small_m_linear
    from rollplex_megatron.verify.numerics import rel_err

    h, d = m.hidden_size, m.head_dim
    shapes = {"linear_qkv": (h, (m.num_attention_heads + 2 * m.num_query_groups) * d),
              "linear_proj": (m.num_attention_heads * d, h), "linear_fc1": (h, 2 * m.ffn_hidden_size),
              "linear_fc1+act": (h, 2 * m.ffn_hidden_size), "linear_fc2": (m.ffn_hidden_size, h),
              "output_layer": (h, m.vocab_size)}
    out = []
    for name, (k, n) in shapes.items():
        ws = _ring((n, k), n * k * 2, calls, device)
        for rows_m in rows:
            x = torch.randn(rows_m, k, device=device, dtype=torch.bfloat16)
            gated = name == "linear_fc1+act"  # cuBLAS then silu_mul (two launches) against small_m_gated (one)
            if gated:
                kernels = [("cublas+silu_mul", None, lambda w: silu_mul(torch.nn.functional.linear(x, w)))]
                triton_fn = small_m_gated
            else:
                kernels = [("cublas", None, lambda w: torch.nn.functional.linear(x, w))]
                triton_fn = small_m_linear
            ref = kernels[0][2](ws[0]).float()
            for cfg in triton_configs if rows_m in triton_rows else ():
                bn, bk, sk, nw, ns = cfg
                kernels.append((f"triton:{bn}x{bk}:s{sk}:w{nw}:st{ns}", cfg, lambda w, bn=bn, bk=bk, sk=sk, nw=nw,
                                ns=ns, fn=triton_fn: fn(x, w, block_n=bn, block_k=bk, split_k=sk, num_warps=nw,
                                                        num_stages=ns)))
            for label, cfg, fn in kernels:
                row = {"linear": name, "m": rows_m, "k": k, "n": n, "kernel": label,
                       "bound_us": round(n * k * 2 / (tbps * 1e12) * 1e6, 2)}
                try:
                    diff = float(rel_err(fn(ws[0]).float(), ref))
                    if device != "cuda":
                        row["rel_err_vs_cublas"] = diff
                        out.append(row)
                        continue
                    it = iter(range(1 << 30))
                    us = _graph_time_us(lambda fn=fn, it=it, ws=ws: fn(ws[next(it) % len(ws)]), calls, repeats)
                except Exception as e:  # a config this card cannot compile (shared memory): recorded, not fatal
                    if device != "cuda":
                        raise
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    out.append(row)
                    continue
                tb = n * k * 2 / (us * 1e-6) / 1e12
                row.update(us=round(us, 2), tbps=round(tb, 3), of_bound=round(tb / tbps, 3),
                           rel_err_vs_cublas=diff)
                out.append(row)
        del ws
    return out


def attention_case(m, groups: int, per_group: int, prefix: int, resp: int, device: str, seed: int = 0):
    """Queries, a prefix K/V a group and response K/V a sample at `m`'s heads, bf16, with the index."""
    from rollplex_megatron.attention.decode import group_slots
    from rollplex_megatron.attention.triton_decode import triton_index

    g = torch.Generator().manual_seed(seed)
    b, nq, ng, d = groups * per_group, m.num_attention_heads, m.num_query_groups, m.head_dim
    mk = lambda *s: torch.randn(*s, generator=g).to(device, torch.bfloat16)  # noqa: E731
    group = torch.arange(groups).repeat_interleave(per_group).to(device)
    slot, s_max = group_slots(group, groups)
    plen = torch.full((groups,), prefix, device=device)
    rlen = torch.full((b,), resp, device=device)
    idx = triton_index(group, slot, s_max, plen, rlen)
    pk, pv, rk, rv = mk(groups, prefix, ng, d), mk(groups, prefix, ng, d), mk(b, resp, ng, d), mk(b, resp, ng, d)
    kv_bytes = (pk.numel() + pv.numel() + rk.numel() + rv.numel()) * 2
    return mk(b, nq, d), pk, pv, rk, rv, idx, kv_bytes


def attention_rows(m, cases: list[tuple[int, int]], prefix: int, resp: int, splits: list[tuple[int, int]],
                   tbps: float, calls: int, repeats: int, device: str = "cuda") -> list[dict]:
    """Each (groups, samples) case at each (prefix_split, resp_split): us a call (None off CUDA), TB/s of its K/V
    bytes, and the difference from the first split pair's output."""
    from rollplex_megatron.attention.triton_decode import triton_shared_prefix_decode_attention as attn
    from rollplex_megatron.verify.numerics import rel_err

    out = []
    for groups, per_group in cases:
        q, pk, pv, rk, rv, idx, kv_bytes = attention_case(m, groups, per_group, prefix, resp, device)
        # a layer's K/V each call on CUDA (copies past the L2, as the step's layers are), one set elsewhere
        n_sets = max(1, min(calls, -(-RING_BYTES // kv_bytes))) if device == "cuda" else 1
        kv = [(pk, pv, rk, rv)] + [tuple(t.clone() for t in (pk, pv, rk, rv)) for _ in range(n_sets - 1)]
        base = None
        for ps, rs, *one in splits:
            one = bool(one and one[0])
            it = iter(range(1 << 30))
            call = lambda ps=ps, rs=rs, one=one, it=it: attn(q, *kv[next(it) % len(kv)], idx, None,  # noqa: E731
                                                             prefix_split=ps, resp_split=rs, one_launch=one)
            o = attn(q, pk, pv, rk, rv, idx, None, prefix_split=ps, resp_split=rs, one_launch=one).float()
            base = o if base is None else base
            us = _graph_time_us(call, calls, repeats) if device == "cuda" else None
            row = {"groups": groups, "samples_per_group": per_group, "batch": groups * per_group, "prefix": prefix,
                   "resp": resp, "prefix_split": ps, "resp_split": rs, "one_launch": one,
                   "us": None if us is None else round(us, 2),
                   "kv_bytes": kv_bytes, "rel_err_vs_first_split": float(rel_err(o, base))}
            if us is not None:
                row["tbps"] = round(kv_bytes / (us * 1e-6) / 1e12, 3)
                row["of_bound"] = round(row["tbps"] / tbps, 3)
            out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2_5_vl_3b")
    ap.add_argument("--tbps", type=float, default=3.35, help="the card's HBM bound (H100 3.35, H200 4.3 measured)")
    ap.add_argument("--rows", default="8,16,32,64,128", help="GEMM rows (the decode batch)")
    ap.add_argument("--cases", default="1x8,8x8,16x8", help="attention: GROUPSxSAMPLES")
    ap.add_argument("--prefix", type=int, default=1026)
    ap.add_argument("--resp", type=int, default=256)
    ap.add_argument("--splits", default="256:256,256:256:1,128:256,64:256,128:64,128:64:1,64:64,512:256",
                    help="attention: PREFIX_SPLIT:RESP_SPLIT[:1] (1: one_launch, both parts in one kernel), the first "
                         "the reference of the difference")
    ap.add_argument("--triton-rows", default="8,16,32", help="GEMM rows at which the Triton configs are timed")
    ap.add_argument("--calls", type=int, default=36)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--check", action="store_true",
                    help="CPU: the attention rows at tiny shapes under the interpreter (no times), then exit")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from rollplex_megatron.recipes import load_run_config
    from rollplex_megatron.runtime import environment_record

    splits = [tuple(int(x) for x in p.split(":")) for p in a.splits.split(",")]  # (prefix, resp[, one_launch])
    cases = [tuple(int(x) for x in c.split("x")) for c in a.cases.split(",")]
    if a.check:
        m = load_run_config(["model=tiny"]).model
        rows = attention_rows(m, [(2, 3)], 150, 70, [(256, 256), (64, 64)], a.tbps, 1, 1, device="cpu")
        print(json.dumps(rows))
        return 0
    m = load_run_config([f"model={a.preset}"]).model
    result = {"command": "python " + " ".join([os.path.relpath(__file__)] + (argv or sys.argv[1:])),
              "preset": a.preset, "tbps_bound": a.tbps, "calls_per_graph": a.calls, "repeats": a.repeats,
              "gemm": gemm_rows(m, [int(r) for r in a.rows.split(",")], a.tbps, a.calls, a.repeats,
                                triton_rows=tuple(int(r) for r in a.triton_rows.split(","))),
              "attention": attention_rows(m, cases, a.prefix, a.resp, splits, a.tbps, a.calls, a.repeats),
              "environment": environment_record()}
    text = json.dumps(result, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    for r in result["gemm"]:
        if "error" in r:
            print(f"{r['linear']:13s} M={r['m']:4d} {r['kernel']:28s} {r['error']}")
        else:
            print(f"{r['linear']:13s} M={r['m']:4d} {r['kernel']:28s} {r['us']:8.2f} us {r['tbps']:.2f} TB/s "
                  f"({r['of_bound']:.0%}) diff {r['rel_err_vs_cublas']:.1e}")
    for r in result["attention"]:
        print(f"attention {r['groups']}x{r['samples_per_group']} splits {r['prefix_split']}:{r['resp_split']}"
              f"{' one launch' if r['one_launch'] else ''} "
              f"{r['us']:8.2f} us {r['tbps']:.2f} TB/s diff {r['rel_err_vs_first_split']:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
