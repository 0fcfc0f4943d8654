"""RMSNorm as one Triton kernel forward and one (plus a column sum) backward, with torch's roundings.

Legend: T = rows (tokens or patches, every leading dim flattened), H = the normalised width, P = backward
programs.

megatron's local spec builds `torch.nn.RMSNorm` with fp32 weights; beside bf16 activations torch cannot use
its fused kernel and runs the composite (torch/nn/functional.py `rms_norm`, ATen's `rms_norm_composite`):
about 9 kernels forward and 12 backward per norm on CUDA, and it saves the fp32 input, the fp32
normalised row and the rsqrt. Here, with the composite's roundings (fp32 throughout, one cast at the end):
- forward: r = rsqrt(sum(xf * xf) / H + eps); y = ((xf * r) * w) cast to x's dtype, xf = x in fp32;
- backward: gn = gyf * w; gr = sum(gn * xf); gx = gn * r - ((gr * r^3) / H) * xf, cast to x's dtype;
  gw = the sum over rows of gyf * (xf * r), fp32 partial sums per program, added up by torch.
The sums run in another order than torch's, so r (and through it y and gx) can differ by an ulp; the
elementwise steps are torch's (rsqrt backward's -0.5 and pow backward's 2 are exact and cancel). Saved for
backward: x in its own dtype and one fp32 r per row.

`train.norm_kernel` (`norm_kernel_for`) picks it; `use_norm_kernel` puts `FusedRMSNorm` in place of a
model's RMSNorms. The decode step's context (rollout/triton_norm.py) runs the same forward kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollplex_megatron.attention.triton_decode import INTERPRET
from rollplex_megatron.runtime import kernel_for

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # fp32 math; other inputs keep torch's module


@triton.jit
def _cast(v, dt: tl.constexpr, RNE_BF16: tl.constexpr):
    # Triton's interpreter truncates fp32 -> bf16 (triton/runtime/interpreter.py `cast_impl`), where CUDA's
    # conversion rounds to nearest even; under the interpreter bf16 results are rounded here as the GPU does
    if RNE_BF16:
        b = v.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        # a NaN whose payload would carry into the exponent stays a NaN (the carry would make it inf)
        return tl.where(v != v, v.to(tl.bfloat16), b.to(tl.uint16).to(tl.bfloat16, bitcast=True))
    return v.to(dt)


@triton.jit
def _rms_norm_fwd(x_ptr, w_ptr, y_ptr, rstd_ptr, stride_x, stride_y, n_rows, n_cols, eps, BLOCK: tl.constexpr,
                  ROWS: tl.constexpr, STORE_RSTD: tl.constexpr, RNE_BF16: tl.constexpr, GROUP: tl.constexpr = 1):
    # input row i sits at (i // GROUP) * stride_x + (i % GROUP) * n_cols: GROUP rows of a group back to back
    # (a KV group's query heads inside linear_qkv's output), groups stride_x apart; GROUP = 1 is a plain stride
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, BLOCK)
    live = rows < n_rows
    ok = live[:, None] & (c < n_cols)[None, :]
    at = (rows // GROUP) * stride_x + (rows % GROUP) * n_cols
    x = tl.load(x_ptr + at[:, None] + c[None, :], mask=ok, other=0.0).to(tl.float32)
    r = tl.math.rsqrt(tl.sum(x * x, 1) / n_cols + eps)
    w = tl.load(w_ptr + c, mask=c < n_cols, other=0.0).to(tl.float32)
    y = _cast(x * r[:, None] * w[None, :], y_ptr.dtype.element_ty, RNE_BF16)
    tl.store(y_ptr + rows[:, None] * stride_y + c[None, :], y, mask=ok)
    if STORE_RSTD:
        tl.store(rstd_ptr + rows, r, mask=live)


@triton.jit
def _rms_norm_bwd(gy_ptr, x_ptr, w_ptr, rstd_ptr, gx_ptr, gw_ptr, stride_gy, stride_x, stride_gx, n_rows, n_cols,
                  BLOCK: tl.constexpr, ROWS: tl.constexpr, TILES: tl.constexpr, RNE_BF16: tl.constexpr):
    c = tl.arange(0, BLOCK)
    w = tl.load(w_ptr + c, mask=c < n_cols, other=0.0).to(tl.float32)
    gw = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(TILES):  # a program's TILES x ROWS rows; the last program's are ragged (rows past T load 0)
        rows = (tl.program_id(0) * TILES + i) * ROWS + tl.arange(0, ROWS)
        ok = (rows < n_rows)[:, None] & (c < n_cols)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + c[None, :], mask=ok, other=0.0).to(tl.float32)
        gy = tl.load(gy_ptr + rows[:, None] * stride_gy + c[None, :], mask=ok, other=0.0).to(tl.float32)
        r = tl.load(rstd_ptr + rows, mask=rows < n_rows, other=0.0)[:, None]
        gw += tl.sum(gy * (x * r), 0)
        gn = gy * w[None, :]
        gr = tl.sum(gn * x, 1)[:, None]
        gx = gn * r - (gr * (r * r * r) / n_cols) * x
        tl.store(gx_ptr + rows[:, None] * stride_gx + c[None, :], _cast(gx, gx_ptr.dtype.element_ty, RNE_BF16),
                 mask=ok)
    tl.store(gw_ptr + tl.program_id(0) * n_cols + c, gw, mask=c < n_cols)


def _warps(block: int) -> int:
    """Warps per program: Triton's layer-norm tutorial's rule (one per 256 columns, 1 to 8); not tuned."""
    return min(max(block // 256, 1), 8)


def _tile_rows(block: int) -> int:
    """Rows per tile: a tile of about 4096 columns' worth (one row at H >= 4096, 64 at H = 64)."""
    return max(1, min(64, 4096 // block))


def _rne_bf16(x: torch.Tensor) -> bool:
    return INTERPRET and not x.is_cuda and x.dtype == torch.bfloat16


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`x` as [T, H] with unit column stride (a copy only when its last dim is strided or it cannot be viewed)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _forward(x_TH: torch.Tensor, weight: torch.Tensor, eps: float, rstd: bool, group: int = 1,
             group_stride: int | None = None):
    """The kernel on rows [T, H] (`x_TH`'s rows, or from its first row on groups of `group` contiguous rows
    `group_stride` apart); y is a new contiguous [T, H]."""
    (t, h), block = x_TH.shape, triton.next_power_of_2(x_TH.shape[1])
    y_TH = torch.empty(x_TH.shape, dtype=x_TH.dtype, device=x_TH.device)
    r_T = torch.empty(t, dtype=torch.float32, device=x_TH.device) if rstd else y_TH
    rows = _tile_rows(block)
    stride = x_TH.stride(0) if group_stride is None else group_stride
    _rms_norm_fwd[(triton.cdiv(t, rows),)](x_TH, weight, y_TH, r_T, stride, y_TH.stride(0), t, h, eps,
                                            BLOCK=block, ROWS=rows, STORE_RSTD=rstd, RNE_BF16=_rne_bf16(x_TH),
                                            GROUP=group, num_warps=_warps(block))
    return y_TH, (r_T if rstd else None)


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of `x` (any leading shape), `weight` [H], without autograd; x's dtype."""
    return _forward(_rows(x), weight, eps, rstd=False)[0].view(x.shape)


def triton_rms_norm_grouped(x_GRD: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of `x_GRD` [..., R, D], a view whose R rows of D are contiguous within each
    leading index and whose leading indices are evenly strided (the queries of each KV group inside
    linear_qkv's output), without autograd and without gathering the rows first: a new contiguous tensor of
    x's shape with `triton_rms_norm`'s values (the same kernel and tile, so the same bits)."""
    *lead, r, d = x_GRD.shape
    if x_GRD.stride(-1) != 1 or x_GRD.stride(-2) != d:
        raise ValueError(f"triton_rms_norm_grouped: rows must be contiguous within a group, strides {x_GRD.stride()}")
    groups = x_GRD.flatten(0, -3) if lead else x_GRD.unsqueeze(0)  # a view: the leading dims are evenly strided
    rows_TD = groups.as_strided((groups.shape[0] * r, d), (d, 1))  # the pointer and widths only; rows come by group
    return _forward(rows_TD, weight, eps, rstd=False, group=r, group_stride=groups.stride(0))[0].view(x_GRD.shape)


def _programs(rows: int, dev: torch.device) -> int:
    """Backward programs: a few per SM on CUDA (each sums its rows' gw), few under the interpreter."""
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 2
    return max(1, min(rows, 4 * sms))


class RMSNormFunction(torch.autograd.Function):
    """y = RMSNorm(x) * weight with the fused kernels; saves x (its dtype) and r (fp32 per row)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float):  # noqa: D102
        x_TH = _rows(x)
        y_TH, r_T = _forward(x_TH, weight, eps, rstd=True)
        ctx.save_for_backward(x_TH, weight, r_T)
        ctx.shape = x.shape
        return y_TH.view(x.shape)

    @staticmethod
    def backward(ctx, gy: torch.Tensor):  # noqa: D102
        x_TH, weight, r_T = ctx.saved_tensors
        gy_TH = _rows(gy)
        (t, h), block = x_TH.shape, triton.next_power_of_2(x_TH.shape[1])
        rows = _tile_rows(block)
        # tiles per program a power of two (a constexpr: a few compiled variants, not one per row count)
        tiles = triton.next_power_of_2(triton.cdiv(triton.cdiv(t, rows), _programs(t, x_TH.device)))
        p = triton.cdiv(t, rows * tiles)
        gx_TH = torch.empty_like(x_TH)
        gw_PH = torch.empty(p, h, dtype=torch.float32, device=x_TH.device)
        _rms_norm_bwd[(p,)](gy_TH, x_TH, weight, r_T, gx_TH, gw_PH, gy_TH.stride(0), x_TH.stride(0),
                            gx_TH.stride(0), t, h, BLOCK=block, ROWS=rows, TILES=tiles, RNE_BF16=_rne_bf16(x_TH),
                            num_warps=_warps(block))
        gw = gw_PH.sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return gx_TH.view(ctx.shape), gw, None


def default_eps(eps: float | None) -> float:
    """torch.nn.RMSNorm's epsilon: `eps`, or with eps=None the fp32 machine epsilon (the composite's compute
    dtype for fp32, bf16 and fp16 inputs: torch 2.13 on CPU, checked against torch's output)."""
    return torch.finfo(torch.float32).eps if eps is None else eps


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float | None) -> torch.Tensor:
    """RMSNorm of `x` over its last dim with the fused kernels (autograd through `RMSNormFunction`)."""
    return RMSNormFunction.apply(x, weight, default_eps(eps))


class FusedRMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm whose forward is the fused kernel for every input (any thread or shape) of a dtype it
    handles on CUDA or under the interpreter: `fused_rms_norm` where autograd records, `triton_rms_norm`
    (no rstd written) where it does not; otherwise torch's forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        if x.dtype not in KERNEL_DTYPES or not (x.is_cuda or INTERPRET):
            return super().forward(x)
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return fused_rms_norm(x, self.weight, self.eps)
        return triton_rms_norm(x, self.weight, default_eps(self.eps))  # nothing to save: no rstd written

    @classmethod
    def taking_over(cls, norm: torch.nn.RMSNorm) -> "FusedRMSNorm":
        """A FusedRMSNorm with `norm`'s settings and its very Parameter (nothing allocated, hooks not copied)."""
        new = cls(norm.normalized_shape, norm.eps, elementwise_affine=True, device="meta")
        new.weight = norm.weight
        new.train(norm.training)
        return new


def use_norm_kernel(model: torch.nn.Module, kernel: str) -> int:
    """With `kernel` "triton", replace every affine torch.nn.RMSNorm in `model` by a FusedRMSNorm holding
    the same Parameter (call before DDP or an optimizer wraps it); "torch" leaves the model. Returns the
    count replaced. `kernel` is resolved already (`norm_kernel_for`)."""
    if kernel == "torch":
        return 0
    if kernel != "triton":
        raise ValueError(f"use_norm_kernel: kernel must be triton or torch (resolved), got {kernel!r}")
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.RMSNorm and child.weight is not None:
                setattr(parent, name, FusedRMSNorm.taking_over(child))
                n += 1
    return n


def norm_kernel_for(kernel: str, device) -> str:
    """`train.norm_kernel` resolved on `device`: `auto` is the fused kernel on CUDA and torch's RMSNorm
    elsewhere (`runtime.kernel_for`)."""
    return kernel_for("train.norm_kernel", kernel, device)
