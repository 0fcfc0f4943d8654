"""Training attention of one packed micro-batch: the masked SDPA path (`mode.attention_backend=sdpa`, today's
default) against the split path (`attention/split.py`, varlen flash kernels) at the 3B head shapes.

Two shapes of the `video_long` suite, forward + backward of sum(w * out) in bf16:
  response: a rollplex / prefix_shared update micro-batch of `--tokens` response tokens (responses of lognormal
    lengths, mean 256, cap 1024, G=8 a group) attending to their groups' 1026-token prefixes;
  full: a serial micro-batch of full sequences (prompt of 1026 tokens + a response each), `--full` of them.
Median milliseconds over repeats after warm-up (CUDA events), the peak memory each adds above its inputs, the
attended key pairs each computes, and the split path's error against the masked path. Run on the GPU machine:

    python benchmarks/split_attention.py --out benchmarks/results/split_attention_h200.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from rollplex_megatron.attention import split

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run as a script from the repo root
from cuda_timing import time_call, write_result  # noqa: E402
from rollplex_megatron.attention.prefix import PackedLayout, shared_prefix_attention
from rollplex_megatron.verify.numerics import rel_err

NQ, NG, D = 16, 2, 128  # Qwen2.5-VL-3B per TP rank at TP 1


def _lengths(g, n: int, mean: float = 256.0, cap: int = 1024) -> list[int]:
    sigma = 1.0
    mu = torch.log(torch.tensor(mean)) - sigma**2 / 2
    x = torch.exp(mu + sigma * torch.randn(n, generator=g))
    return [int(v) for v in x.clamp(1, cap).round()]


def response_case(g, tokens: int, prefix: int, group_size: int = 8):
    lens, groups = [], []
    for r in _lengths(g, 4 * tokens // 256):
        if sum(lens) + r > tokens:
            break
        lens.append(r)
        groups.append(len(lens[:-1]) // group_size)
    present = sorted(set(groups))
    return _layout(lens, groups, present, [prefix] * len(present))


def full_case(g, n: int, prefix: int):
    lens = [prefix + r for r in _lengths(g, n)]
    return _layout(lens, [-1] * n, [], [])


def _layout(lens, groups, present, plens):
    return PackedLayout(torch.cat([torch.full((n,), s) for s, n in enumerate(lens)]).cuda(),
                        torch.cat([torch.arange(n) for n in lens]).cuda(),
                        torch.cat([torch.full((n,), gi) for gi, n in zip(groups, lens)]).cuda(), present, plens, lens,
                        groups)


def _inputs(g, lay):
    t, kp = lay.seg_T.numel(), sum(lay.prefix_lens)
    mk = lambda *s: torch.randn(*s, generator=g).cuda().to(torch.bfloat16)  # noqa: E731
    return mk(t, 1, NQ, D), mk(t, 1, NG, D), mk(t, 1, NG, D), mk(kp, 1, NG, D), mk(kp, 1, NG, D), \
        torch.randn(t, 1, NQ * D, generator=g).cuda()


def _masked(lay, q, k, v, pk, pv, w):
    leaves = [x.requires_grad_() for x in (q, k, v, pk, pv)] if lay.prefix_groups else [
        x.requires_grad_() for x in (q, k, v)]
    kk, vv = (torch.cat([leaves[3], leaves[1]]), torch.cat([leaves[4], leaves[2]])) if lay.prefix_groups else (
        leaves[1], leaves[2])
    out = shared_prefix_attention(leaves[0], kk, vv, lay.allowed(), None, "sdpa")  # the mask built every call too
    (out.float() * w).sum().backward()
    return out.detach(), [x.grad for x in leaves]


def _split(lay, q, k, v, pk, pv, w):
    leaves = [x.requires_grad_() for x in (q, k, v, pk, pv)] if lay.prefix_groups else [
        x.requires_grad_() for x in (q, k, v)]
    idx = split.split_index(lay.seg_lens, lay.seg_groups, lay.prefix_groups, lay.prefix_lens, lay.seg_T.device)
    pks = (leaves[3], leaves[4]) if lay.prefix_groups else (None, None)
    out = split.split_attention(leaves[0], leaves[1], leaves[2], *pks, idx, None, kernel="flash")
    (out.float() * w).sum().backward()
    return out.detach(), [x.grad for x in leaves]


def _time(fn, lay, xs, repeats: int, warmup: int) -> dict:
    return time_call(lambda *args: fn(lay, *args), repeats, warmup,
                     prepare=lambda: [x.detach().clone() for x in xs[:5]] + [xs[5]])


def _pairs(lay) -> dict:
    """Key positions each path computes scores for: the mask's every pair, and the split's allowed blocks."""
    t, kp = lay.seg_T.numel(), sum(lay.prefix_lens)
    own = sum(n * n for n in lay.seg_lens)
    per_group = {g: 0 for g in lay.prefix_groups}
    for n, g in zip(lay.seg_lens, lay.seg_groups):
        if g >= 0:
            per_group[g] += n
    pre = sum(per_group[g] * p for g, p in zip(lay.prefix_groups, lay.prefix_lens))
    return {"masked": t * (t + kp), "split": own + pre, "needed": own // 2 + pre}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--full", type=int, nargs="+", default=[2, 4])
    p.add_argument("--prefix", type=int, default=1026)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default="")
    a = p.parse_args()
    g = torch.Generator().manual_seed(0)
    cases = [("response", n, response_case(g, n, a.prefix)) for n in a.tokens]
    cases += [("full", n, full_case(g, n, a.prefix)) for n in a.full]
    rows = []
    for kind, n, lay in cases:
        xs = _inputs(g, lay)
        row = {"kind": kind, "size": n, "tokens": lay.seg_T.numel(), "segments": len(lay.seg_lens),
               "groups": len(lay.prefix_groups), "prefix_keys": sum(lay.prefix_lens), "key_pairs": _pairs(lay)}
        for name, fn in (("masked_sdpa", _masked), ("split_flash", _split)):
            row[name] = _time(fn, lay, xs, a.repeats, a.warmup)
        row["speedup"] = row["masked_sdpa"]["median_ms"] / row["split_flash"]["median_ms"]
        fresh = [x.detach().clone() for x in xs[:5]] + [xs[5]]
        want = _masked(lay, *fresh)
        fresh = [x.detach().clone() for x in xs[:5]] + [xs[5]]
        got = _split(lay, *fresh)
        row["rel_vs_masked"] = {"out": rel_err(got[0], want[0])} | {
            k: rel_err(x, y) for k, x, y in zip(("q", "k", "v", "pk", "pv"), got[1], want[1])}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del xs, want, got
        torch.cuda.empty_cache()
    write_result(a.out, rows, {"what": "forward + backward of sum(w * attention) for one packed micro-batch, bf16, "
                                       f"{NQ} query heads, {NG} KV heads, head dim {D}; masked: SDPA with the "
                                       "[T, Kp+T] mask (built each call, as each forward does once); split: "
                                       "attention/split.py on torch's varlen flash kernels",
                               "prefix": a.prefix, "repeats": a.repeats, "warmup": a.warmup,
                               "timing": "CUDA events around one call, median of repeats; peak: max allocated "
                                         "during the repeats minus allocated before them"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
