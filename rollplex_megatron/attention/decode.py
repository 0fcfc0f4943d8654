"""Decode attention over a shared prefix: each group's prefix K/V is read once for all its samples.

Legend: B = active samples, Gr = groups, P = padded prefix length, R = padded response length,
Ng/Nq = KV groups / query heads per TP rank (rep = Nq/Ng query heads per KV group), D = head dim.

A decode query of sample b (group g_b) attends to the prefix of g_b (all P_g positions) and to its
own response keys 0..len_b-1 (the current token's K/V included). The two parts are computed
separately and merged by their log-sum-exp, which is the same softmax over the concatenated keys.
The prefix part stacks the queries of a group's samples, so one matmul per KV head reads the
group's prefix K/V once, not once per sample (the bytes a decode step moves shrink by ~G).

Two implementations of the same split: `shared_prefix_decode_attention` (plain torch, fp32 math;
the reference, and the path on CPU) and `flash_shared_prefix_decode_attention` (two varlen flash
calls that return their log-sum-exp; CUDA, half precision), which reads the K/V once in their
storage dtype instead of making fp32 copies of every prefix each step.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


def _partial(scores, values, valid):
    """Masked softmax pieces: row max, sum of exponentials and unnormalised output (fp32)."""
    scores = scores.masked_fill(~valid, float("-inf"))
    m = scores.amax(dim=-1, keepdim=True).clamp_min(-1e30)  # empty rows stay finite
    e = torch.exp(scores - m)
    return m, e.sum(dim=-1, keepdim=True), e @ values


def group_slots(group_B: torch.Tensor, n_groups: int, s_max: int | None = None) -> tuple[torch.Tensor, int]:
    """Rank of each sample among the samples of its group, and the largest count.

    With `s_max` given (a bound the caller knows) nothing is read back to the host, so the step
    can be captured in a CUDA graph."""
    onehot = torch.nn.functional.one_hot(group_B, n_groups)  # [B, Gr]
    slot = ((onehot.cumsum(0) - 1) * onehot).sum(-1)
    if s_max is None:
        s_max = int(onehot.sum(0).max()) if group_B.numel() else 0
    return slot, s_max


def shared_prefix_decode_attention(q_BND, prefix_k_GrPND, prefix_v_GrPND, prefix_len_Gr, group_B,
                                   resp_k_BRND, resp_v_BRND, resp_len_B, scale: float | None,
                                   s_max: int | None = None, slot_B: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step's attention; returns [B, Nq*D] in the query dtype (scale None: 1/sqrt(D)).

    `s_max`: an upper bound of samples per group in the batch (static shapes, no host sync);
    `slot_B`: `group_slots(group_B, ...)` when the caller computed it once for every layer."""
    b, nq, d = q_BND.shape
    scale = d ** -0.5 if scale is None else scale
    n_groups, p, ng = prefix_k_GrPND.shape[0], prefix_k_GrPND.shape[1], prefix_k_GrPND.shape[2]
    rep = nq // ng
    q = q_BND.float() * scale
    # prefix part: queries of one group stacked -> [Gr, Ng, S*rep, D] against [Gr, Ng, P, D]
    if slot_B is None or s_max is None:
        slot_B, s_max = group_slots(group_B, n_groups, s_max)
    slot = slot_B
    qg = q.new_zeros(n_groups, s_max, ng, rep, d)
    qg[group_B, slot] = q.view(b, ng, rep, d)
    qg = qg.permute(0, 2, 1, 3, 4).reshape(n_groups, ng, s_max * rep, d)
    pk = prefix_k_GrPND.float().permute(0, 2, 3, 1)  # [Gr, Ng, D, P]
    pv = prefix_v_GrPND.float().permute(0, 2, 1, 3)  # [Gr, Ng, P, D]
    valid_p = (torch.arange(p, device=q.device)[None, :] < prefix_len_Gr[:, None])[:, None, None, :]
    m1, l1, o1 = _partial(qg @ pk, pv, valid_p)  # [Gr, Ng, S*rep, 1 | D]
    unstack = lambda t: t.view(n_groups, ng, s_max, rep, -1).permute(0, 2, 1, 3, 4)[group_B, slot]  # noqa: E731
    m1, l1, o1 = unstack(m1), unstack(l1), unstack(o1)  # [B, Ng, rep, 1 | D]
    # own part: [B, Ng, rep, D] against the sample's response keys [B, Ng, R, D]
    r = resp_k_BRND.shape[1]
    rk = resp_k_BRND.float().permute(0, 2, 3, 1)
    rv = resp_v_BRND.float().permute(0, 2, 1, 3)
    valid_r = (torch.arange(r, device=q.device)[None, :] < resp_len_B[:, None])[:, None, None, :]
    m2, l2, o2 = _partial(q.view(b, ng, rep, d) @ rk, rv, valid_r)
    m = torch.maximum(m1, m2)
    a1, a2 = torch.exp(m1 - m), torch.exp(m2 - m)
    out = (o1 * a1 + o2 * a2) / (l1 * a1 + l2 * a2)
    return out.reshape(b, nq * d).to(q_BND.dtype)



def flash_varlen_available(dtype: torch.dtype, device: torch.device | str, head_dim: int) -> bool:
    """Whether torch's varlen flash kernels run (the decode and split-attention paths): a CUDA device of sm80 or
    newer, a torch build with flash attention, half precision, and a head dim flash supports (<= 256, a multiple
    of 8)."""
    if torch.device(device).type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    if not (hasattr(torch.ops.aten, "_flash_attention_forward") and torch.backends.cuda.is_flash_attention_available()):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0) and head_dim % 8 == 0 and head_dim <= 256


class FlashIndex(NamedTuple):
    """Varlen offsets of one decode step (int32), built once per step and shared by every layer."""

    prefix_cum_q: torch.Tensor  # [Gr+1] s_max query rows per group
    prefix_cum_k: torch.Tensor  # [Gr+1] P padded keys per group
    prefix_used: torch.Tensor  # [Gr] real prefix length
    resp_cum_q: torch.Tensor  # [B+1] one query row per sample
    resp_cum_k: torch.Tensor  # [B+1] Rm response slots per sample
    resp_used: torch.Tensor  # [B] response keys written (current token included)


def flash_index(prefix_len_Gr, p: int, s_max: int, resp_len_B, rm: int) -> FlashIndex:
    """The offsets `flash_shared_prefix_decode_attention` reads (see FlashIndex)."""
    i32 = dict(dtype=torch.int32, device=prefix_len_Gr.device)
    gr, b = prefix_len_Gr.shape[0], resp_len_B.shape[0]
    return FlashIndex(torch.arange(gr + 1, **i32) * s_max, torch.arange(gr + 1, **i32) * p,
                      prefix_len_Gr.to(torch.int32), torch.arange(b + 1, **i32), torch.arange(b + 1, **i32) * rm,
                      resp_len_B.to(torch.int32))


def _varlen_flash(q_TND, k_TND, v_TND, cum_q, cum_k, max_q: int, max_k: int, used_k, scale: float):
    """torch's varlen flash forward with `seqused_k` (keys past it are never read); output, lse [T, Nq]."""
    out, lse = torch.ops.aten._flash_attention_forward(
        q_TND, k_TND, v_TND, cum_q, cum_k, max_q, max_k, 0.0, False, False, scale=scale, seqused_k=used_k)[:2]
    if lse.dim() == 2:  # unpadded layout [Nq, T]
        return out, lse.T
    # padded layout [batch, Nq, max_q] (older kernels): every sequence here has exactly max_q rows
    return out, lse.permute(0, 2, 1).reshape(-1, lse.shape[1])


def flash_shared_prefix_decode_attention(q_BND, prefix_k_GrPND, prefix_v_GrPND, group_B, slot_B, s_max: int,
                                         resp_k_BRND, resp_v_BRND, window: int, index: FlashIndex,
                                         scale: float | None) -> torch.Tensor:
    """`shared_prefix_decode_attention` on fused kernels (CUDA, bf16/fp16); returns [B, Nq*D].

    Same split and merge: the prefix part packs a group's samples as that group's `s_max` query rows
    of one varlen flash call, so each group's prefix K/V is read once, in half precision, with no
    fp32 copy; the response part is one query row per sample over its own keys. Both calls return
    their log-sum-exp, merged in fp32. `resp_*` are whole response buffers [B, Rm, Ng, D]; `window`
    bounds the keys read (>= every response length)."""
    b, nq, d = q_BND.shape
    scale = d ** -0.5 if scale is None else scale
    n_groups, p, ng = prefix_k_GrPND.shape[:3]
    qg = q_BND.new_zeros(n_groups, s_max, nq, d)
    qg[group_B, slot_B] = q_BND
    o1, l1 = _varlen_flash(qg.view(-1, nq, d), prefix_k_GrPND.reshape(-1, ng, d), prefix_v_GrPND.reshape(-1, ng, d),
                           index.prefix_cum_q, index.prefix_cum_k, s_max, p, index.prefix_used, scale)
    o1 = o1.view(n_groups, s_max, nq, d)[group_B, slot_B]
    l1 = l1.reshape(n_groups, s_max, nq)[group_B, slot_B]
    o2, l2 = _varlen_flash(q_BND.contiguous(), resp_k_BRND.reshape(-1, ng, d), resp_v_BRND.reshape(-1, ng, d),
                           index.resp_cum_q, index.resp_cum_k, 1, window, index.resp_used, scale)
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m)[..., None], torch.exp(l2 - m)[..., None]
    out = (o1.float() * w1 + o2.float() * w2) / (w1 + w2)
    return out.reshape(b, nq * d).to(q_BND.dtype)
