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
    """Global (DP-summed) loss, KL (the loss's estimator and plain k1), entropy, clip fraction; mean
    reward, accuracy and response length (`rt`: the trainer's Runtime, `batch`: its StepBatch)."""
    summed = ("loss", "kl", "kl_k1", "entropy", "clipfrac")  # over this rank's micro-batches
    keys = (*summed, "logp_diff")
    terms = [sum(float(r[k]) for r in res) for k in summed] + [logp_diff(batch, res)]
    counts = {"reward_sum": float(batch.rewards.sum()), "responses": float(batch.rewards.numel()),
              "tokens": float(sum(t.numel() for g in batch.groups for t in g.responses)),
              "correct": float(batch.correct.sum()), "answered": float(batch.answered.sum())}
    vals = torch.tensor(terms + list(counts.values()),
                        dtype=torch.float64, device=rt.dev)
    dist.all_reduce(vals, group=rt.dp_group)
    if rt.pp_size > 1:  # the loss terms exist on the last pipeline stage only
        loss_terms = vals[:len(keys)].clone()
        dist.broadcast(loss_terms, ps.get_pipeline_model_parallel_last_rank(),
                       group=ps.get_pipeline_model_parallel_group())
        vals[:len(keys)] = loss_terms
    out = {k: float(vals[i]) for i, k in enumerate(keys)}
    c = {k: float(vals[len(keys) + i]) for i, k in enumerate(counts)}
    out["reward_mean"] = c["reward_sum"] / c["responses"]
    out["response_len_mean"] = c["tokens"] / c["responses"]
    out["accuracy"] = c["correct"] / c["responses"]  # right answers over all responses
    out["answered"] = c["answered"] / c["responses"]
    out["rollout_logp_diff"] = out.pop("logp_diff") / max(c["tokens"], 1.0)
    return out


def logp_diff(batch, res: list[dict]) -> float:
    """Summed |trainer log-prob - sampler log-prob| over this rank's response tokens (0 on stages
    before the last, which compute none). The update's current log-probs are the old log-probs (one
    on-policy update), so this is 0 up to rounding when the trainer scores the policy the rollout
    sampled from (same weights, same temperature)."""
    if not res:
        return 0.0
    trainer = torch.cat([r["logp"].float().cpu() for r in res])
    return float((trainer - torch.cat(batch.rollout_logprobs)).abs().sum())
