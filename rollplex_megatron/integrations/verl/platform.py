"""A CPU platform for verl (`VERL_PLATFORM=cpu`, or detected where no accelerator exists).

verl 0.9.1 has no CPU platform: without an accelerator it falls back to `nvidia` (device `cuda`, backend `nccl`).
This one says device `cpu`, backend `gloo` and Ray resource `GPU` (verl's resource pools ask for that resource per
rank: start Ray with `ray_kwargs.ray_init.num_gpus=<ranks>`, and `num_cpus` of at least 3 per rank, the CPU
bundle verl's placement groups take). Two shims make verl's device calls run on CPU torch:
- `CpuDeviceModule`: `torch.cpu` with the calls verl makes on `torch.cuda` that `torch.cpu` lacks (memory
  statistics read 0, `empty_cache` and `ipc_collect` do nothing, the RNG state is the CPU generator's);
- verl's process-group string `cpu:gloo,{device}:{backend}` names `cpu` twice here, which torch refuses: while
  this platform is active, `torch.distributed.init_process_group` drops a repeated device type (first wins).
Registered from the plugin entry point; auto-detection probes verl's own platforms first, and this one claims a
host only when no NVIDIA, AMD or Ascend device is visible (`is_platform_available`).
"""
from __future__ import annotations

import functools
import os
import shutil
import types
from contextlib import contextmanager

import torch
import torch.distributed as dist
from verl.plugin.platform import PlatformBase, PlatformRegistry

NAME = "cpu"
ACCELERATOR_TOOLS = ("nvidia-smi", "rocm-smi", "npu-smi")  # a host with one of these has an accelerator


class CpuDeviceModule(types.ModuleType):
    """`torch.cpu` plus the `torch.cuda` calls verl makes that `torch.cpu` lacks (no-ops or CPU equivalents)."""

    def __init__(self):
        super().__init__("rollplex_cpu_device")

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def empty_cache() -> None:
        """Nothing cached: a no-op."""

    @staticmethod
    def ipc_collect() -> None:
        """No IPC handles: a no-op."""

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        """No statistics kept: a no-op."""

    @staticmethod
    def set_per_process_memory_fraction(fraction, device=None) -> None:
        """No device memory: a no-op."""

    @staticmethod
    def memory_allocated(device=None) -> int:
        """Device bytes allocated: none on CPU."""
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    @staticmethod
    def mem_get_info(device=None) -> tuple[int, int]:
        """(free, total) host bytes, as verl's memory logs read them."""
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        free = os.sysconf("SC_AVPHYS_PAGES") * size
        return free, pages * size

    @staticmethod
    def get_device_name(device=None) -> str:
        return "cpu"

    @staticmethod
    def get_rng_state(device=None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state, device=None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed


def unique_backend(backend):
    """A `device:backend,...` string with each device type once (the first mapping wins); others unchanged."""
    if not isinstance(backend, str) or ":" not in backend:
        return backend
    seen: dict[str, str] = {}
    for part in backend.split(","):
        device, _, name = part.partition(":")
        seen.setdefault(device.strip(), name.strip())
    return ",".join(f"{d}:{b}" for d, b in seen.items())


def _patch_init_process_group() -> None:
    """Install once: `init_process_group` with the backend string's repeated device types dropped."""
    fn = dist.init_process_group
    if getattr(fn, "_rollplex_unique_backend", False):
        return

    @functools.wraps(fn)
    def init_process_group(backend=None, *args, **kwargs):
        return fn(unique_backend(backend), *args, **kwargs)

    init_process_group._rollplex_unique_backend = True
    dist.init_process_group = init_process_group


class PlatformCPU(PlatformBase):
    """verl's platform interface on CPU torch (see the module docstring)."""

    def __init__(self):
        self._device_module = CpuDeviceModule()
        _patch_init_process_group()

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return self._device_module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        """Only where no accelerator is visible to torch or its vendor's tool."""
        npu = getattr(torch, "npu", None)
        if torch.cuda.is_available() or (npu is not None and npu.is_available()):
            return False
        return not any(shutil.which(tool) for tool in ACCELERATOR_TOOLS)

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        """One CPU device: nothing to select."""

    def synchronize(self, device_index=None) -> None:
        """CPU work is synchronous."""

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        """No device allocator."""

    def empty_cache(self) -> None:
        """No device cache."""

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"  # what Ray sets for its `GPU` resource

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        """No device profiler."""

    def profiler_stop(self) -> None:
        """No device profiler."""

    def ray_resource_name(self) -> str:
        return "GPU"  # verl's pools ask for it per rank; ray.init(num_gpus=N) on a CPU host provides it

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None


def register() -> None:
    """Idempotent: `PlatformRegistry.register` replaces a name's class (here with the same one)."""
    if PlatformRegistry.get(NAME) is not PlatformCPU:
        PlatformRegistry.register(platform=NAME)(PlatformCPU)
