"""The loss's log-probs and entropy: the torch path against the fused Triton kernel (`rl/triton_logprob.py`).

For a packed micro-batch of R tokens over the full vocabulary (bf16 logits, as megatron's output layer
gives them): forward + backward of sum(w * logp) + sum(u * entropy) at the sampling temperature, with the
vision placeholders banned; median milliseconds over repeats after warm-up, the peak memory the loss adds
above its inputs, and the fused path's errors against the torch path and against float64 on a slice of
rows. Run on the GPU machine:

    python benchmarks/logprob_kernel.py --rows 4096 8192 16384 --out benchmarks/results/logprob_kernel_h200.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from rollplex_megatron.rl.grpo import policy_logprob_entropy
from rollplex_megatron.verify.numerics import rel_err

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run as a script from the repo root
from cuda_timing import time_call, write_result  # noqa: E402


_BANNED = (151652, 151653, 151654, 151655, 151656)  # Qwen2.5-VL's vision placeholder ids


def _inputs(rows: int, vocab: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(1, rows, vocab, generator=g, device="cuda") * 4).to(torch.bfloat16)
    logits[..., vocab - 128:] = torch.finfo(torch.bfloat16).min  # the padded vocabulary columns
    labels = torch.randint(0, vocab - 128, (1, rows), generator=g, device="cuda")
    for b in _BANNED:  # sampled tokens are never banned; a banned label's log-prob is only "very negative"
        labels[labels == b] = b - len(_BANNED)
    mask = torch.rand(1, rows, generator=g, device="cuda") < 0.9
    w = torch.randn(1, rows, generator=g, device="cuda")
    u = torch.randn(int(mask.sum()), generator=g, device="cuda")
    return logits, labels, mask, w, u


def _step(kernel, logits, labels, mask, w, u, temperature, banned):
    x = logits.detach().requires_grad_()
    logp, ent = policy_logprob_entropy(x, labels, temperature, banned, 0, None, mask, True, kernel)
    ((logp * w).sum() + (ent * u).sum()).backward()
    return logp.detach(), ent.detach(), x.grad


def _time(kernel, args, repeats: int, warmup: int) -> dict:
    return time_call(lambda: _step(kernel, *args), repeats, warmup)


def main() -> int:
    from rollplex_megatron.dist import init_parallel
    init_parallel()  # the torch path's vocab-parallel cross-entropy reads megatron's TP group (TP 1 here)
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--vocab", type=int, default=151936)  # Qwen2.5-VL's padded vocabulary at TP 1
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default="")
    a = p.parse_args()
    banned = _BANNED
    rows = []
    for r in a.rows:
        args = (*_inputs(r, a.vocab, r), a.temperature, banned)
        row = {"rows": r, "vocab": a.vocab}
        for kernel in ("torch", "triton"):
            row[kernel] = _time(kernel, args, a.repeats, a.warmup)
        row["speedup"] = row["torch"]["median_ms"] / row["triton"]["median_ms"]
        want, got = _step("torch", *args), _step("triton", *args)
        row["rel_vs_torch"] = {k: rel_err(x, y) for k, x, y in zip(("logp", "entropy", "grad"), got, want)}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del args, want, got
        torch.cuda.empty_cache()
    write_result(a.out, rows, {"what": "forward + backward of sum(w * logp) + sum(u * entropy[mask]) on [1, rows, "
                                       "vocab] bf16 logits (N(0, 16)), 128 padded columns, 5 banned, 90% of rows "
                                       "in the mask",
                               "temperature": a.temperature, "repeats": a.repeats, "warmup": a.warmup,
                               "timing": "CUDA events around one call, median of repeats; peak: max allocated "
                                         "during the repeats minus allocated before them (the loss's own "
                                         "temporaries and grad)"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
