"""RoPE for the training paths' attention contexts: one Triton kernel per q or k forward and one backward,
with megatron's roundings.

Legend: S = tokens, B = batch, N = heads, D = head dim (rotated in full), F = D // 2.

megatron's unfused rotary (rope_utils `_apply_rotary_pos_emb_bshd`, what the local spec runs without TE)
takes per layer, for q and for k: cos and sin of the fp32 angles and their casts, the rotate-half (chunk,
neg, cat), two products, a sum and a cat: about 10 kernels forward and 8 backward, the angles' cos/sin
computed again in every layer. Under `train.rope_kernel=triton` the model computes the tables once per
forward (`rope_tables`: torch's cos and sin cast to the activations' dtype, as megatron casts them, its
mscale being 1) and leaves them to the attention context, whose `attend` rotates q and k with one kernel
each (`AttentionContext.rotate`). With r() the rounding to x's dtype and every product in fp32 (a product of
two bf16 values is exact there):
- forward: y1 = r(r(x1 c1) - r(x2 s1)), y2 = r(r(x2 c2) + r(x1 s2)), megatron's roundings;
- backward: g1 = r(r(gy1 c1) + r(gy2 s2)), g2 = r(r(gy2 c2) - r(gy1 s1)), what autograd computes through
  megatron's ops (the rotate-half's neg and cat are exact, the two gradients of x add once).
So bf16 results are megatron's bit for bit; fp32 ones can differ by an ulp where the GPU fuses a product
and a sum into one FMA. r() to bf16 is an integer round-to-nearest-even on every device: with Triton's own
fp32 -> bf16 casts the kernel compiled for the H200 was 2e-3 (norm-relative) off megatron in bf16 while the
interpreter was bit-equal (`gpu_rope_norm_tests_761d2f4.txt`); a compiler may narrow trunc(ext(a) * ext(b))
to a bf16 product and contract it with the sum into one FMA, which drops the product's rounding, and bit
operations leave it nothing to narrow.

`train.rope_kernel` (`rope_kernel_for`) picks it; `use_rope_kernel` sets it on a model.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from rollplex_megatron.attention.triton_decode import INTERPRET
from rollplex_megatron.models.triton_norm import _cast
from rollplex_megatron.runtime import kernel_for


@triton.jit
def _r(v, dt: tl.constexpr, RNE_BF16: tl.constexpr):
    return _cast(v, dt, RNE_BF16).to(tl.float32)


@triton.jit
def _rope(x_ptr, c_ptr, s_ptr, y_ptr, stride_xs, stride_xb, stride_xn, stride_cs, stride_cb, n_b, n_heads, half,
          n_items, per_program, BACKWARD: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_F: tl.constexpr,
          RNE_BF16: tl.constexpr):
    # items = (row, head) pairs, row = s * B + b; each program takes `per_program` consecutive ones
    i = tl.program_id(0) * per_program + tl.arange(0, BLOCK_I)[:, None]
    f = tl.arange(0, BLOCK_F)[None, :]
    live = (tl.arange(0, BLOCK_I)[:, None] < per_program) & (i < n_items)
    row, n = i // n_heads, i % n_heads
    s, b = row // n_b, row % n_b
    ok = live & (f < half)
    xa = x_ptr + s * stride_xs + b * stride_xb + n * stride_xn + f
    x1 = tl.load(xa, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(xa + half, mask=ok, other=0.0).to(tl.float32)
    ca = c_ptr + s * stride_cs + b * stride_cb + f
    sa = s_ptr + s * stride_cs + b * stride_cb + f
    c1 = tl.load(ca, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(ca + half, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(sa, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(sa + half, mask=ok, other=0.0).to(tl.float32)
    dt = y_ptr.dtype.element_ty
    if BACKWARD:
        y1 = _r(x1 * c1, dt, RNE_BF16) + _r(x2 * s2, dt, RNE_BF16)
        y2 = _r(x2 * c2, dt, RNE_BF16) - _r(x1 * s1, dt, RNE_BF16)
    else:
        y1 = _r(x1 * c1, dt, RNE_BF16) - _r(x2 * s1, dt, RNE_BF16)
        y2 = _r(x2 * c2, dt, RNE_BF16) + _r(x1 * s2, dt, RNE_BF16)
    ya = y_ptr + i * (2 * half) + f  # y is contiguous [S,B,N,D]: item i starts at i * D
    tl.store(ya, _cast(y1, dt, RNE_BF16), mask=ok)
    tl.store(ya + half, _cast(y2, dt, RNE_BF16), mask=ok)


def _launch(x_SBND: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    if x_SBND.stride(-1) != 1:
        x_SBND = x_SBND.contiguous()
    S, B, N, D = x_SBND.shape
    c, s = cos.expand(S, B, 1, D), sin.expand(S, B, 1, D)  # a batch of 1 broadcast: stride 0
    assert c.stride() == s.stride() and c.stride(-1) == 1, "rope tables: last dim contiguous, cos and sin alike"
    y = torch.empty((S, B, N, D), dtype=x_SBND.dtype, device=x_SBND.device)
    items = S * B * N
    if items:
        # about 64 (row, head) items a program on the GPU; under the interpreter, whose cost is per program,
        # thousands
        per = max(1, (4096 if INTERPRET else 64) // N) * N
        _rope[(triton.cdiv(items, per),)](
            x_SBND, c, s, y, x_SBND.stride(0), x_SBND.stride(1), x_SBND.stride(2), c.stride(0), c.stride(1), B, N,
            D // 2, items, per, BACKWARD=backward, BLOCK_I=triton.next_power_of_2(per),
            BLOCK_F=triton.next_power_of_2(D // 2), RNE_BF16=x_SBND.dtype == torch.bfloat16, num_warps=4)
    return y


class RopeFunction(torch.autograd.Function):
    """y = x cos + rotate_half(x) sin; saves only the tables, which every layer of the forward shares."""

    @staticmethod
    def forward(ctx, x, cos, sin):  # noqa: D102
        ctx.save_for_backward(cos, sin)
        return _launch(x, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, gy):  # noqa: D102
        cos, sin = ctx.saved_tensors
        return _launch(gy, cos, sin, backward=True), None, None


class RopeTables(NamedTuple):
    """One forward's cos and sin [S,B,1,D]; called on q or k [S,B,N,D], `fused_rope` with them."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __call__(self, x_SBND: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return fused_rope(x_SBND, self)


def rope_tables(freqs: torch.Tensor, dtype: torch.dtype) -> RopeTables:
    """megatron's cos_ and sin_ of the angles [S,B,1,D] (fp32), in the activations' dtype, once per forward."""
    return RopeTables(torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype))


def fused_rope(x_SBND: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """megatron's `_apply_rotary_pos_emb_bshd(x, freqs)` (rotate-half, all of D rotated) from `rope_tables`."""
    cos, sin = tables
    if cos.shape[-1] != x_SBND.shape[-1] or x_SBND.shape[-1] % 2:
        raise ValueError(f"fused RoPE rotates the whole head: angles of {cos.shape[-1]} for heads of "
                         f"{x_SBND.shape[-1]}; use train.rope_kernel=torch")
    return RopeFunction.apply(x_SBND, cos.to(x_SBND.dtype), sin.to(x_SBND.dtype))


def use_rope_kernel(model: torch.nn.Module, kernel: str) -> int:
    """Sets `rope_kernel` on every module of `model` that reads it (the language model and the vision
    tower); returns how many."""
    mods = [m for m in model.modules() if hasattr(m, "rope_kernel")]
    for m in mods:
        m.rope_kernel = kernel
    return len(mods)


def rope_kernel_for(kernel: str, device) -> str:
    """`train.rope_kernel` resolved on `device` (`runtime.kernel_for`)."""
    return kernel_for("train.rope_kernel", kernel, device)
