"""GPU-only: the SGLang bridge over real CUDA IPC handles, trainer and (stand-in) scheduler in two processes.

Marked `gpu`: skipped, with a reason, without CUDA (run on the device machine with
`pytest -m gpu tests/test_gpu_sglang_ipc.py`)."""
import pytest
import torch

from rollplex_megatron.dist import run_local
from rollplex_megatron.recipes import load_run_config
from tests import sglang_workers as W

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA: CUDA IPC handles exist only on a GPU", allow_module_level=True)


def test_kv_and_weights_cross_by_cuda_ipc_without_copies():
    r = run_local(W.gpu_ipc, 1, load_run_config(["model=tiny"]))[0]
    assert r["device"].startswith("cuda")
    assert max(r["rel"]) <= 1e-5, max(r["rel"])  # fp32, same kernels on the same GPU
    for alloc, kv in zip(r["allocated"], r["kv_bytes"]):
        assert kv > 0 and alloc < 0.25 * kv, (alloc, kv)  # the received K/V are the scheduler's memory (a copy
        # would allocate at least kv; what remains is the allocator's rounding of small message tensors)


def test_mutation_copying_the_received_kv_is_caught():
    r = run_local(W.gpu_ipc, 1, load_run_config(["model=tiny"]), "copy_kv")[0]
    assert max(r["rel"]) <= 1e-5, max(r["rel"])  # the copies are equal: only the allocation tells them apart
    assert all(alloc >= kv for alloc, kv in zip(r["allocated"], r["kv_bytes"])), (r["allocated"], r["kv_bytes"])
