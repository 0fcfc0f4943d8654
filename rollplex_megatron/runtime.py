"""Runtime helpers every command, test and benchmark shares: the compute device, device sync, DDP
wrapping, and the environment record written next to every result."""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
import threading
from contextlib import contextmanager
from pathlib import Path

import megatron.core
import torch
import transformers
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig


def device():
    """This process's compute device: the current CUDA device, else "cpu"."""
    return torch.cuda.current_device() if torch.cuda.is_available() else "cpu"


def kernel_for(setting: str, kernel: str, dev) -> str:
    """A kernel switch (`train.logprob_kernel`, `train.norm_kernel`: auto | triton | torch) resolved on `dev`:
    `auto` is the Triton kernel on CUDA and the torch path elsewhere; `triton` needs CUDA or TRITON_INTERPRET=1
    (the kernels under Triton's interpreter: CPU tests)."""
    if kernel not in ("auto", "triton", "torch"):
        raise ValueError(f"{setting} must be auto, triton or torch, got {kernel!r}")
    on_cuda = torch.device(dev).type == "cuda"
    if kernel == "triton" and not on_cuda:
        from rollplex_megatron.attention import triton_decode

        if not triton_decode.INTERPRET:
            raise ValueError(f"{setting}=triton needs a CUDA device (or TRITON_INTERPRET=1); use auto or torch")
    return "triton" if kernel == "triton" or (kernel == "auto" and on_cuda) else "torch"


def sync() -> None:
    """Wait for the device (a no-op on CPU): phase timings and host reads need it."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def tensors_key(module) -> tuple:
    """A module's parameters and buffers by address, dtype and shape: a CUDA graph captured over the module
    stays valid only while this is unchanged (a reloaded or re-resided weight gets a new address)."""
    return tuple((t.data_ptr(), t.dtype, tuple(t.shape)) for t in (*module.parameters(), *module.buffers()))


_CAPTURE = threading.local()  # .constants: the host tensors the CUDA graph being captured on this thread copies


def host_constant(t: torch.Tensor, dev) -> torch.Tensor:
    """`t` (a host tensor planned from host values: an index, a rotary table) on `dev` (None: where it is).
    Outside a CUDA graph capture this is `t.to(dev)`. Inside one (`capture_constants`) the copy is recorded from a
    pinned host copy that the capture keeps alive, so every replay reads the same constant (a pageable copy cannot
    be captured)."""
    if dev is None or not (torch.device(dev).type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return t.to(dev)
    keep = getattr(_CAPTURE, "constants", None)
    if keep is None:
        raise RuntimeError("host_constant: a host-to-device copy inside a CUDA graph capture needs "
                           "runtime.capture_constants() around the capture (it keeps the pinned source alive)")
    pinned = t.pin_memory()
    keep.append(pinned)
    return pinned.to(dev, non_blocking=True)


@contextmanager
def capture_constants():
    """Around a CUDA graph capture on this thread: yields the list of pinned host tensors the captured copies of
    `host_constant` read; the caller keeps it as long as it keeps the graph."""
    keep: list[torch.Tensor] = []
    _CAPTURE.constants = keep
    try:
        yield keep
    finally:
        _CAPTURE.constants = None


def wrap_ddp(model):
    """megatron DDP around the model (grad reduction in finalize_model_grads, no overlap, so the
    DP reduction sees the prefix gradients that arrive after the schedule)."""
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                            use_distributed_optimizer=False)
    return DistributedDataParallel(config=model.config, ddp_config=ddp_cfg, module=model)


def _transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401  (only whether it is installed is recorded)
    except ImportError:
        return False
    return True


CUDA_ENV = ("CUDA_DEVICE_MAX_CONNECTIONS", "PYTORCH_CUDA_ALLOC_CONF")
ALLOCATOR_DEFAULT = "expandable_segments:True"
_DEFAULTED = "ROLLPLEX_ALLOCATOR_DEFAULTED"  # marks PYTORCH_CUDA_ALLOC_CONF as ours, not the user's


def allocator_default() -> None:
    """torch's CUDA allocator with expandable segments unless the user set PYTORCH_CUDA_ALLOC_CONF (every command,
    before any CUDA work, so every rank, local or torchrun's, inherits it): the memory plan frees and reallocates
    GiB-sized classes every step, and the default allocator keeps the freed ranges as reserved fragments that a
    cap counts (docs/concepts/memory.md)."""
    if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATOR_DEFAULT
        os.environ[_DEFAULTED] = "1"


def drop_allocator_default() -> None:
    """Undo `allocator_default` (a user's own setting stays): rollout.engine=sglang, whose memory saver refuses
    expandable segments and whose scheduler maps the trainer's parameters over CUDA IPC. Before any CUDA work."""
    if os.environ.pop(_DEFAULTED, None):
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)


def environment_record() -> dict:
    """Device, versions, commit and date, for every result this project writes."""
    root = Path(__file__).resolve().parent.parent
    commit = os.environ.get("ROLLPLEX_COMMIT")  # set by benchmark scripts where .git does not travel
    try:
        commit = commit or subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                                          text=True, timeout=10).stdout.strip() or None
    except OSError:
        commit = None
    cuda = torch.cuda.is_available()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "device": torch.cuda.get_device_name() if cuda else f"cpu ({platform.processor() or platform.machine()})",
        "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None, "megatron_core": megatron.core.__version__,
        "transformers": transformers.__version__, "transformer_engine": _transformer_engine(),
        "layer_spec": "megatron-core local spec + SDPA core attention",
        # read when CUDA starts: how many hardware queues the streams share, and the allocator's settings
        "cuda_env": {k: os.environ.get(k) for k in CUDA_ENV},
    }
