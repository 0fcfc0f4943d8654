"""A stream on a green context that owns a disjoint set of SMs (CUDA driver API via cuda-bindings).

torch's own `GreenContext.create(num_sms=k)` partitions all start at the same SMs, so two of them
overlap (docs/design.md §6). Here one `cuDevSmResourceSplitByCount` splits the device's SMs into a
group of at least `num_sms` and the remainder; the group gets a green context and a non-blocking
stream, wrapped as a `torch.cuda.ExternalStream`. Kernels launched on that stream run on the
group's SMs only. GPU machines only (cuda-bindings is not installed on CPU machines).
"""
from __future__ import annotations

from functools import lru_cache

import torch


def _check(ret):
    err, *rest = ret if isinstance(ret, tuple) else (ret,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return rest[0] if len(rest) == 1 else tuple(rest)


@lru_cache(maxsize=None)
def green_stream(num_sms: int) -> torch.cuda.ExternalStream:
    """A stream whose kernels run on a green context of >= `num_sms` SMs (cached per size)."""
    try:
        import cuda.bindings.driver as drv
    except ImportError as e:  # pragma: no cover - CPU machines
        raise RuntimeError("mode.window=green needs the cuda-bindings package (GPU machines)") from e
    torch.cuda.init()
    _check(drv.cuInit(0))
    dev = _check(drv.cuDeviceGet(torch.cuda.current_device()))
    sm = _check(drv.cuDeviceGetDevResource(dev, drv.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
    if not 0 < num_sms < sm.sm.smCount:
        raise ValueError(f"mode.window_green_sms must be in 1..{sm.sm.smCount - 1}, got {num_sms}")
    groups, _, _rest = _check(drv.cuDevSmResourceSplitByCount(1, sm, 0, num_sms))
    desc = _check(drv.cuDevResourceGenerateDesc([groups[0]], 1))
    ctx = _check(drv.cuGreenCtxCreate(desc, dev, drv.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM))
    stream = _check(drv.cuGreenCtxStreamCreate(ctx, drv.CUstream_flags.CU_STREAM_NON_BLOCKING, 0))
    green_stream.contexts = getattr(green_stream, "contexts", []) + [ctx]  # keep the context alive
    return torch.cuda.ExternalStream(int(stream))
