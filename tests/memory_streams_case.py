"""A memory manager over synthetic classes for the copy-stream GPU test and benchmark: fp32 "master weights"
(released outside the optimizer phase) and a read-only "reference" (resident in rollplex's reference phases),
on the real `MemoryManager` with `memory.copy_streams` 1 or 2 (and `ahead`: classes brought back a phase early)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from rollplex_megatron.memory.manager import MemoryManager


def manager(copy_streams: int, main_gib: float, ref_gib: float, pieces: int = 4, seed: int = 0,
            ahead: dict | None = None):
    """(manager, main tensors, reference tensors) on the current CUDA device, random values."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n_main, n_ref = int(main_gib * 2**30 / 4 / pieces), int(ref_gib * 2**30 / 2 / pieces)
    main = [torch.randn(n_main + i, device="cuda", generator=g) for i in range(pieces)]
    ref = [torch.randn(n_ref + i, device="cuda", generator=g).to(torch.bfloat16) for i in range(pieces)]
    optimizer = SimpleNamespace(fp32_from_float16_groups=[main], optimizer=SimpleNamespace(state={}, param_groups=[]))
    ddp = SimpleNamespace(buffers=[], expert_parallel_buffers=[])
    mm = MemoryManager(frozenset({"main_weights", "reference_weights"}), "rollplex", ddp, optimizer,
                       SimpleNamespace(parameters=lambda: ref), copy_streams, ahead)
    return mm, main, ref
