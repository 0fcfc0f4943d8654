"""The decode step's per-layer glue as Triton kernels: a residual add with the RMSNorm after it, and the gated
MLP's activation, each with torch's roundings.

Legend: T = rows (every leading dim flattened: the step's samples), H = hidden size, F = the MLP's local
intermediate size (fc1 gives [gate | up], 2F wide).

- `add_rms_norm(x, residual, weight, eps)`: h = x + residual as torch adds (fp32 sum, one rounding to the dtype),
  then y = RMSNorm(h) * weight with the decode norm kernel's arithmetic (`models/triton_norm.py`'s forward: the
  same tile, reduction and roundings), so both outputs are bit-equal to torch's add followed by that kernel. One
  launch in place of megatron's bias-dropout-add (an in-place add) and the norm.
- `silu_mul(fc1, offset)`: megatron's gated activation silu(gate) * (up + offset) (mlp.py `glu`, offset its
  `glu_linear_offset`) from one read of fc1's output, rounding where torch rounds: silu in fp32 (x / (1 + exp(-x)),
  ATen's formula) rounded to the dtype, up + offset rounded, their fp32 product rounded. On CUDA the exp and the
  division are libdevice's expf and the IEEE division, which torch's silu kernel compiles to (Triton's own
  `exp` and `/` are approximations); under the interpreter numpy's, which agree with torch's CPU silu on every
  bf16 input (checked exhaustively) and differ from it in the last fp32 bit on some inputs. One launch in place of
  three (silu, the offset add, the product).

bf16 results are rounded to nearest even by integer operations on every device (`_cast`; see models/triton_rope.py
for why), except the norm's output, which rounds as the decode norm kernel does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollplex_megatron.attention.triton_decode import INTERPRET
from rollplex_megatron.models.triton_norm import _cast, _rne_bf16, _rows, _tile_rows, _warps

SILU_BLOCK = 1024  # columns of one silu_mul program on the GPU (3B: 11 programs a row at F = 11008)


@triton.jit
def _f32(v, BITS: tl.constexpr):
    # Triton's interpreter converts bf16 subnormals to fp32 wrongly (-7.3e-40 reads as -0.0, -1.1e-39 as -5.9e-39);
    # under it bf16 inputs come as their int16 bits (`_bits`) and widen here exactly, as the GPU's conversion does
    if BITS:
        return (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return v.to(tl.float32)


@triton.jit
def _r32(v, dt: tl.constexpr, RNE_BF16: tl.constexpr):
    # v rounded to dt, kept in fp32: `_cast`'s rounding without a trip through the interpreter's bf16 conversion
    if RNE_BF16:
        b = v.to(tl.uint32, bitcast=True)
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
        return tl.where(v != v, v, b.to(tl.float32, bitcast=True))
    else:
        return v.to(dt).to(tl.float32)


@triton.jit
def _add_rms_norm(x_ptr, res_ptr, w_ptr, h_ptr, y_ptr, stride_x, stride_r, stride_h, stride_y, n_rows, n_cols, eps,
                  BLOCK: tl.constexpr, ROWS: tl.constexpr, RNE_ADD: tl.constexpr, RNE_Y: tl.constexpr,
                  BITS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, BLOCK)
    live = rows < n_rows
    ok = live[:, None] & (c < n_cols)[None, :]
    a = _f32(tl.load(x_ptr + rows[:, None] * stride_x + c[None, :], mask=ok, other=0), BITS)
    b = _f32(tl.load(res_ptr + rows[:, None] * stride_r + c[None, :], mask=ok, other=0), BITS)
    x = _r32(a + b, h_ptr.dtype.element_ty, RNE_ADD)
    tl.store(h_ptr + rows[:, None] * stride_h + c[None, :], _cast(x, h_ptr.dtype.element_ty, RNE_ADD), mask=ok)
    # from here `_rms_norm_fwd` of models/triton_norm.py on x (the new residual), expression for expression
    r = tl.math.rsqrt(tl.sum(x * x, 1) / n_cols + eps)
    w = tl.load(w_ptr + c, mask=c < n_cols, other=0.0).to(tl.float32)
    y = _cast(x * r[:, None] * w[None, :], y_ptr.dtype.element_ty, RNE_Y)
    tl.store(y_ptr + rows[:, None] * stride_y + c[None, :], y, mask=ok)


@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    if PRECISE:
        return tl.extra.cuda.libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _silu_mul(x_ptr, y_ptr, stride_x, stride_y, n_cols, offset, BLOCK: tl.constexpr, RNE: tl.constexpr,
              PRECISE: tl.constexpr, BITS: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < n_cols
    g = _f32(tl.load(x_ptr + row * stride_x + c, mask=ok, other=0), BITS)
    u = _f32(tl.load(x_ptr + row * stride_x + n_cols + c, mask=ok, other=0), BITS)
    dt = y_ptr.dtype.element_ty
    s = _r32(tl.math.div_rn(g, 1.0 + _exp(-g, PRECISE)), dt, RNE)
    v = _r32(u + offset, dt, RNE)
    tl.store(y_ptr + row * stride_y + c, _cast(s * v, dt, RNE), mask=ok)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """`x` as the kernels read it: its int16 bits where `_f32` widens them (bf16 under the interpreter)."""
    return x.view(torch.int16) if _rne_bf16(x) else x


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + residual, RMSNorm(x + residual) * weight) over the last dim in one kernel, both of x's shape and dtype;
    `eps` resolved (`models.triton_norm.default_eps`). No autograd (the decode step)."""
    if residual.dtype != x.dtype or residual.shape != x.shape:
        raise ValueError(f"add_rms_norm: residual {residual.dtype} {tuple(residual.shape)} must match x {x.dtype} "
                         f"{tuple(x.shape)}")
    x_TH, r_TH = _rows(x), _rows(residual)
    (t, h), block = x_TH.shape, triton.next_power_of_2(x_TH.shape[1])
    h_TH = torch.empty((t, h), dtype=x.dtype, device=x.device)
    y_TH = torch.empty((t, h), dtype=x.dtype, device=x.device)
    rows = _tile_rows(block)
    bits = _rne_bf16(x_TH)
    _add_rms_norm[(triton.cdiv(t, rows),)](_bits(x_TH), _bits(r_TH), weight, h_TH, y_TH, x_TH.stride(0),
                                           r_TH.stride(0), h_TH.stride(0), y_TH.stride(0), t, h, eps, BLOCK=block,
                                           ROWS=rows, RNE_ADD=x.dtype == torch.bfloat16, RNE_Y=bits, BITS=bits,
                                           num_warps=_warps(block))
    return h_TH.view(x.shape), y_TH.view(x.shape)


def silu_mul(fc1: torch.Tensor, offset: float = 0.0) -> torch.Tensor:
    """silu(gate) * (up + offset) of fc1's output [..., 2F] ([gate | up], megatron's chunk order): [..., F]."""
    f2 = fc1.shape[-1]
    if f2 % 2:
        raise ValueError(f"silu_mul: fc1's output width {f2} is not [gate | up] (odd)")
    f, x_T2F = f2 // 2, _rows(fc1)
    y_TF = torch.empty((x_T2F.shape[0], f), dtype=fc1.dtype, device=fc1.device)
    # the interpreter's cost is per program: one a row there
    block = triton.next_power_of_2(f) if INTERPRET else min(SILU_BLOCK, triton.next_power_of_2(f))
    if y_TF.numel():
        _silu_mul[(x_T2F.shape[0], triton.cdiv(f, block))](_bits(x_T2F), y_TF, x_T2F.stride(0), y_TF.stride(0), f,
                                                           float(offset), BLOCK=block,
                                                           RNE=fc1.dtype == torch.bfloat16, PRECISE=not INTERPRET,
                                                           BITS=_rne_bf16(x_T2F), num_warps=4)
    return y_TF.view(*fc1.shape[:-1], f)
