"""Fused decode sampling (Triton): the counter-based Gumbel-max draw of `sampling.py` in one pass.

Legend: B = rows (samples), V = vocabulary, S = vocabulary splits.

`sample_tokens(row_uniforms(...))` materialises a [B, V] int64 hash, its uniforms, the Gumbel
noise, the scaled logits and a log-softmax: about twenty [B, V] kernels a decode step. Here one
program per (row, vocabulary split) reads the logits once, hashes (seed, sample, step, token id)
into the same uniforms in registers, and keeps the split's argmax of scaled logits + Gumbel noise
and its running log-sum-exp; a second kernel merges the splits. Same draw as the reference:
integer hash bits are identical, the scale is the same fp32 multiply, the logarithms are CUDA's
`logf` (libdevice, what torch's `log` runs), and ties go to the lower token id as in `argmax`.
The log-prob's log-sum-exp sums in another order (fp32 rounding). No top-k / top-p: those runs
keep the torch path. Under TRITON_INTERPRET=1 the kernels run on CPU (numpy's log).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollplex_megatron.attention.triton_decode import INTERPRET
from rollplex_megatron.rollout.sampling import inverse_temperature

_GOLDEN = tl.constexpr(0x9E3779B97F4A7C15)  # sampling.py's splitmix64 constants, as unsigned 64-bit
_MIX1, _MIX2 = tl.constexpr(0xBF58476D1CE4E5B9), tl.constexpr(0x94D049BB133111EB)
_NEG = tl.constexpr(-3.0e38)


@triton.jit
def _splitmix(x):
    x = (x ^ (x >> 30)) * _MIX1
    x = (x ^ (x >> 27)) * _MIX2
    return x ^ (x >> 31)


@triton.jit
def _log(x, PRECISE: tl.constexpr):
    if PRECISE:
        return tl.extra.cuda.libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def _sample_split_kernel(logits_ptr, stride_lb, seed_ptr, sample_ptr, step_ptr, banned_ptr, n_banned, inv_t, vocab,
                         part_ptr, idx_ptr, n_splits, CHUNK: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr,
                         PRECISE: tl.constexpr):
    b, sp = tl.program_id(0), tl.program_id(1)
    seed = tl.load(seed_ptr + b).to(tl.uint64)
    sample = tl.load(sample_ptr + b).to(tl.uint64)
    step = tl.load(step_ptr).to(tl.uint64)
    key = _splitmix(seed * _GOLDEN + sample)
    key = _splitmix(key + (step + 1) * _GOLDEN)
    m_i = tl.full([BLOCK], _NEG, tl.float32)  # per-lane running max and sum of exp (log-sum-exp)
    l_i = tl.zeros([BLOCK], tl.float32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)  # per-lane best perturbed logit and its token
    best_i = tl.zeros([BLOCK], tl.int32)
    nb = tl.arange(0, NB)
    banned = tl.load(banned_ptr + nb, mask=nb < n_banned, other=-1)
    for start in range(0, CHUNK, BLOCK):
        v = sp * CHUNK + start + tl.arange(0, BLOCK)
        ok = v < vocab
        x = tl.load(logits_ptr + b * stride_lb + v, mask=ok, other=0.0).to(tl.float32) * inv_t
        is_banned = tl.sum((v[:, None] == banned[None, :]).to(tl.int32), 1) > 0
        x = tl.where(ok & ~is_banned, x, float("-inf"))
        bits = _splitmix(key + v.to(tl.uint64) * _GOLDEN)
        u = ((bits >> 41).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        u = tl.minimum(tl.maximum(u, 1e-20), 1.0 - 1e-7)
        z = x - _log(-_log(u, PRECISE), PRECISE)
        take = z > best  # strictly: an equal value later in the lane keeps the lower token id
        best_i = tl.where(take, v, best_i)
        best = tl.where(take, z, best)
        m_new = tl.maximum(m_i, x)
        l_i = l_i * tl.exp(m_i - m_new) + tl.exp(x - m_new)
        m_i = m_new
    # lanes -> one value: the max, ties to the lower token id (as torch.argmax: the first maximum)
    top = tl.max(best, 0)
    tok = tl.min(tl.where(best == top, best_i, 2147483647), 0)
    m = tl.max(m_i, 0)
    lsum = tl.sum(l_i * tl.exp(m_i - m), 0)
    base = (b * n_splits + sp) * 3
    tl.store(part_ptr + base, top)
    tl.store(part_ptr + base + 1, m)
    tl.store(part_ptr + base + 2, lsum)
    tl.store(idx_ptr + b * n_splits + sp, tok)


@triton.jit
def _sample_merge_kernel(logits_ptr, stride_lb, inv_t, part_ptr, idx_ptr, n_splits, tok_ptr, lp_ptr,
                         SP: tl.constexpr):
    b = tl.program_id(0)
    s = tl.arange(0, SP)
    ok = s < n_splits
    base = (b * n_splits + s) * 3
    top = tl.load(part_ptr + base, mask=ok, other=float("-inf"))
    m = tl.load(part_ptr + base + 1, mask=ok, other=_NEG)
    lsum = tl.load(part_ptr + base + 2, mask=ok, other=0.0)
    idx = tl.load(idx_ptr + b * n_splits + s, mask=ok, other=2147483647)
    best = tl.max(top, 0)
    tok = tl.min(tl.where(top == best, idx, 2147483647), 0)  # splits hold increasing token ids
    mm = tl.max(m, 0)
    x = tl.load(logits_ptr + b * stride_lb + tok).to(tl.float32) * inv_t
    tl.store(tok_ptr + b, tok.to(tl.int64))
    tl.store(lp_ptr + b, (x - mm) - tl.log(tl.sum(lsum * tl.exp(m - mm), 0)))  # log_softmax's order


def fused_sample_available(dev) -> bool:
    """Whether `fused_sample` runs here as a compiled kernel (CUDA)."""
    return torch.device(dev).type == "cuda"


def fused_sample(logits_BV: torch.Tensor, temperature: float, seed_B: torch.Tensor, sample_B: torch.Tensor,
                 step: torch.Tensor, banned: torch.Tensor, block: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B] int64, log-probs [B] fp32): `sample_tokens` (temperature only) on the uniforms of
    `row_uniforms(seed_B, sample_B, step, V)`, with the `banned` token ids at -inf first.

    `step` is a 1-element int64 device tensor (a CUDA graph's step counter); nothing is read back."""
    b, vocab = logits_BV.shape
    if logits_BV.stride(-1) != 1:
        logits_BV = logits_BV.contiguous()
    # a chunk fixed by the vocabulary, not the batch: one compiled kernel serves every batch-size bucket
    chunk = min(8 * block, triton.cdiv(vocab, block) * block)
    splits = triton.cdiv(vocab, chunk)
    dev = logits_BV.device
    part = torch.empty(b, splits, 3, dtype=torch.float32, device=dev)
    idx = torch.empty(b, splits, dtype=torch.int32, device=dev)
    inv_t = inverse_temperature(temperature)
    nb = max(1, 1 << (max(banned.numel(), 1) - 1).bit_length())
    _sample_split_kernel[(b, splits)](logits_BV, logits_BV.stride(0), seed_B, sample_B, step, banned, banned.numel(),
                                      inv_t, vocab, part, idx, splits, CHUNK=chunk, BLOCK=block, NB=nb,
                                      PRECISE=not INTERPRET)
    tok = torch.empty(b, dtype=torch.long, device=dev)
    lp = torch.empty(b, dtype=torch.float32, device=dev)
    _sample_merge_kernel[(b,)](logits_BV, logits_BV.stride(0), inv_t, part, idx, splits, tok, lp,
                               SP=max(1, 1 << (splits - 1).bit_length()))
    return tok, lp
