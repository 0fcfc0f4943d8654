"""The memory this machine has left for a run's plan: a GPU's free memory, or on CPU, where the "device" is host
memory, what the kernel can still give (MemAvailable, within a cgroup v2 limit), shared by the ranks on the host."""
from __future__ import annotations

import math
import os
from pathlib import Path

import torch
import torch.distributed as dist

from rollplex_megatron.dist import train_world
from rollplex_megatron.memory.budget import check_machine, machine_need_gib
from rollplex_megatron.memory.planner import GIB

MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")  # cgroup v2: memory.max and memory.current of this container


def meminfo_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is no such file or line)."""
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the kernel writes kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def cgroup_room() -> int | None:
    """What a cgroup v2 memory limit leaves (memory.max - memory.current; None without a limit)."""
    try:
        limit = (CGROUP / "memory.max").read_text().strip()
        used = int((CGROUP / "memory.current").read_text())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else max(int(limit) - used, 0)


def host_available_bytes() -> int | None:
    """Bytes the host can still give: MemAvailable (else the free pages os.sysconf counts), at most what a
    container's cgroup limit leaves; None where neither can be read."""
    avail = meminfo_available()
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return None
    room = cgroup_room()
    return avail if room is None else min(avail, room)


def free_bytes(local_ranks: int) -> tuple[int | None, str]:
    """(bytes, what they are) this rank's plan may use: its GPU's free memory, or on CPU the host's available
    memory divided among the `local_ranks` processes that share it (None: unknown)."""
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[0], "free GPU memory"
    avail = host_available_bytes()
    share = f", shared by {local_ranks} ranks on this host" if local_ranks > 1 else ""
    return (None if avail is None else avail // local_ranks), f"available host memory{share}"


def batch_text(cfg, source, shape: dict) -> str:
    """The rank's batch in its settings' terms, and what lowers it (for `budget.check_machine`)."""
    length = "task.max_answer_tokens" if source.name == "rendered" else "rollout.max_response_len"
    dp = f" / parallel.dp={cfg.parallel.dp}" if cfg.parallel.dp > 1 else ""
    return (f"a rank's batch is {shape['prompts']} prompts (workload.rollout_batch={cfg.workload.rollout_batch} / "
            f"rollout.group_size={cfg.rollout.group_size}{dp}) x {shape['group']} responses of up to {length}="
            f"{source.max_new_tokens} tokens; lower rollout.group_size, workload.rollout_batch or {length}")


def check_run_fits(cfg, source, plan: dict) -> None:
    """Refuse, before any model is built, a run whose plan (`trainer.runtime.memory_plan`) cannot fit what this
    machine has left: the GPU's free memory, or on CPU the host's available memory shared by its ranks (the
    least over the training ranks, so all of them refuse together; a CPU launcher checks before they start).
    Unknown free memory: no check."""
    cuda = torch.cuda.is_available()
    world = dist.get_world_size() if dist.is_initialized() else cfg.parallel.world_size  # the launcher: its ranks
    free, what = free_bytes(int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    free_gib = torch.tensor([math.inf if free is None else free / GIB], dtype=torch.float64,
                            device="cuda" if cuda else "cpu")
    if dist.is_initialized():  # every rank takes the same decision (the others would wait in a collective)
        dist.all_reduce(free_gib, op=dist.ReduceOp.MIN, group=train_world())
    check_machine(plan, machine_need_gib(plan, cuda), float(free_gib), what, batch_text(cfg, source, plan["shape"]))
