"""Phase timing and the metrics record of one step."""
from __future__ import annotations

import resource
import time
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from rollplex_megatron.runtime import sync
from rollplex_megatron.spans import collect, merge, span
from rollplex_megatron.verify.flops import batch_fwd_flops


class PhaseTimer:
    """Per named phase of one step: wall seconds (device-synchronised), the allocator's peak, and the
    memory manager's residency actions on entry (their copies count in the phase's time)."""

    def __init__(self, memory=None, profile: bool = False, profile_phases=()):
        self.memory = memory
        self.times: dict[str, float] = {}
        self.peaks: dict[str, int] = {}
        self.profile = profile  # each phase under its own torch.profiler; `kernels` holds the top ops
        self.profile_phases = frozenset(profile_phases)  # the phases profiled (empty: all)
        self.kernels: dict[str, dict] = {}
        self.totals: dict[str, dict] = {}  # per profiled phase: op events, summed self device and CPU ms
        self.parts: dict[str, dict] = {}  # per phase: its named parts (`spans`: count, host and GPU seconds)

    @contextmanager
    def __call__(self, name: str, residency: str | None = None, then: str | None = None):
        """Time the enclosed phase under `name` (accumulates when a phase repeats); `residency`: the
        phase whose memory plan it runs under (default its own); `then`: the phase entered next when it is not
        the plan's next (`MemoryManager.resident_in`)."""
        sync()
        t0 = time.perf_counter()
        with collect() as parts:
            if self.memory is not None:
                with span("memory"):  # the residency actions (on CUDA the GPU part is the wait for copies)
                    self.memory.enter(residency or name, then)
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()  # after the releases, so the peak is this phase's
            profiled = self.profile and (not self.profile_phases or name in self.profile_phases)
            prof = _profiler() if profiled else nullcontext()
            compiled = _compiled_frames()
            with prof:
                yield
                sync()
        self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0
        merge(self.parts.setdefault(name, {}), parts.summary())
        if torch.cuda.is_available():
            self.peaks[name] = max(self.peaks.get(name, 0), torch.cuda.max_memory_allocated())
        if profiled:
            self.kernels.setdefault(name, {})
            rows = top_ops(prof, limit=None)
            tot = self.totals.setdefault(name, {"events": 0, "device_ms": 0.0, "cpu_ms": 0.0, "compiled_frames": 0})
            tot["compiled_frames"] += _compiled_frames() - compiled  # torch.compile (re)compilations inside the phase
            for k in ("events", "device_ms", "cpu_ms"):  # busy time: device kernels and host ops vs the phase's wall
                tot[k] += sum(r["count" if k == "events" else k] for r in rows)
            for row in rows:  # every op: the by-count table shows a phase bound by many small host-issued ops
                acc = self.kernels[name].setdefault(row["name"], {**row, "count": 0, "device_ms": 0.0, "cpu_ms": 0.0})
                for k in ("count", "device_ms", "cpu_ms"):
                    acc[k] += row[k]

    def kernel_table(self, top: int = 15, key: str | None = None) -> dict:
        """Per phase: its `top` ops by `key`: device time (GPU kernels) or, on CPU, self CPU time by
        default; "count" ranks them by how often they ran."""
        key = key or ("device_ms" if torch.cuda.is_available() else "cpu_ms")
        return {ph: sorted(rows.values(), key=lambda r: -r[key])[:top] for ph, rows in self.kernels.items()}


def _compiled_frames() -> int:
    """Frames torch.compile has compiled so far in this process (each recompilation counts)."""
    from torch._dynamo.utils import counters
    return int(counters["frames"]["ok"])


def _profiler():
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=acts)


def top_ops(prof, limit: int | None = 40) -> list[dict]:
    """The profiled ops with their count, self device time and self CPU time (ms), the `limit` largest
    (None: all)."""
    rows = []
    for e in prof.key_averages():
        dev = getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0))
        rows.append({"name": e.key, "count": int(e.count), "device_ms": float(dev) / 1e3,
                     "cpu_ms": float(e.self_cpu_time_total) / 1e3})
    key = "device_ms" if torch.cuda.is_available() else "cpu_ms"
    return sorted(rows, key=lambda r: -r[key])[:limit]


def peak_bytes(t: PhaseTimer) -> tuple[int, str]:
    """The step's peak memory and where it was read (the allocator on GPU, the process RSS on CPU)."""
    if torch.cuda.is_available():
        return max(t.peaks.values(), default=0), "cuda max_memory_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "cpu process RSS high-water mark"


def reduce_metrics(rt, prep, updates: list[list[dict]]) -> dict:
    """Global (DP-summed) loss, KL (the loss's estimator and plain k1; absent without the reference), entropy,
    clip fraction, each the mean over the step's updates (one per mini-batch and epoch; each a token mean over its
    mini-batch); mean reward, accuracy and response length of the batch trained on (`rt`: the
    trainer's Runtime, `prep`: the mode's Prepared step)."""
    batch = prep.batch
    summed = ("loss", "kl", "kl_k1", "entropy", "clipfrac")  # over this rank's micro-batches
    keys = (*summed, "logp_diff")
    terms = [sum(float(r[k]) for u in updates for r in u) / len(updates) for k in summed] + [logp_diff(batch, prep.old)]
    fwd = batch_fwd_flops(rt.cfg.model, batch.groups)
    counts = {"reward_sum": float(batch.rewards.sum()), "responses": float(batch.rewards.numel()),
              "tokens": float(sum(t.numel() for g in batch.groups for t in g.responses)),
              "prompt_tokens": float(sum(g.prompt.input_ids.numel() for g in batch.groups)),
              "correct": float(batch.correct.sum()), "answered": float(batch.answered.sum()),
              **{f"fwd_flops_{k}": v for k, v in fwd.items()}}
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
    out["response_tokens"], out["prompt_tokens"] = int(c["tokens"]), int(c["prompt_tokens"])  # every DP rank's
    out["fwd_flops"] = {k: c[f"fwd_flops_{k}"] for k in fwd}  # analytic, by part (verify.flops.batch_fwd_flops)
    if rt.ref is None:  # no reference (train.reference): no KL to log (the loss's terms are 0 by construction)
        del out["kl"], out["kl_k1"]
    extra = reward_extra_means(batch.reward_extra, rt.dp_group, rt.dev)
    if extra:
        out["reward_extra"] = extra
    return out


def reward_extra_means(extras: list[list[dict]], group, dev) -> dict[str, float]:
    """The reward functions' extra metrics (their other numeric keys, data/rewards.py), each the mean over the
    responses of every DP rank that report it (a key some responses lack is averaged over those that have it).
    Collective over `group`: the ranks exchange their key sets first."""
    mine = sorted({k for row in extras for e in row for k in e})
    keys = [None] * dist.get_world_size(group)
    dist.all_gather_object(keys, mine, group=group)
    names = sorted({k for ks in keys for k in ks})
    if not names:
        return {}
    sums = torch.tensor([[sum(float(e[k]) for row in extras for e in row if k in e),
                          float(sum(k in e for row in extras for e in row))] for k in names],
                        dtype=torch.float64, device=dev)
    dist.all_reduce(sums, group=group)
    return {k: float(s / n) for k, (s, n) in zip(names, sums.tolist()) if n > 0}


def logp_diff(batch, old: dict | None) -> float:
    """Summed |trainer log-prob - sampler log-prob| over this rank's response tokens (0 on stages
    before the last, which compute none). `old`: the trainer's log-probs of the rollout policy per
    (group, response), so this is 0 up to rounding when the trainer scores the policy the rollout
    sampled from (same weights, same temperature)."""
    if not old:
        return 0.0
    return float(sum((old[(gi, ri)].float().cpu() - lp.float().cpu()).abs().sum()
                     for gi, lps in enumerate(batch.rollout_logprobs) for ri, lp in enumerate(lps)))
