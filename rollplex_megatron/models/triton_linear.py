"""Decode GEMMs with few rows as one Triton kernel: y = x @ w.T (+ bias), for the decode step's small M.

Legend: M = rows (the decode batch), K = input features, N = output features, S = K splits.

At decode batch sizes the step's linears are matrix-vector products in all but name: every weight byte is read
once per block of up to 64 rows (once a step at the tail's batch sizes), so a linear costs its weight's bytes
over the card's bandwidth. cuBLAS picks tiles made
for larger M (the step profile shows the 3B's linear_qkv and linear_proj at about half the H100's bound, and
linear_fc2 as a split-K GEMM plus a separate reduce). `small_m_linear` tiles N finely (BLOCK_N columns a
program), streams K in BLOCK_K steps, and with `split_k` > 1 lets S programs share a column block, each summing
its K range in fp32 into a workspace [S, M, N] that a second kernel adds in a fixed order (deterministic, unlike
atomics). Its bias, when given, is added as megatron's linear modules add theirs in a decode step: the GEMM's
result rounded to the dtype first, then the bias added and rounded again.

The sum runs in fp32 in another order than cuBLAS's, so results agree with `F.linear` to the dtype's rounding,
not bit for bit (tests/test_triton_linear.py: norm-relative, fp32 under the interpreter on CPU, bf16 on a GPU).
`benchmarks/decode_kernel_shapes.py` times it beside cuBLAS at each decode shape.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollplex_megatron.attention.triton_decode import INTERPRET
from rollplex_megatron.models.triton_layer import _bits, _exp, _f32, _r32
from rollplex_megatron.models.triton_norm import _cast, _rne_bf16

SMALL_M = 32  # rows up to which the decode step may take these kernels (rollout.decode_gemm)
# small_m_gated's tiling on the decode path: the fastest of decode_kernel_shapes.py's at the 3B's linear_fc1 on an H100
# at batch 8 (32.7 us; cuBLAS then silu_mul 36.5 us; decode_kernel_shapes_h100_d21eb1e.json)
GATED_CONFIG = {"block_n": 32, "block_k": 128, "split_k": 1}


def gemm_config(n: int, k: int) -> dict:
    """small_m_linear's tiling for an [M, k] x [n, k].T GEMM at decode rows (M <= SMALL_M), by shape class, each
    the fastest of `benchmarks/decode_kernel_shapes.py`'s tilings at the 3B's layer of that class on an H100 at
    batch 8 (`decode_kernel_shapes_h100_d21eb1e.json`): a wide output (linear_fc1, the output layer) 64 columns and
    128 of K a program; a long K (linear_fc2) 16 columns, 256 of K, K in two splits; the rest (linear_qkv,
    linear_proj) 16 columns and 256 of K. Two K steps at least a split."""
    if n > 8192:
        return {"block_n": 64, "block_k": 128, "split_k": 1}
    if k > 4096:
        return {"block_n": 16, "block_k": 256, "split_k": max(1, min(2, k // 512))}
    return {"block_n": 16, "block_k": 256, "split_k": 1}


@triton.jit
def _linear_part(x_ptr, w_ptr, m0, n0, k_lo, M, N, stride_xm, stride_wn, K: tl.constexpr, K_PER: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BITS: tl.constexpr):
    # the fp32 sum over k in [k_lo, k_lo + K_PER) and below K of x[m0:m0+BM, k] * w[n0:n0+BN, k]: a [BM, BN] tile
    # (compile-time loop bounds: a model has a handful of K, and runtime ones fail under the interpreter)
    rm = m0 + tl.arange(0, BLOCK_M)
    rn = n0 + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K_PER, BLOCK_K):
        rk = k_lo + k0 + tl.arange(0, BLOCK_K)
        kin = rk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & kin[None, :], other=0.0)
        w = tl.load(w_ptr + rn[None, :] * stride_wn + rk[:, None], mask=(rn[None, :] < N) & kin[:, None], other=0.0)
        if BITS:  # bf16 under the interpreter: its int16 bits widened exactly, the products in fp32
            acc += tl.dot(_f32(x, True), _f32(w, True), input_precision="ieee")
        else:
            acc += tl.dot(x, w, input_precision="ieee")
    return acc


@triton.jit
def _epilogue(acc, b_ptr, y_ptr, m0, n0, M, N, stride_ym, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, RNE: tl.constexpr):
    # the GEMM's result in the output dtype, then the bias added in fp32 and rounded again (megatron's order)
    rm = m0 + tl.arange(0, BLOCK_M)
    rn = n0 + tl.arange(0, BLOCK_N)
    out_dt = y_ptr.dtype.element_ty
    if HAS_BIAS:
        b = tl.load(b_ptr + rn, mask=rn < N, other=0.0)
        y = _cast(_r32(acc, out_dt, RNE) + _f32(b, RNE)[None, :], out_dt, RNE)
    else:
        y = _cast(acc, out_dt, RNE)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _sml_linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, stride_xm, stride_wn, stride_ym, K: tl.constexpr,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   RNE: tl.constexpr, BITS: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    m0 = tl.program_id(1) * BLOCK_M
    acc = _linear_part(x_ptr, w_ptr, m0, n0, 0, M, N, stride_xm, stride_wn, K, K, BLOCK_M, BLOCK_N, BLOCK_K, BITS)
    _epilogue(acc, b_ptr, y_ptr, m0, n0, M, N, stride_ym, HAS_BIAS, BLOCK_M, BLOCK_N, RNE)


@triton.jit
def _sml_split_kernel(x_ptr, w_ptr, ws_ptr, M, N, stride_xm, stride_wn, K: tl.constexpr, K_PER: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BITS: tl.constexpr):
    # split s of column block n: its K range's fp32 partial into ws[s, m, n] ([S, M_pad, N] contiguous)
    n0 = tl.program_id(0) * BLOCK_N
    s = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    m_pad = tl.num_programs(2) * BLOCK_M
    acc = _linear_part(x_ptr, w_ptr, m0, n0, s * K_PER, M, N, stride_xm, stride_wn, K, K_PER,
                       BLOCK_M, BLOCK_N, BLOCK_K, BITS)
    rm = m0 + tl.arange(0, BLOCK_M)
    rn = n0 + tl.arange(0, BLOCK_N)
    tl.store(ws_ptr + (s * m_pad + rm[:, None]) * N + rn[None, :], acc, mask=rn[None, :] < N)


@triton.jit
def _sml_reduce_kernel(ws_ptr, b_ptr, y_ptr, M, N, stride_ym, S: tl.constexpr, HAS_BIAS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RNE: tl.constexpr):
    # the S partials of one [BM, BN] tile summed in split order, then the epilogue
    n0 = tl.program_id(0) * BLOCK_N
    m0 = tl.program_id(1) * BLOCK_M
    m_pad = tl.num_programs(1) * BLOCK_M
    rm = m0 + tl.arange(0, BLOCK_M)
    rn = n0 + tl.arange(0, BLOCK_N)
    acc = _split_sum(ws_ptr, rm, rn, m_pad, N, S, 1, 0, BLOCK_M, BLOCK_N)
    _epilogue(acc, b_ptr, y_ptr, m0, n0, M, N, stride_ym, HAS_BIAS, BLOCK_M, BLOCK_N, RNE)


@triton.jit
def _split_sum(ws_ptr, rm, rn, m_pad, N, S: tl.constexpr, PARTS: tl.constexpr, PART: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # partial `PART` of the [S, PARTS, m_pad, N] fp32 workspace summed over the S splits in split order
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(S):
        acc += tl.load(ws_ptr + ((s * PARTS + PART) * m_pad + rm[:, None]) * N + rn[None, :], mask=rn[None, :] < N,
                       other=0.0)
    return acc


@triton.jit
def _gated_epilogue(acc_g, acc_u, y_ptr, m0, n0, M, F, stride_ym, offset, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, RNE: tl.constexpr, PRECISE: tl.constexpr):
    # fc1's two halves rounded to the dtype as its GEMM output is, then silu_mul's arithmetic (models/triton_layer.py)
    rm = m0 + tl.arange(0, BLOCK_M)
    rn = n0 + tl.arange(0, BLOCK_N)
    dt = y_ptr.dtype.element_ty
    g = _r32(acc_g, dt, RNE)
    u = _r32(acc_u, dt, RNE)
    s = _r32(tl.math.div_rn(g, 1.0 + _exp(-g, PRECISE)), dt, RNE)
    v = _r32(u + offset, dt, RNE)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], _cast(s * v, dt, RNE),
             mask=(rm[:, None] < M) & (rn[None, :] < F))


@triton.jit
def _sml_gated_kernel(x_ptr, w_ptr, y_ptr, M, F, stride_xm, stride_wn, stride_ym, offset, K: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, RNE: tl.constexpr,
                  PRECISE: tl.constexpr, BITS: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    m0 = tl.program_id(1) * BLOCK_M
    acc_g = _linear_part(x_ptr, w_ptr, m0, n0, 0, M, F, stride_xm, stride_wn, K, K, BLOCK_M, BLOCK_N, BLOCK_K, BITS)
    acc_u = _linear_part(x_ptr, w_ptr + F * stride_wn, m0, n0, 0, M, F, stride_xm, stride_wn, K, K, BLOCK_M, BLOCK_N,
                         BLOCK_K, BITS)
    _gated_epilogue(acc_g, acc_u, y_ptr, m0, n0, M, F, stride_ym, offset, BLOCK_M, BLOCK_N, RNE, PRECISE)


@triton.jit
def _sml_gated_split_kernel(x_ptr, w_ptr, ws_ptr, M, F, stride_xm, stride_wn, K: tl.constexpr, K_PER: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BITS: tl.constexpr):
    # split s: both halves' fp32 partials into ws[s, half, m, n] ([S, 2, M_pad, F] contiguous)
    n0 = tl.program_id(0) * BLOCK_N
    s = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    m_pad = tl.num_programs(2) * BLOCK_M
    rm = m0 + tl.arange(0, BLOCK_M)
    rn = n0 + tl.arange(0, BLOCK_N)
    for half in tl.static_range(2):
        acc = _linear_part(x_ptr, w_ptr + half * F * stride_wn, m0, n0, s * K_PER, M, F, stride_xm, stride_wn, K,
                           K_PER, BLOCK_M, BLOCK_N, BLOCK_K, BITS)
        tl.store(ws_ptr + ((s * 2 + half) * m_pad + rm[:, None]) * F + rn[None, :], acc, mask=rn[None, :] < F)


@triton.jit
def _sml_gated_reduce_kernel(ws_ptr, y_ptr, M, F, stride_ym, offset, S: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, RNE: tl.constexpr, PRECISE: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    m0 = tl.program_id(1) * BLOCK_M
    m_pad = tl.num_programs(1) * BLOCK_M
    rm = m0 + tl.arange(0, BLOCK_M)
    rn = n0 + tl.arange(0, BLOCK_N)
    acc_g = _split_sum(ws_ptr, rm, rn, m_pad, F, S, 2, 0, BLOCK_M, BLOCK_N)
    acc_u = _split_sum(ws_ptr, rm, rn, m_pad, F, S, 2, 1, BLOCK_M, BLOCK_N)
    _gated_epilogue(acc_g, acc_u, y_ptr, m0, n0, M, F, stride_ym, offset, BLOCK_M, BLOCK_N, RNE, PRECISE)


def _split_layout(k: int, split_k: int, block_k: int) -> tuple[int, int]:
    """(K columns a split sums, splits): whole BLOCK_K steps a split, at most `split_k` splits covering K (the last
    one may be short)."""
    k_per = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    return k_per, triton.cdiv(k, k_per)


def _block_m(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64


def _check(x: torch.Tensor, weight: torch.Tensor, block_n: int, block_k: int, split_k: int, what: str):
    k = x.shape[-1]
    if weight.dtype != x.dtype:
        raise ValueError(f"{what}: weight {weight.dtype} and input {x.dtype} must share a dtype")
    if weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"{what}: weight {tuple(weight.shape)} (unit column stride) does not take inputs of {k} "
                         f"features")
    for name, v in (("block_n", block_n), ("block_k", block_k)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{what}: {name}={v} must be a power of two >= 16")
    if split_k < 1:
        raise ValueError(f"{what}: split_k={split_k} must be >= 1")
    x2 = x.reshape(-1, k)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, block_n: int = 32,
                   block_k: int = 256, split_k: int = 1, num_warps: int = 4, num_stages: int = 4) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T (+ bias [N]) -> [..., N] in x's dtype, for few rows (see the module doc).

    `block_n` columns and `block_k` of K per step a program; `split_k` programs per column block (1: one kernel,
    > 1: partials and a fixed-order reduce). Powers of two, block_n >= 16 and block_k >= 16 (tl.dot's least tile).
    """
    k, n = x.shape[-1], weight.shape[0]
    x2 = _check(x, weight, block_n, block_k, split_k, "small_m_linear")
    if bias is not None:
        if bias.shape != (n,) or bias.dtype != x.dtype:
            raise ValueError(f"small_m_linear: bias {bias.dtype} {tuple(bias.shape)} must be {x.dtype} ({n},)")
        bias = bias.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    bm = _block_m(m)
    m_blocks = triton.cdiv(m, bm)
    n_blocks = triton.cdiv(n, block_n)
    has_bias = bias is not None
    b = bias if has_bias else y  # never read without HAS_BIAS
    rne = _rne_bf16(y)
    xb, wb, b = _bits(x2), _bits(weight), _bits(b)
    launch = {} if INTERPRET else {"num_warps": num_warps, "num_stages": num_stages}
    if split_k == 1:
        _sml_linear_kernel[(n_blocks, m_blocks)](xb, wb, b, y, m, n, x2.stride(0), weight.stride(0), y.stride(0), k,
                                             has_bias, bm, block_n, block_k, rne, rne, **launch)
    else:
        k_per, splits = _split_layout(k, split_k, block_k)
        ws = torch.empty(splits, m_blocks * bm, n, device=x.device, dtype=torch.float32)
        _sml_split_kernel[(n_blocks, splits, m_blocks)](xb, wb, ws, m, n, x2.stride(0), weight.stride(0), k, k_per,
                                                    bm, block_n, block_k, rne, **launch)
        _sml_reduce_kernel[(n_blocks, m_blocks)](ws, b, y, m, n, y.stride(0), splits, has_bias, bm, block_n, rne,
                                             **({} if INTERPRET else {"num_warps": 4}))
    return y.reshape(*x.shape[:-1], n)


def small_m_gated(x: torch.Tensor, weight: torch.Tensor, offset: float = 0.0, *, block_n: int = 32,
                  block_k: int = 256, split_k: int = 1, num_warps: int = 4, num_stages: int = 4) -> torch.Tensor:
    """megatron's gated MLP input silu(gate) * (up + offset) straight from x [..., K] and linear_fc1's weight
    [2F, K] ([gate | up] rows, no bias): [..., F] in x's dtype. Each program sums both halves' columns of its block,
    rounds them to the dtype as fc1's output is rounded, and applies `silu_mul`'s arithmetic (models/triton_layer.py),
    so it equals `silu_mul(small_m_linear(x, weight), offset)` bit for bit: one launch (two when K is split) in
    place of the GEMM and the activation."""
    k, f2 = x.shape[-1], weight.shape[0]
    if f2 % 2:
        raise ValueError(f"small_m_gated: fc1's weight has {f2} rows, not [gate | up] (odd)")
    x2 = _check(x, weight, block_n, block_k, split_k, "small_m_gated")
    m, f = x2.shape[0], f2 // 2
    y = torch.empty(m, f, device=x.device, dtype=x.dtype)
    bm = _block_m(m)
    m_blocks, n_blocks = triton.cdiv(m, bm), triton.cdiv(f, block_n)
    rne, precise = _rne_bf16(y), not INTERPRET
    launch = {} if INTERPRET else {"num_warps": num_warps, "num_stages": num_stages}
    if split_k == 1:
        _sml_gated_kernel[(n_blocks, m_blocks)](_bits(x2), _bits(weight), y, m, f, x2.stride(0), weight.stride(0),
                                            y.stride(0), float(offset), k, bm, block_n, block_k, rne, precise, rne,
                                            **launch)
    else:
        k_per, splits = _split_layout(k, split_k, block_k)
        ws = torch.empty(splits, 2, m_blocks * bm, f, device=x.device, dtype=torch.float32)
        _sml_gated_split_kernel[(n_blocks, splits, m_blocks)](_bits(x2), _bits(weight), ws, m, f, x2.stride(0),
                                                          weight.stride(0), k, k_per, bm, block_n, block_k, rne,
                                                          **launch)
        _sml_gated_reduce_kernel[(n_blocks, m_blocks)](ws, y, m, f, y.stride(0), float(offset), splits, bm, block_n,
                                                       rne, precise, **({} if INTERPRET else {"num_warps": 4}))
    return y.reshape(*x.shape[:-1], f)
