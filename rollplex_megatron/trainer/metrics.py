"""Phase timing and the metrics record of one step."""
from __future__ import annotations

import resource
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from rollplex_megatron.runtime import sync


class PhaseTimer:
    """Per named phase of one step: wall seconds (device-synchronised), the allocator's peak, and the
    memory manager's residency actions on entry (their copies count in the phase's time)."""

    def __init__(self, memory=None):
        self.memory = memory
        self.times: dict[str, float] = {}
        self.peaks: dict[str, int] = {}

    @contextmanager
    def __call__(self, name: str):
        """Time the enclosed phase under `name` (accumulates when a phase repeats)."""
        sync()
        t0 = time.perf_counter()
        if self.memory is not None:
            self.memory.enter(name)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()  # after the releases, so the peak is this phase's
        yield
        sync()
        self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0
        if torch.cuda.is_available():
            self.peaks[name] = max(self.peaks.get(name, 0), torch.cuda.max_memory_allocated())


def peak_bytes(t: PhaseTimer) -> tuple[int, str]:
    """The step's peak memory and where it was read (the allocator on GPU, the process RSS on CPU)."""
    if torch.cuda.is_available():
        return max(t.peaks.values(), default=0), "cuda max_memory_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "cpu process RSS high-water mark"


def reduce_metrics(rt, batch, res: list[dict]) -> dict:
    """Global (DP-summed) loss, KL, entropy, clip fraction; mean reward and response length
    (`rt`: the trainer's Runtime, `batch`: its StepBatch)."""
    keys = ("loss", "kl", "entropy", "clipfrac")
    vals = torch.tensor([sum(float(r[k]) for r in res) for k in keys]
                        + [float(batch.rewards.sum()), float(batch.rewards.numel()),
                           float(sum(t.numel() for g in batch.groups for t in g.responses)),
                           float(batch.correct.sum()), float(batch.answered.sum())],
                        dtype=torch.float64, device=rt.dev)
    dist.all_reduce(vals, group=rt.dp_group)
    if rt.pp_size > 1:  # the loss terms exist on the last pipeline stage only
        loss_terms = vals[:len(keys)].clone()
        dist.broadcast(loss_terms, ps.get_pipeline_model_parallel_last_rank(),
                       group=ps.get_pipeline_model_parallel_group())
        vals[:len(keys)] = loss_terms
    out = {k: float(vals[i]) for i, k in enumerate(keys)}
    out["reward_mean"] = float(vals[4] / vals[5])
    out["response_len_mean"] = float(vals[6] / vals[5])
    out["accuracy"] = float(vals[7] / vals[5])  # right answers over all responses (chance 1/4 once answering)
    out["answered"] = float(vals[8] / vals[5])
    return out
