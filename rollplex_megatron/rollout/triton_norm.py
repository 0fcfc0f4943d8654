"""The decode step's RMSNorms as one Triton kernel each, in place of torch's composite RMSNorm.

Legend: T = tokens (rows), H = hidden size.

torch.nn.RMSNorm (megatron's local spec builds it) runs as about seven kernels on CUDA: the fp32
upcast, pow, mean, add, rsqrt, the product, the cast back and the weight product. A decode step has
2 per layer plus the final one (73 at 36 layers), each on [1, B, H]. Here one program per row
does it in registers with the same roundings (fp32 statistics, the normalised row cast to the input
dtype, then the weight product rounded), the mean summed in another order.

`fused_rms_norms(model)` swaps the language model's RMSNorm forwards for the kernel for the duration
of a decode step, on the calling thread only and only for no-grad one-position inputs: side work
of the decode window (other threads, prefix stages with autograd) keeps torch's RMSNorm.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
import triton
import triton.language as tl

from rollplex_megatron.attention.triton_decode import INTERPRET


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, stride_x, stride_y, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    ok = c < n_cols
    x = tl.load(x_ptr + row * stride_x + c, mask=ok, other=0.0).to(tl.float32)
    r = tl.math.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
    dt = y_ptr.dtype.element_ty
    y = (x * r).to(dt).to(tl.float32) * tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + c, y.to(dt), mask=ok)


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of `x` (any leading shape), `weight` [H]; the output in x's dtype."""
    h = x.shape[-1]
    x2 = x.reshape(-1, h)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    _rms_norm_kernel[(x2.shape[0],)](x2, weight, y, x2.stride(0), y.stride(0), h, eps,
                                     BLOCK=triton.next_power_of_2(h))
    return y.view(x.shape)


def _fused_forward(mod: torch.nn.RMSNorm, owner: int):
    eps = mod.eps

    def forward(x):
        if (threading.get_ident() == owner and not torch.is_grad_enabled() and x.dim() == 3 and x.shape[0] == 1
                and mod.weight is not None and (x.is_cuda or INTERPRET)):
            return triton_rms_norm(x, mod.weight, torch.finfo(x.dtype).eps if eps is None else eps)
        return torch.nn.RMSNorm.forward(mod, x)

    return forward


@contextmanager
def fused_rms_norms(module: torch.nn.Module):
    """Within the block, `module`'s RMSNorms run `triton_rms_norm` on this thread's no-grad decode inputs
    ([1, B, H]); everything else (other threads, autograd, longer inputs) runs torch's RMSNorm."""
    norms = [m for m in module.modules() if type(m) is torch.nn.RMSNorm]
    owner = threading.get_ident()
    for m in norms:
        m.forward = _fused_forward(m, owner)
    try:
        yield
    finally:
        for m in norms:
            del m.forward
