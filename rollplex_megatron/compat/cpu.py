"""CPU shims for megatron-core 0.16.1, applied only when CUDA is absent.

megatron-core assumes a CUDA device in a handful of places. On a CPU-only machine (CI, laptops) we
redirect exactly those assumptions to the CPU so that megatron's own layers, schedules, P2P, DDP and
optimizer run unmodified over gloo. Each shim names the megatron-core location it works around.
On a machine with CUDA, `apply_cpu_shims()` does nothing.
"""
from __future__ import annotations

import threading

import torch
from torch.overrides import TorchFunctionMode

_LOCK = threading.Lock()
_APPLIED: list[str] = []
_MODE: "_CudaDeviceToCpu | None" = None


class _CudaDeviceToCpu(TorchFunctionMode):
    """Rewrites `device="cuda"` (and `pin_memory=True`) in factory calls to the CPU.

    Works around the `device="cuda"` literals in megatron-core 0.16.1:
    pipeline_parallel/schedules.py:596,983,2138 (`total_num_tokens`), transformer/utils.py:35,40
    (`get_default_causal_mask`, `get_sliding_window_causal_mask`), optimizer/clip_grads.py:90-207,
    optimizer/optimizer.py:473-907 and grad_scaler.py:15-94 (scalar buffers), utils.py:1207.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and str(device).startswith("cuda"):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


def _cpu_current_device() -> str:
    # megatron passes torch.cuda.current_device() as `device=` (rotary_pos_embedding.py inv_freq,
    # utils.GlobalMemoryBuffer.get_tensor, tensor_parallel/mappings.py gathers,
    # pipeline_parallel/p2p_communication.py receive buffers).
    return "cpu"


def _tensor_type_as_cuda(orig):
    # optimizer/optimizer.py and distrib_optimizer.py check `param.type()` against
    # 'torch.cuda.FloatTensor' / 'torch.cuda.BFloat16Tensor'; report CPU tensors under CUDA names.
    def _type(self, dtype=None, non_blocking=False, **kw):
        if dtype is None and not kw:
            name = orig(self)
            if self.device.type == "cpu" and not name.startswith("torch.cuda."):
                return name.replace("torch.", "torch.cuda.", 1)
            return name
        return orig(self, dtype, non_blocking, **kw)

    return _type


def apply_cpu_shims() -> list[str]:
    """Apply the shims once per process when CUDA is unavailable; return the names applied."""
    global _MODE
    if torch.cuda.is_available():
        return []
    with _LOCK:
        if _APPLIED:
            return list(_APPLIED)
        torch.cuda.current_device = _cpu_current_device
        _APPLIED.append("current_device")
        # p2p_communication.py `_communicate_shapes` / `batch_p2p_sync` and timers call
        # torch.cuda.synchronize(); there is nothing to wait for on the CPU.
        torch.cuda.synchronize = lambda *a, **k: None
        _APPLIED.append("synchronize")
        _map_cuda_rng_to_cpu()
        _APPLIED.append("rng")
        torch.Tensor.type = _tensor_type_as_cuda(torch.Tensor.type)
        _APPLIED.append("tensor_type")
        # optimizer/optimizer.py:375-380 and distrib_optimizer.py:1089 call `.cuda()` on tensors.
        torch.Tensor.cuda = lambda self, *a, **k: self
        _APPLIED.append("tensor_cuda")
        _MODE = _CudaDeviceToCpu()
        _MODE.__enter__()
        _APPLIED.append("cuda_device_literals")
    return list(_APPLIED)


def _map_cuda_rng_to_cpu() -> None:
    # tensor_parallel/random.py: CudaRNGStatesTracker forks "CUDA" generators for TP-region init and
    # dropout; model_parallel_cuda_manual_seed() calls torch.cuda.manual_seed. Map all of them to the
    # CPU default generator so seeding and forking are deterministic on CPU.
    import megatron.core.tensor_parallel.random as mrandom

    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, *a, **k: torch.set_rng_state(new_state)


def applied_shims() -> list[str]:
    """Names of the shims applied in this process (empty on CUDA machines)."""
    return list(_APPLIED)
