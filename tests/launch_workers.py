"""Rank functions for the launcher tests (importable for spawn)."""
from __future__ import annotations

import os
import signal
import time


def one_fails_one_ignores_sigterm() -> None:
    """Rank 0 fails at once; rank 1 ignores SIGTERM and would wait a minute (a rank stuck in a
    collective with the dead one, whose trainer treats SIGTERM as "stop after this step")."""
    if int(os.environ["RANK"]) == 0:
        raise RuntimeError("rank 0 broke")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(60)


def environment_and_threads(name: str) -> tuple[str | None, str, int]:
    """What a worker sees: the variable `name`, its RANK, and torch's intra-op threads."""
    import torch

    return os.environ.get(name), os.environ["RANK"], torch.get_num_threads()


def leave_after_the_last_rank(late_s: float) -> dict:
    """Each rank initialises the process group and megatron's groups, rank 1 arrives `late_s` late at
    `dist.leave_torchrun`; times of arrival and return, and what is left initialised after it."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from rollplex_megatron.dist import init_parallel, leave_torchrun

    init_parallel(1, 1, 0, "gloo")
    dist.barrier()  # both ranks set up: from here only rank 1's sleep separates their arrivals
    if int(os.environ["RANK"]) == 1:
        time.sleep(late_s)
    arrived = time.time()
    leave_torchrun()
    return {"arrived": arrived, "left": time.time(), "dist": dist.is_initialized(),
            "megatron": ps.model_parallel_is_initialized()}
