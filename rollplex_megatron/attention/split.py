"""Training attention over packed responses as two varlen attention calls merged by their log-sum-exp
(`mode.attention_backend=split`).

Legend: T = packed query tokens of a micro-batch (B=1), Kp = the present groups' prefix K/V concatenated,
Nq/Ng = query heads / KV groups per TP rank, D = head dim. Log-sum-exps are laid out [Nq, T] (the layout of
torch's varlen flash kernels).

The masked path (`prefix.shared_prefix_attention`) builds a [T, Kp+T] mask and lets SDPA attend every query to
every key of the micro-batch. Here the allowed keys of a response token are two dense blocks:
  part 1, the prefix: the token's group's whole prefix (the queries of a group's responses stacked against that
    group's prefix K/V, no mask);
  part 2, its own response: causal inside each response segment (the full-sequence baseline has this part alone).
Each part returns its output and log-sum-exp, and the two are merged: L = logaddexp(L1, L2),
O = exp(L1 - L) O1 + exp(L2 - L) O2, which is softmax attention over the union of both key sets. The backward
runs each part's own backward with the merged O and L: with P = exp(S - L) the softmax over the union restricted
to the part's keys, dS = P (dP - rowsum(dO O)) is the part's share of the union's gradient, so dQ is the sum of
the parts' and dK/dV of each key set come from its own part, exactly. No key outside the allowed blocks is read.

Kernels: on CUDA in bf16/fp16 torch's varlen flash attention (`aten._flash_attention_forward/backward`); on
CPU (and in fp32) the same contract in plain torch, one segment at a time (the reference the CPU tests use).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rollplex_megatron.attention.decode import flash_varlen_available


@dataclass
class SplitIndex:
    """Where each part's segments lie in one micro-batch, built once on the host and shared by every layer."""

    self_cu: torch.Tensor  # [S+1] int32: response segments (queries and keys alike)
    self_max: int
    prefix_cu_q: torch.Tensor | None = None  # [Gp+1] int32: the queries of each present group's responses
    prefix_cu_k: torch.Tensor | None = None  # [Gp+1] int32: each present group's prefix keys in Kp
    prefix_max_q: int = 0
    prefix_max_k: int = 0
    order: torch.Tensor | None = None  # token permutation that makes each group's queries contiguous (None: in order)


def _cu(lens: list[int], device) -> torch.Tensor:
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lens, dtype=torch.int32).cumsum(0)
    return out.to(device)


def split_index(seg_lens: list[int], seg_groups: list[int], prefix_groups: list[int], prefix_lens: list[int],
                device) -> SplitIndex:
    """The index of a micro-batch whose response segments (`seg_lens` tokens each, in token order, of groups
    `seg_groups`) attend to the prefixes of `prefix_groups` (`prefix_lens` keys each, concatenated in that
    order); with no prefix groups, part 2 alone (full sequences)."""
    idx = SplitIndex(_cu(seg_lens, device), max(seg_lens, default=0))
    if not prefix_groups:
        return idx
    rank = {g: i for i, g in enumerate(prefix_groups)}
    if any(g not in rank for g in seg_groups):
        raise ValueError(f"split attention: segments of groups {sorted(set(seg_groups) - set(rank))} have no prefix")
    starts = [0]
    for n in seg_lens:
        starts.append(starts[-1] + n)
    segs = sorted(range(len(seg_lens)), key=lambda s: rank[seg_groups[s]])  # stable: response order kept per group
    if segs != list(range(len(seg_lens))):
        idx.order = torch.cat([torch.arange(starts[s], starts[s] + seg_lens[s]) for s in segs]).to(device)
    q_per_group = [0] * len(prefix_groups)
    for s, g in enumerate(seg_groups):
        q_per_group[rank[g]] += seg_lens[s]
    idx.prefix_cu_q, idx.prefix_cu_k = _cu(q_per_group, device), _cu(prefix_lens, device)
    idx.prefix_max_q, idx.prefix_max_k = max(q_per_group), max(prefix_lens)
    return idx


# --- the two kernels of one part: forward -> (out, lse [Nq, T]); backward with a given out and lse -------------

def _math_forward(q, k, v, cu_q, cu_k, causal: bool, scale: float):
    """Plain torch, fp32 arithmetic, one segment at a time (CPU; the reference)."""
    t, nq, d = q.shape
    out, lse = q.new_zeros(t, nq, d), q.new_zeros(nq, t, dtype=torch.float32)
    for a, b, c, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        s, vv = _scores(q[a:b], k[c:e], v[c:e], causal, scale)
        m = torch.logsumexp(s, dim=-1)  # [Nq, n]
        out[a:b] = (torch.exp(s - m[..., None]) @ vv).transpose(0, 1).to(q.dtype)
        lse[:, a:b] = m
    return out, lse


def _scores(q, k, v, causal: bool, scale: float):
    """[Nq, n, m] fp32 scores of one segment (GQA expanded; causal aligned to the last key) and V [Nq, m, D]."""
    rep = q.shape[1] // k.shape[1]
    qq = q.float().transpose(0, 1)
    kk = k.float().repeat_interleave(rep, dim=1).transpose(0, 1)
    vv = v.float().repeat_interleave(rep, dim=1).transpose(0, 1)
    s = (qq @ kk.transpose(1, 2)) * scale
    if causal:
        n, m = s.shape[1], s.shape[2]
        s = s.masked_fill(~torch.ones(n, m, dtype=torch.bool, device=s.device).tril(m - n), float("-inf"))
    return s, vv


def _math_backward(do, q, k, v, out, lse, cu_q, cu_k, causal: bool, scale: float):
    """dQ, dK, dV of one part given the (merged) output and log-sum-exp, fp32 arithmetic per segment."""
    rep = q.shape[1] // k.shape[1]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for a, b, c, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        s, vv = _scores(q[a:b], k[c:e], v[c:e], causal, scale)
        p = torch.exp(s - lse[:, a:b, None])  # the union's softmax on this part's keys
        g = do[a:b].float().transpose(0, 1)  # [Nq, n, D]
        delta = (g * out[a:b].float().transpose(0, 1)).sum(-1, keepdim=True)
        ds = p * (g @ vv.transpose(1, 2) - delta)
        kk = k[c:e].float().repeat_interleave(rep, dim=1).transpose(0, 1)
        dq[a:b] = ((ds @ kk) * scale).transpose(0, 1).to(q.dtype)
        gk = (ds.transpose(1, 2) @ q[a:b].float().transpose(0, 1)) * scale  # [Nq, m, D]
        gv = p.transpose(1, 2) @ g
        m = e - c
        dk[c:e] = gk.view(k.shape[1], rep, m, -1).sum(1).transpose(0, 1).to(k.dtype)
        dv[c:e] = gv.view(v.shape[1], rep, m, -1).sum(1).transpose(0, 1).to(v.dtype)
    return dq, dk, dv


_RNG = {}  # per device: the rng-state tensors the flash forward returned (dropout off: never read)


def _flash_forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float):
    out, lse, rng, unused = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal,
                                                                    False, scale=scale)[:4]
    if lse.dim() != 2 or lse.shape != (q.shape[1], q.shape[0]):
        raise RuntimeError(f"mode.attention_backend=split: this torch's varlen flash kernel returns a log-sum-exp of "
                           f"shape {tuple(lse.shape)}, not [heads, tokens]; use mode.attention_backend=sdpa")
    _RNG[q.device] = (rng, unused)  # dropout is off, so the backward reads neither; it takes the forward's
    return out, lse


def _flash_backward(do, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float):
    rng, unused = _RNG[q.device]
    return torch.ops.aten._flash_attention_backward(do.contiguous(), q, k, v, out, lse, cu_q, cu_k, max_q, max_k,
                                                    0.0, causal, rng, unused, scale=scale)


def _part_forward(flash: bool, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    if flash:
        return _flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)
    return _math_forward(q, k, v, cu_q, cu_k, causal, scale)


def _part_backward(flash: bool, do, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    if flash:
        return _flash_backward(do, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale)
    return _math_backward(do, q, k, v, out, lse, cu_q, cu_k, causal, scale)


class _Split(torch.autograd.Function):
    """Both parts and their merge; backward as the module docstring says."""

    @staticmethod
    def forward(ctx, q, k, v, pk, pv, idx: SplitIndex, scale: float, flash: bool):  # noqa: D102
        o2, l2 = _part_forward(flash, q, k, v, idx.self_cu, idx.self_cu, idx.self_max, idx.self_max, True, scale)
        if pk is None:
            out, lse = o2, l2
        else:
            qp = q if idx.order is None else q[idx.order]
            o1, l1 = _part_forward(flash, qp.contiguous(), pk, pv, idx.prefix_cu_q, idx.prefix_cu_k, idx.prefix_max_q,
                                   idx.prefix_max_k, False, scale)
            if idx.order is not None:  # back to token order
                o1, l1 = torch.empty_like(o1).index_copy_(0, idx.order, o1), \
                    torch.empty_like(l1).index_copy_(1, idx.order, l1)
            lse = torch.logaddexp(l1, l2)
            w1, w2 = torch.exp(l1 - lse).T[..., None], torch.exp(l2 - lse).T[..., None]  # [T, Nq, 1]
            out = (o1.float() * w1 + o2.float() * w2).to(q.dtype)
        ctx.save_for_backward(q, k, v, pk, pv, out, lse)
        ctx.idx, ctx.scale, ctx.flash = idx, scale, flash
        return out

    @staticmethod
    def backward(ctx, dout):  # noqa: D102
        q, k, v, pk, pv, out, lse = ctx.saved_tensors
        idx, scale, flash = ctx.idx, ctx.scale, ctx.flash
        dq, dk, dv = _part_backward(flash, dout, q, k, v, out, lse, idx.self_cu, idx.self_cu, idx.self_max,
                                    idx.self_max, True, scale)
        dpk = dpv = None
        if pk is not None:
            perm = idx.order
            qp, dop, op, lp = (q, dout, out, lse) if perm is None else (q[perm], dout[perm], out[perm], lse[:, perm])
            dq1, dpk, dpv = _part_backward(flash, dop.contiguous(), qp.contiguous(), pk, pv, op.contiguous(),
                                           lp.contiguous(), idx.prefix_cu_q, idx.prefix_cu_k, idx.prefix_max_q,
                                           idx.prefix_max_k, False, scale)
            dq = _add_prefix_dq(dq, dq1, perm)
        return dq, dk, dv, dpk, dpv, None, None, None


def _add_prefix_dq(dq, dq1, perm):
    """The query gradient of both parts (the prefix part's rows back in token order)."""
    return dq + (dq1 if perm is None else torch.empty_like(dq1).index_copy_(0, perm, dq1))


def split_attention(query_TBND, key_TBGD, value_TBGD, prefix_k, prefix_v, idx: SplitIndex, scale: float | None,
                    kernel: str = "auto"):
    """Megatron layout in ([T,1,Nq,D] queries, [T,1,Ng,D] keys/values of the packed tokens; the present groups'
    prefix K/V [Kp,1,Ng,D] or None for full sequences), [T,1,Nq*D] out. `kernel`: flash (CUDA, bf16/fp16), math,
    or auto (flash where it runs)."""
    t, _, nq, d = query_TBND.shape
    scale = d ** -0.5 if scale is None else scale
    if kernel == "auto":
        kernel = "flash" if flash_varlen_available(query_TBND.dtype, query_TBND.device, d) else "math"
    q, k, v = (x.squeeze(1).contiguous() for x in (query_TBND, key_TBGD, value_TBGD))
    pk, pv = (None, None) if prefix_k is None else (prefix_k.squeeze(1).contiguous(), prefix_v.squeeze(1).contiguous())
    out = _Split.apply(q, k, v, pk, pv, idx, scale, kernel == "flash")
    return out.reshape(t, 1, nq * d)
