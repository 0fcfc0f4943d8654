"""Foreach versions of megatron-core's local multi-tensor fallbacks, used by its optimizer when neither
transformer-engine nor apex is installed (megatron-core 0.16.1: utils.py:1200-1215, read by
optimizer/clip_grads.py and optimizer/optimizer.py).

megatron's local l2 norm builds `torch.tensor(list of per-tensor norms)`: on CUDA that reads every norm back to the
host, one device synchronisation per parameter tensor (hundreds per optimizer step at 3B); its local scale runs two
kernels per tensor. The versions here take the same per-tensor norms (`torch._foreach_norm`) and combine them on
the device, and scale or copy a whole list with foreach ops: no host read, and bit for bit megatron's result on
CPU (tests/test_optim_fallbacks.py). On CUDA the per-tensor norms come from a multi-tensor kernel whose reduction
order may differ from `torch.norm`'s, and they are combined on the device where megatron combines them on the host:
either may change the last bits of the gradient norm. With transformer-engine or apex
installed megatron uses their fused kernels and nothing is replaced.
"""
from __future__ import annotations

import torch


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for megatron's `local_multi_tensor_l2_norm`: the l2 norm of every tensor of `tensor_lists[0]`
    together, as a float32 tensor [1] on their device (no host read); 0 for no tensors, as megatron's."""
    if not tensor_lists[0]:
        return torch.zeros(1, dtype=torch.float32, device="cuda" if torch.cuda.is_available() else "cpu"), None
    norms = torch._foreach_norm(tensor_lists[0])  # in the tensors' dtype, combined in it too (as megatron does)
    return torch.linalg.vector_norm(torch.stack(norms)).float().reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """Drop-in for megatron's `local_multi_tensor_scale`: `dst = src * scale` over the lists, each result cast to
    its destination's dtype (a plain copy when `scale` is 1).

    Gradient clipping passes the gradients as both lists: they are scaled in place, holding no second copy of
    them (megatron's loop holds one tensor's worth; an out-of-place foreach product would hold all of them)."""
    src, dst = list(tensor_lists[0]), list(tensor_lists[1])
    if not src:
        return
    if len(src) == len(dst) and all(d is s for s, d in zip(src, dst)):
        if scale == 1.0:
            return
        if all(t.dtype == torch.float32 for t in dst):
            torch._foreach_mul_(dst, scale)
        else:  # per tensor: the rounding of `src * scale` in its own dtype, as megatron's
            for t in dst:
                t.mul_(scale)
        return
    torch._foreach_copy_(dst, src if scale == 1.0 else torch._foreach_mul(src, scale))


def use_foreach_fallbacks() -> list[str]:
    """Replace megatron's local fallbacks (only those) in its optimizer modules; the names replaced."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    done = []
    for mod in (clip_grads, optimizer):
        if getattr(mod, "l2_norm_impl", None) is utils.local_multi_tensor_l2_norm:
            mod.l2_norm_impl = foreach_l2_norm
            done.append(f"{mod.__name__}.l2_norm_impl")
        if getattr(mod, "multi_tensor_scale_impl", None) is utils.local_multi_tensor_scale:
            mod.multi_tensor_scale_impl = foreach_scale
            done.append(f"{mod.__name__}.multi_tensor_scale_impl")
    return done
