"""torch.distributed + megatron parallel state, and running a function in N local processes.

`run_local` is the one multi-process helper (tests and CLI commands use it when not under
torchrun): spawn N processes, free port, gloo on CPU / NCCL on GPU, collect each rank's return
value, re-raise the first failure with its traceback.
"""
from __future__ import annotations

import os
import socket
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rollplex_megatron.compat import apply_cpu_shims, quiet_known_warnings


def under_torchrun() -> bool:
    """True when launched by torchrun (or any launcher that sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_parallel(tp: int = 1, pp: int = 1, seed: int = 1234, backend: str = "auto") -> None:
    """Initialise torch.distributed from the environment and megatron's model-parallel groups."""
    apply_cpu_shims()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % (tp * pp):
        raise ValueError(
            f"world size {world} is not divisible by parallel.tp*parallel.pp = {tp}*{pp}; launch "
            f"tp*pp*dp processes")
    if not dist.is_initialized():
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        dist.init_process_group(backend, timeout=timedelta(minutes=10))
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def destroy_parallel() -> None:
    """Tear down megatron's groups and the process group."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    """A TCP port free on the loopback interface right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn, args, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    quiet_known_warnings()
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        result = {"ok": True, "value": fn(*args)}
    except BaseException:  # noqa: BLE001 - the parent re-raises with this traceback
        result = {"ok": False, "error": traceback.format_exc()}
    torch.save(result, path)
    if dist.is_initialized():
        dist.destroy_process_group()
    if not result["ok"]:
        raise SystemExit(1)


class LocalRunError(RuntimeError):
    """A rank of `run_local` failed; the message holds its traceback."""


def run_local(fn, world_size: int, *args) -> list:
    """Run `fn(*args)` in `world_size` fresh processes; return the per-rank results (rank order).

    `fn` must be importable (module level). Each process sees RANK/WORLD_SIZE/MASTER_* like
    under torchrun, so `fn` calls `init_parallel(...)` itself.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.get_context("spawn")
        port = free_port()
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, out_dir))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        results = []
        for r in range(world_size):
            path = os.path.join(out_dir, f"rank{r}.pt")
            if not os.path.exists(path):
                raise LocalRunError(f"rank {r} died without a result (exit code {procs[r].exitcode})")
            res = torch.load(path, weights_only=False)
            if not res["ok"]:
                raise LocalRunError(f"rank {r} failed:\n{res['error']}")
            results.append(res["value"])
        return results
