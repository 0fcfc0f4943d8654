"""The decode step's RMSNorms as one Triton kernel each, in place of torch's composite RMSNorm.

Legend: T = tokens (rows), H = hidden size.

torch.nn.RMSNorm (megatron's local spec builds it) runs as about seven kernels on CUDA beside fp32 weights:
the fp32 upcast, pow, mean, add, rsqrt, the product, the weight product and the cast back. A decode step has
2 per layer plus the final one (73 at 36 layers), each on [1, B, H]; Qwen3 adds its per-head query and key norms
(megatron's `q_layernorm` and `k_layernorm`), 2 per layer on [1, B, N, D]. Here one program per row does it in
registers with the same roundings (`models/triton_norm.py`: fp32 throughout, one cast at the end), the mean
summed in another order.

`fused_rms_norms(model)` swaps the language model's RMSNorm forwards for the kernel for the duration
of a decode step, on the calling thread only and only for no-grad one-position inputs ([1, B, H] or
[1, B, N, D]): side work of the decode window (other threads, prefix stages with autograd) keeps the module's
own forward (torch's RMSNorm, or `FusedRMSNorm` under train.norm_kernel=triton).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

import torch

from rollplex_megatron.attention.triton_decode import INTERPRET
from rollplex_megatron.models.triton_norm import default_eps, triton_rms_norm

__all__ = ["fused_rms_norms", "triton_rms_norm"]


def _fused_forward(mod: torch.nn.RMSNorm, owner: int):
    eps, own = default_eps(mod.eps), type(mod).forward

    def forward(x):
        if (threading.get_ident() == owner and not torch.is_grad_enabled() and x.dim() in (3, 4) and x.shape[0] == 1
                and mod.weight is not None and (x.is_cuda or INTERPRET)):
            return triton_rms_norm(x, mod.weight, eps)
        return own(mod, x)

    return forward


@contextmanager
def fused_rms_norms(module: torch.nn.Module):
    """Within the block, `module`'s RMSNorms (torch's and its subclasses) run `triton_rms_norm` on this
    thread's no-grad decode inputs ([1, B, H], or [1, B, N, D] for per-head norms); everything else (other
    threads, autograd, longer inputs) runs the module's own forward."""
    norms = [m for m in module.modules() if isinstance(m, torch.nn.RMSNorm)]
    owner = threading.get_ident()
    for m in norms:
        m.forward = _fused_forward(m, owner)
    try:
        yield
    finally:
        for m in norms:
            del m.forward
