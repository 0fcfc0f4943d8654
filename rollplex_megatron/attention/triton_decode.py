"""Shared-prefix decode attention as Triton kernels: split-K/V partials, then one merge.

Legend: B = active samples, Gr = groups, S = samples-per-group bound, P = padded prefix length,
Rm = response slots, Ng/Nq = KV groups / query heads (rep = Nq/Ng), D = head dim, M = query rows
of one program.

The same function as `decode.shared_prefix_decode_attention`, with the bytes a decode step reads
and little else:
- prefix part: one program per (group, KV head, row block, key split) stacks the queries of the
  group's samples and of the rep query heads that share the KV head as its M rows, so each prefix
  K/V element is read once per step (flash's varlen kernel reads it once per query head, rep times);
- response part: one program per (sample, KV head, key split) over the sample's own keys, the
  rep query heads as its rows; programs past a sample's length write an empty partial;
- merge: one program per (sample, query head) combines every partial by its log-sum-exp and
  writes the output in the query dtype.
Queries are gathered by index (no scatter into a padded copy). Both parts' programs run in one kernel
(`_parts_kernel`, `one_launch`, the default), then the merge: two launches per layer (three with
`one_launch=False`; the same bits). Scores
accumulate in fp32 and the probabilities are cast to the K/V dtype before the P @ V product, as
flash does. Under TRITON_INTERPRET=1 the kernels run on CPU (the tests' reference check).
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # the kernels run on CPU (tests): never chosen by auto
_NEG = tl.constexpr(-3.0e38)  # a finite "minus infinity": partials of empty rows stay finite (no inf - inf)
PREFIX_SPLIT, RESP_SPLIT = 256, 256  # keys per program


class TritonIndex(NamedTuple):
    """Per-step indices shared by every layer (int32, static shapes: capturable in a CUDA graph)."""

    rows: torch.Tensor  # [Gr, S] sample in slot s of group g, -1 where the slot is empty
    group: torch.Tensor  # [B] group of each sample
    slot: torch.Tensor  # [B] slot of each sample within its group
    prefix_len: torch.Tensor  # [Gr] real prefix length
    resp_len: torch.Tensor  # [B] response keys written (current token included)


def triton_index(group_B, slot_B, s_max: int, prefix_len_Gr, resp_len_B) -> TritonIndex:
    """The indices `triton_shared_prefix_decode_attention` reads (see TritonIndex)."""
    n_groups, b = prefix_len_Gr.shape[0], group_B.shape[0]
    rows = torch.full((n_groups, s_max), -1, dtype=torch.int32, device=group_B.device)
    rows[group_B, slot_B] = torch.arange(b, dtype=torch.int32, device=group_B.device)
    i32 = lambda t: t.to(torch.int32).contiguous()  # noqa: E731
    return TritonIndex(rows, i32(group_B), i32(slot_B), i32(prefix_len_Gr), i32(resp_len_B))


def triton_decode_available(dtype: torch.dtype, device, head_dim: int) -> bool:
    """Whether the kernels compile for this case: CUDA, half precision, a power-of-two head dim."""
    if torch.device(device).type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


@triton.jit
def _block(q, k_base, v_base, stride_kn, start, n_hi, scale, offs_d, m_i, l_i, acc, BLOCK_N: tl.constexpr):
    """One block of keys [start, start + BLOCK_N) (those at n_hi and past masked) into the online softmax."""
    offs_n = start + tl.arange(0, BLOCK_N)
    keep = offs_n < n_hi
    kv_off = offs_n[:, None] * stride_kn + offs_d[None, :]
    k = tl.load(k_base + kv_off, mask=keep[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k)) * scale
    s = tl.where(keep[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    v = tl.load(v_base + kv_off, mask=keep[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    l_i = l_i * alpha + tl.sum(p, 1)
    return m_new, l_i, acc


@triton.jit
def _partial(q, k_base, v_base, stride_kn, n_lo, n_hi, scale, offs_d, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
             M: tl.constexpr, D: tl.constexpr, SKIP: tl.constexpr):
    """Online softmax of q [M, D] over keys [n_lo, n_hi) (n_hi <= n_lo + SPLIT): (row max, row sum,
    unnormalised output), over a fixed trip count of blocks. Without SKIP every block runs, those past n_hi
    loading nothing (masked); with SKIP a block that starts at n_hi or past it is skipped (a response split holds
    few keys or none at a rollout's early steps). A block with no key leaves (max, sum, output) unchanged exactly
    (its weights are exp(-inf) = 0, the rescale exp(0) = 1), so both give the same bits."""
    m_i = tl.full([M], _NEG, tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D], tl.float32)
    for start in range(0, SPLIT, BLOCK_N):
        if SKIP:
            if n_lo + start < n_hi:
                m_i, l_i, acc = _block(q, k_base, v_base, stride_kn, n_lo + start, n_hi, scale, offs_d, m_i, l_i,
                                       acc, BLOCK_N)
        else:
            m_i, l_i, acc = _block(q, k_base, v_base, stride_kn, n_lo + start, n_hi, scale, offs_d, m_i, l_i, acc,
                                   BLOCK_N)
    return m_i, l_i, acc


@triton.jit
def _prefix_kernel(q_ptr, k_ptr, v_ptr, rows_ptr, plen_ptr, o_ptr, ml_ptr, scale,
                   stride_qb, stride_qh, stride_kg, stride_kn, stride_kh, n_kv_heads, s_max, n_splits,
                   REP: tl.constexpr, M: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr):
    _prefix_part(tl.program_id(0), tl.program_id(1), tl.program_id(2), q_ptr, k_ptr, v_ptr, rows_ptr, plen_ptr, o_ptr,
                 ml_ptr, scale, stride_qb, stride_qh, stride_kg, stride_kn, stride_kh, n_kv_heads, s_max, n_splits,
                 REP, M, D, SPLIT, BLOCK_N)


@triton.jit
def _prefix_part(gh, rb, sp, q_ptr, k_ptr, v_ptr, rows_ptr, plen_ptr, o_ptr, ml_ptr, scale,
                 stride_qb, stride_qh, stride_kg, stride_kn, stride_kh, n_kv_heads, s_max, n_splits,
                 REP: tl.constexpr, M: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr):
    # one prefix program: (group, KV head) gh, query-row block rb, key split sp
    g, h = gh // n_kv_heads, gh % n_kv_heads
    i = rb * M + tl.arange(0, M)  # query row: slot i // REP, query head h * REP + i % REP
    slot, r = i // REP, i % REP
    sample = tl.load(rows_ptr + g * s_max + slot, mask=slot < s_max, other=-1)
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + sample[:, None] * stride_qb + (h * REP + r)[:, None] * stride_qh + offs_d[None, :],
                mask=(sample >= 0)[:, None], other=0.0)
    plen = tl.load(plen_ptr + g)
    n_lo = sp * SPLIT
    n_hi = tl.minimum(n_lo + SPLIT, plen)
    # a group's prefix splits are full but its last: nothing to skip
    m_i, l_i, acc = _partial(q, k_ptr + g * stride_kg + h * stride_kh, v_ptr + g * stride_kg + h * stride_kh,
                             stride_kn, n_lo, n_hi, scale, offs_d, SPLIT, BLOCK_N, M, D, SKIP=False)
    # workspace [Gr, Ng, splits, rows]: rows of one (group, head) contiguous per split
    n_rows = s_max * REP
    base = (gh * n_splits + sp) * n_rows
    keep = i < n_rows
    tl.store(o_ptr + (base + i)[:, None] * D + offs_d[None, :], acc, mask=keep[:, None])
    tl.store(ml_ptr + 2 * (base + i), m_i, mask=keep)
    tl.store(ml_ptr + 2 * (base + i) + 1, l_i, mask=keep)


@triton.jit
def _resp_kernel(q_ptr, k_ptr, v_ptr, rlen_ptr, o_ptr, ml_ptr, scale,
                 stride_qb, stride_qh, stride_kb, stride_kn, stride_kh, n_kv_heads, n_splits,
                 REP: tl.constexpr, M: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                 SKIP: tl.constexpr):
    _resp_part(tl.program_id(0), tl.program_id(1), q_ptr, k_ptr, v_ptr, rlen_ptr, o_ptr, ml_ptr, scale, stride_qb,
               stride_qh, stride_kb, stride_kn, stride_kh, n_kv_heads, n_splits, REP, M, D, SPLIT, BLOCK_N, SKIP)


@triton.jit
def _resp_part(bh, sp, q_ptr, k_ptr, v_ptr, rlen_ptr, o_ptr, ml_ptr, scale,
               stride_qb, stride_qh, stride_kb, stride_kn, stride_kh, n_kv_heads, n_splits,
               REP: tl.constexpr, M: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
               SKIP: tl.constexpr):
    # one response program: (sample, KV head) bh, key split sp
    b, h = bh // n_kv_heads, bh % n_kv_heads
    r = tl.arange(0, M)
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + b * stride_qb + (h * REP + r)[:, None] * stride_qh + offs_d[None, :],
                mask=(r < REP)[:, None], other=0.0)
    n_lo = sp * SPLIT
    n_hi = tl.minimum(n_lo + SPLIT, tl.load(rlen_ptr + b))
    m_i, l_i, acc = _partial(q, k_ptr + b * stride_kb + h * stride_kh, v_ptr + b * stride_kb + h * stride_kh,
                             stride_kn, n_lo, n_hi, scale, offs_d, SPLIT, BLOCK_N, M, D, SKIP=SKIP)
    base = (bh * n_splits + sp) * REP
    keep = r < REP
    tl.store(o_ptr + (base + r)[:, None] * D + offs_d[None, :], acc, mask=keep[:, None])
    tl.store(ml_ptr + 2 * (base + r), m_i, mask=keep)
    tl.store(ml_ptr + 2 * (base + r) + 1, l_i, mask=keep)


@triton.jit
def _parts_kernel(q_ptr, pk_ptr, pv_ptr, rows_ptr, plen_ptr, po_ptr, pml_ptr, rk_ptr, rv_ptr, rlen_ptr, ro_ptr, rml_ptr,
                  scale, stride_qb, stride_qh, stride_pg, stride_pn, stride_ph, stride_rb, stride_rn, stride_rh,
                  n_kv_heads, s_max, p_splits, r_splits, p_row_blocks, n_prefix_programs,
                  REP: tl.constexpr, PM: tl.constexpr, RM: tl.constexpr, D: tl.constexpr, PSPLIT: tl.constexpr,
                  RSPLIT: tl.constexpr, BLOCK_N: tl.constexpr, SKIP: tl.constexpr):
    # both parts in one launch (`one_launch`): the first n_prefix_programs programs are the prefix kernel's grid in
    # its order, the rest the response kernel's; each program does exactly what it does in its own kernel
    pid = tl.program_id(0)
    if pid < n_prefix_programs:
        sp = pid % p_splits
        rb = (pid // p_splits) % p_row_blocks
        gh = pid // (p_splits * p_row_blocks)
        _prefix_part(gh, rb, sp, q_ptr, pk_ptr, pv_ptr, rows_ptr, plen_ptr, po_ptr, pml_ptr, scale, stride_qb,
                     stride_qh, stride_pg, stride_pn, stride_ph, n_kv_heads, s_max, p_splits, REP, PM, D, PSPLIT,
                     BLOCK_N)
    else:
        rid = pid - n_prefix_programs
        _resp_part(rid // r_splits, rid % r_splits, q_ptr, rk_ptr, rv_ptr, rlen_ptr, ro_ptr, rml_ptr, scale, stride_qb,
                   stride_qh, stride_rb, stride_rn, stride_rh, n_kv_heads, r_splits, REP, RM, D, RSPLIT, BLOCK_N,
                   SKIP)


@triton.jit
def _merge_kernel(po_ptr, pml_ptr, ro_ptr, rml_ptr, group_ptr, slot_ptr, out_ptr, stride_ob, stride_oh,
                  n_kv_heads, s_max, p_splits, r_splits,
                  REP: tl.constexpr, D: tl.constexpr, PS: tl.constexpr, RS: tl.constexpr):
    b, qh = tl.program_id(0), tl.program_id(1)
    h, r = qh // REP, qh % REP
    g, slot = tl.load(group_ptr + b), tl.load(slot_ptr + b)
    offs_d = tl.arange(0, D)
    # prefix partials of this row: [Gr, Ng, splits, s_max * REP]
    ps = tl.arange(0, PS)
    p_row = ((g * n_kv_heads + h) * p_splits + ps) * (s_max * REP) + slot * REP + r
    p_ok = ps < p_splits
    pm = tl.load(pml_ptr + 2 * p_row, mask=p_ok, other=_NEG)
    pl = tl.load(pml_ptr + 2 * p_row + 1, mask=p_ok, other=0.0)
    rs = tl.arange(0, RS)
    r_row = ((b * n_kv_heads + h) * r_splits + rs) * REP + r
    r_ok = rs < r_splits
    rm = tl.load(rml_ptr + 2 * r_row, mask=r_ok, other=_NEG)
    rl = tl.load(rml_ptr + 2 * r_row + 1, mask=r_ok, other=0.0)
    m = tl.maximum(tl.max(pm, 0), tl.max(rm, 0))
    pw, rw = tl.exp(pm - m), tl.exp(rm - m)
    po = tl.load(po_ptr + p_row[:, None] * D + offs_d[None, :], mask=p_ok[:, None], other=0.0)
    ro = tl.load(ro_ptr + r_row[:, None] * D + offs_d[None, :], mask=r_ok[:, None], other=0.0)
    num = tl.sum(po * pw[:, None], 0) + tl.sum(ro * rw[:, None], 0)
    den = tl.sum(pl * pw, 0) + tl.sum(rl * rw, 0)
    out = num / den
    tl.store(out_ptr + b * stride_ob + qh * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _cos(x, PRECISE: tl.constexpr):
    if PRECISE:
        return tl.extra.cuda.libdevice.cos(x)
    else:
        return tl.cos(x)


@triton.jit
def _sin(x, PRECISE: tl.constexpr):
    if PRECISE:
        return tl.extra.cuda.libdevice.sin(x)
    else:
        return tl.sin(x)


@triton.jit
def _rope_write_kernel(q_ptr, k_ptr, v_ptr, f_ptr, qo_ptr, rk_ptr, rv_ptr, step_ptr,
                       stride_qb, stride_qg, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_fb,
                       stride_rb, stride_rn, stride_rh, n_q_heads, rep, D: tl.constexpr, PRECISE: tl.constexpr):
    b, head = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, D)
    half: tl.constexpr = D // 2
    f = tl.load(f_ptr + b * stride_fb + d)
    dt = qo_ptr.dtype.element_ty
    # megatron's unfused RoPE, rounding where it rounds: cos/sin in fp32 cast to the input dtype, then
    # t * cos, rotate_half(t) * sin and their sum, each rounded to the input dtype
    c, s = _cos(f, PRECISE).to(dt).to(tl.float32), _sin(f, PRECISE).to(dt).to(tl.float32)
    rot_d = (d + half) % D
    sign = tl.where(d < half, -1.0, 1.0)
    if head < n_q_heads:
        base = q_ptr + b * stride_qb + (head // rep) * stride_qg + (head % rep) * stride_qh
    else:
        base = k_ptr + b * stride_kb + (head - n_q_heads) * stride_kh
    x = tl.load(base + d).to(tl.float32)
    xr = tl.load(base + rot_d).to(tl.float32) * sign
    y = ((x * c).to(dt).to(tl.float32) + (xr * s).to(dt).to(tl.float32)).to(dt)
    if head < n_q_heads:
        tl.store(qo_ptr + (b * n_q_heads + head) * D + d, y)
    else:
        h = head - n_q_heads
        dst = b * stride_rb + tl.load(step_ptr) * stride_rn + h * stride_rh + d
        tl.store(rk_ptr + dst, y)
        tl.store(rv_ptr + dst, tl.load(v_ptr + b * stride_vb + h * stride_vh + d))


def triton_rope_and_write(q_BND, k_BND, v_BND, freqs_BD, resp_k_BRND, resp_v_BRND, step) -> torch.Tensor:
    """RoPE on this step's queries and keys (megatron's unfused rotate-half form, same roundings) and
    the keys and values written at response position `step` (a 1-element device tensor) of the cache,
    in one launch; returns the rotated queries [B, Nq, D]. `freqs_BD`: the step's rotary angles. The queries
    may also come by KV group, [B, Ng, rep, D] (a view of linear_qkv's output: read in place, no copy)."""
    q_BGRD = q_BND if q_BND.dim() == 4 else q_BND[:, None]  # by group: one group of all Nq heads when 3-D
    b, d = q_BND.shape[0], q_BND.shape[-1]
    rep, nq, ng = q_BGRD.shape[2], q_BGRD.shape[1] * q_BGRD.shape[2], k_BND.shape[1]
    if freqs_BD.shape[-1] != d or resp_k_BRND.stride() != resp_v_BRND.stride():
        raise ValueError("fused RoPE needs rotary over the whole head dim and K/V caches of one layout")
    if any(t.stride(-1) != 1 for t in (q_BND, k_BND, v_BND, freqs_BD, resp_k_BRND)):
        raise ValueError("fused RoPE needs a unit stride on the head dim")
    q_out = torch.empty(b, nq, d, dtype=q_BND.dtype, device=q_BND.device)
    rk = resp_k_BRND
    _rope_write_kernel[(b, nq + ng)](q_BGRD, k_BND, v_BND, freqs_BD, q_out, rk, resp_v_BRND, step,
                                     q_BGRD.stride(0), q_BGRD.stride(1), q_BGRD.stride(2), k_BND.stride(0),
                                     k_BND.stride(1), v_BND.stride(0), v_BND.stride(1), freqs_BD.stride(0),
                                     rk.stride(0), rk.stride(1), rk.stride(2), nq, rep, D=d, PRECISE=not INTERPRET)
    return q_out


def _pow2(n: int, lo: int = 1) -> int:
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


def triton_shared_prefix_decode_attention(q_BND, prefix_k_GrPND, prefix_v_GrPND, resp_k_BRND, resp_v_BRND,
                                          index: TritonIndex, scale: float | None,
                                          skip_empty: bool = True, prefix_split: int = PREFIX_SPLIT,
                                          resp_split: int = RESP_SPLIT, one_launch: bool = True) -> torch.Tensor:
    """`shared_prefix_decode_attention` on Triton kernels; returns [B, Nq*D] in the query dtype.

    `prefix_*` are [Gr, P, Ng, D] (keys past `index.prefix_len` never read), `resp_*` [B, Rm, Ng, D]
    (keys past `index.resp_len` never read); both need a unit stride on D. `skip_empty`: the response kernel skips
    the blocks of its split past each sample's length instead of running them masked (the same bits, `_partial`;
    on the H100 the response kernel's time fell by about a sixth, docs/concepts/kernels.md). `prefix_split`,
    `resp_split`: keys per program of each part (powers of two, at least 64: the key block), the programs' grain
    (`benchmarks/decode_kernel_shapes.py` times them); other splits sum the same terms in another order.
    `one_launch`: the prefix and response programs in one kernel (`_parts_kernel`; each program's arithmetic
    unchanged, so the same bits), two launches a layer instead of three (on an H100 at batch 8 the attention's
    kernels took 13.3 us a layer against 20.0 us, `decode_kernel_shapes_h100_d21eb1e.json`)."""
    for name, n in (("prefix_split", prefix_split), ("resp_split", resp_split)):
        if n < 64 or n & (n - 1):
            raise ValueError(f"{name}={n}: a power of two of at least 64 (the key block)")
    b, nq, d = q_BND.shape
    n_groups, p, ng = prefix_k_GrPND.shape[:3]
    s_max, rep, rm = index.rows.shape[1], nq // ng, resp_k_BRND.shape[1]
    scale = d ** -0.5 if scale is None else scale
    q = q_BND if q_BND.stride(-1) == 1 else q_BND.contiguous()
    if any(t.stride(-1) != 1 for t in (prefix_k_GrPND, prefix_v_GrPND, resp_k_BRND, resp_v_BRND)):
        raise ValueError("triton decode attention needs K/V with a unit stride on the head dim")
    if prefix_k_GrPND.stride() != prefix_v_GrPND.stride() or resp_k_BRND.stride() != resp_v_BRND.stride():
        raise ValueError("triton decode attention needs K and V of the same layout")
    n_rows = s_max * rep
    m_rows = min(_pow2(n_rows, 16), 64)
    p_splits, r_splits = triton.cdiv(p, prefix_split), triton.cdiv(rm, resp_split)
    f32 = dict(dtype=torch.float32, device=q.device)
    po = torch.empty(n_groups * ng * p_splits * n_rows, d, **f32)
    pml = torch.empty(n_groups * ng * p_splits * n_rows, 2, **f32)
    ro = torch.empty(b * ng * r_splits * rep, d, **f32)
    rml = torch.empty(b * ng * r_splits * rep, 2, **f32)
    pk, pv = prefix_k_GrPND, prefix_v_GrPND
    rk, rv = resp_k_BRND, resp_v_BRND
    row_blocks = triton.cdiv(n_rows, m_rows)
    if one_launch:
        n_pre = n_groups * ng * row_blocks * p_splits
        _parts_kernel[(n_pre + b * ng * r_splits,)](
            q, pk, pv, index.rows, index.prefix_len, po, pml, rk, rv, index.resp_len, ro, rml, scale, q.stride(0),
            q.stride(1), pk.stride(0), pk.stride(1), pk.stride(2), rk.stride(0), rk.stride(1), rk.stride(2), ng, s_max,
            p_splits, r_splits, row_blocks, n_pre, REP=rep, PM=m_rows, RM=_pow2(rep, 16), D=d, PSPLIT=prefix_split,
            RSPLIT=resp_split, BLOCK_N=64, SKIP=skip_empty)
    else:
        _prefix_kernel[(n_groups * ng, row_blocks, p_splits)](
            q, pk, pv, index.rows, index.prefix_len, po, pml, scale, q.stride(0), q.stride(1),
            pk.stride(0), pk.stride(1), pk.stride(2), ng, s_max, p_splits,
            REP=rep, M=m_rows, D=d, SPLIT=prefix_split, BLOCK_N=64)
        _resp_kernel[(b * ng, r_splits)](
            q, rk, rv, index.resp_len, ro, rml, scale, q.stride(0), q.stride(1), rk.stride(0), rk.stride(1),
            rk.stride(2), ng, r_splits, REP=rep, M=_pow2(rep, 16), D=d, SPLIT=resp_split, BLOCK_N=64, SKIP=skip_empty)
    out = torch.empty(b, nq, d, dtype=q.dtype, device=q.device)
    _merge_kernel[(b, nq)](po, pml, ro, rml, index.group, index.slot, out, out.stride(0), out.stride(1),
                           ng, s_max, p_splits, r_splits, REP=rep, D=d, PS=_pow2(p_splits), RS=_pow2(r_splits))
    return out.view(b, nq * d)
