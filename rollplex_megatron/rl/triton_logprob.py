"""The loss's log-probs and entropy over the vocabulary in one read of the logits (Triton).

Legend: R = rows (tokens of a packed micro-batch), V = this TP rank's vocabulary shard.

The torch path (`grpo.policy_logits` + megatron's `vocab_parallel_cross_entropy` + `vocab_parallel_entropy`)
makes fp32 copies of the [R, V] logits (the upcast, the temperature, the entropy's exp and products, the
cross-entropy's shifted logits and the softmax it saves for backward) and runs many [R, V] passes a
micro-batch (counted from the code; not yet measured against this kernel). Here one program per row reads the logits
once and keeps, in registers, the row's running max, its sum of exp, its sum of exp times the logit, and the
label's logit; across TP shards those four numbers per row are combined by all-reduces of [R] vectors.
Backward reads the logits once more and writes their gradient in their own dtype. Nothing of size [R, V] is
kept but the logits themselves.

The distribution is the sampled policy's, as in `grpo.policy_logits`: x = logits / temperature (fp32),
with the banned columns (vision placeholders) and the vocabulary padding (the dtype minimum) left out.
A column takes part iff its x is above -1e30 (padding is about -3e38; a real logit never comes near), which
is what the torch path's exp(x - max) = 0 does for those columns. Sums run in another order than torch's
(fp32 rounding); exp and log are Triton's (on CUDA the fast approximations, within a few ulp).
Under TRITON_INTERPRET=1 the kernels run on CPU (the tests' reference check).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

_FLOOR = tl.constexpr(-1.0e30)  # at or below: not a column of the distribution (padding, banned)
BLOCK = 1024  # vocabulary columns per iteration of a row's program
NB = 8  # banned columns handled by the kernels (the model's vision placeholders: 4)


@triton.jit
def _scaled(logits_ptr, row_off, v, ok, banned, t):
    x = tl.load(logits_ptr + row_off + v, mask=ok, other=0.0).to(tl.float32) / t
    is_banned = tl.sum((v[:, None] == banned[None, :]).to(tl.int32), 1) > 0
    return tl.where(ok & ~is_banned, x, -3.0e38)


@triton.jit
def _stats_kernel(logits_ptr, stride_r, labels_ptr, banned_ptr, n_banned, t, vocab, lo,
                  m_ptr, z_ptr, s_ptr, xt_ptr, V_PAD: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr):
    r = tl.program_id(0)
    row_off = r.to(tl.int64) * stride_r
    nb = tl.arange(0, NB)
    banned = tl.load(banned_ptr + nb, mask=nb < n_banned, other=-1)
    label = tl.load(labels_ptr + r) - lo  # this shard's column of the label (outside: none)
    m_i = tl.full([BLOCK], -3.0e38, tl.float32)  # per lane: running max, sum of exp, sum of exp * x
    z_i = tl.zeros([BLOCK], tl.float32)
    s_i = tl.zeros([BLOCK], tl.float32)
    xt = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V_PAD, BLOCK):
        v = start + tl.arange(0, BLOCK)
        ok = v < vocab
        x = _scaled(logits_ptr, row_off, v, ok, banned, t)
        keep = x > _FLOOR
        m_new = tl.maximum(m_i, tl.where(keep, x, -3.0e38))
        a = tl.exp(m_i - m_new)
        e = tl.where(keep, tl.exp(x - m_new), 0.0)
        z_i = z_i * a + e
        s_i = s_i * a + e * tl.where(keep, x, 0.0)
        m_i = m_new
        xt += tl.where(ok & (v == label), x, 0.0)
    m = tl.max(m_i, 0)
    a = tl.exp(m_i - m)
    tl.store(m_ptr + r, m)
    tl.store(z_ptr + r, tl.sum(z_i * a, 0))
    tl.store(s_ptr + r, tl.sum(s_i * a, 0))
    tl.store(xt_ptr + r, tl.sum(xt, 0))


@triton.jit
def _grad_kernel(logits_ptr, stride_r, grad_ptr, stride_gr, labels_ptr, banned_ptr, n_banned, t, vocab, lo,
                 m_ptr, z_ptr, mean_ptr, g_logp_ptr, g_ent_ptr, V_PAD: tl.constexpr, BLOCK: tl.constexpr,
                 NB: tl.constexpr):
    r = tl.program_id(0)
    row_off = r.to(tl.int64) * stride_r
    nb = tl.arange(0, NB)
    banned = tl.load(banned_ptr + nb, mask=nb < n_banned, other=-1)
    label = tl.load(labels_ptr + r) - lo
    m, z, mean = tl.load(m_ptr + r), tl.load(z_ptr + r), tl.load(mean_ptr + r)
    g_lp, g_h = tl.load(g_logp_ptr + r), tl.load(g_ent_ptr + r)
    for start in range(0, V_PAD, BLOCK):
        v = start + tl.arange(0, BLOCK)
        ok = v < vocab
        x = _scaled(logits_ptr, row_off, v, ok, banned, t)
        keep = x > _FLOOR
        p = tl.where(keep, tl.exp(x - m) / z, 0.0)
        # d logp / dx = onehot - p; d H / dx = -p (x - sum_j p_j x_j); then x = logits / t
        g = g_lp * (tl.where(ok & (v == label), 1.0, 0.0) - p) - g_h * p * (tl.where(keep, x, 0.0) - mean)
        g = tl.where(keep, g / t, 0.0)
        tl.store(grad_ptr + r.to(tl.int64) * stride_gr + v, g.to(grad_ptr.dtype.element_ty), mask=ok)


def _banned_local(banned: tuple[int, ...], lo: int, vocab: int, device) -> torch.Tensor:
    cols = [b - lo for b in banned if 0 <= b - lo < vocab]
    if len(cols) > NB:
        raise ValueError(f"the fused log-prob kernel takes at most {NB} banned columns per shard, got {len(cols)}; "
                         f"use train.logprob_kernel=torch")
    return torch.tensor(cols or [-1], dtype=torch.int32, device=device)


class _PolicyLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_RV, labels_R, temperature, banned, tp_rank, tp_group):
        rows, vocab = logits_RV.shape
        lo = tp_rank * vocab
        dev = logits_RV.device
        ban = _banned_local(banned, lo, vocab, dev)
        labels = labels_R.to(torch.int64).contiguous()
        m, z, s, xt = (torch.empty(rows, dtype=torch.float32, device=dev) for _ in range(4))
        v_pad = triton.cdiv(vocab, BLOCK) * BLOCK
        if rows:
            _stats_kernel[(rows,)](logits_RV, logits_RV.stride(0), labels, ban, ban.numel(), float(temperature),
                                   vocab, lo, m, z, s, xt, V_PAD=v_pad, BLOCK=BLOCK, NB=NB)
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            gm = m.clone()
            dist.all_reduce(gm, op=dist.ReduceOp.MAX, group=tp_group)
            a = torch.exp(m - gm)
            zs = torch.stack([z * a, s * a, xt])
            dist.all_reduce(zs, group=tp_group)
            m, (z, s, xt) = gm, zs.unbind(0)
        lse = m + torch.log(z)
        mean = s / z
        ctx.save_for_backward(logits_RV, labels, ban, m, z, mean)
        ctx.args = (float(temperature), vocab, lo, v_pad)
        return xt - lse, lse - mean

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits_RV, labels, ban, m, z, mean = ctx.saved_tensors
        t, vocab, lo, v_pad = ctx.args
        rows = logits_RV.shape[0]
        g_logp = torch.zeros_like(m) if g_logp is None else g_logp.float().contiguous()
        g_ent = torch.zeros_like(m) if g_ent is None else g_ent.float().contiguous()
        grad = torch.empty_like(logits_RV)
        if rows:
            _grad_kernel[(rows,)](logits_RV, logits_RV.stride(0), grad, grad.stride(0), labels, ban, ban.numel(), t,
                                  vocab, lo, m, z, mean, g_logp, g_ent, V_PAD=v_pad, BLOCK=BLOCK, NB=NB)
        return grad, None, None, None, None, None


def fused_logprob_entropy(logits_BTV: torch.Tensor, labels_BT: torch.Tensor, temperature: float = 1.0,
                          banned: tuple[int, ...] = (), tp_rank: int = 0, tp_group=None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of each label, entropy) per token [B, T], fp32, of the policy `grpo.policy_logits` defines
    (this rank holds vocabulary columns [tp_rank * V, (tp_rank + 1) * V)); differentiable in the logits.
    Every TP rank gets the same values (the rows' statistics are all-reduced over `tp_group`)."""
    b, t, v = logits_BTV.shape
    x = logits_BTV.reshape(b * t, v)
    if x.stride(-1) != 1:
        x = x.contiguous()
    logp, ent = _PolicyLogprobEntropy.apply(x, labels_BT.reshape(-1), temperature, tuple(banned), tp_rank, tp_group)
    return logp.view(b, t), ent.view(b, t)
