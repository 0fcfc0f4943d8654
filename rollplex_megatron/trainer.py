"""The synchronous GRPO step (DESIGN section 2) in three modes that compute the same update.

serial        rollout -> old log-probs (full sequences) -> reference log-probs (full sequences) ->
              update (full sequences, micro-batches) -> optimizer step
prefix_shared the same order; every phase runs prefix once per group + packed response stage
rollplex      rollout whose prefill *is* the actor prefix stage, with the reference prefix stage of
              every group in the decode window -> reference response stage -> actor response stage
              (old log-probs = its own detached forward) -> prefix backward once per group ->
              optimizer step
Rewards and group advantages come between rollout and the first scoring phase in every mode. The
rollout engine runs the actor's modules in place, so there is no weight sync after the step.
"""
from __future__ import annotations

import json
import os
import resource
import signal
import time
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from rollplex_megatron.config import RunConfig


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


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
        _sync()
        t0 = time.perf_counter()
        if self.memory is not None:
            self.memory.enter(name)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()  # after the releases, so the peak is this phase's
        yield
        _sync()
        self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0
        if torch.cuda.is_available():
            self.peaks[name] = max(self.peaks.get(name, 0), torch.cuda.max_memory_allocated())


@dataclass
class StepBatch:
    """This rank's rollout batch: episodes, prompts and sampled groups with advantages."""

    episodes: list
    requests: list
    groups: list  # prefix.batch.Group with responses and advantages
    rewards: torch.Tensor  # [N, G]
    correct: torch.Tensor  # [N, G] 1 where the answer is right (reward without shaping)
    answered: torch.Tensor  # [N, G] 1 where the response names any direction
    total_tokens: int  # response tokens over all DP ranks (the token-mean denominator)


def memory_plan(cfg: RunConfig, env) -> dict:
    """The planner's phases for this run (mode, `memory.plan`, the task's real prompt shape); raises
    when the peak exceeds `memory.budget_gib`, naming the class and what would make it fit."""
    from rollplex_megatron.memory.planner import (check_budget, plan, runtime_cfg, runtime_plan, summarize,
                                                  workload_shape)

    prompts = [env.prompt(env.episode(i)) for i in range(16)]  # the task's prompt shapes (questions vary)
    patches = max(sum(getattr(p, k).shape[0] for k in ("pixel_values", "pixel_values_videos")
                      if getattr(p, k) is not None) for p in prompts)
    shape = workload_shape(cfg, max(p.input_ids.numel() - 1 for p in prompts), patches, cfg.task.max_answer_tokens)
    summary = summarize(runtime_plan(cfg, shape), cfg.mode.name)
    try:
        check_budget(summary, cfg.memory.budget_gib, f"{cfg.mode.name} (memory.plan={cfg.memory.plan})", runtime=True)
    except ValueError as e:
        if cfg.memory.plan == "phase":
            raise
        alt = summarize(plan(runtime_cfg(cfg), cfg.mode.name, "phase", "embedded", shape), cfg.mode.name)["peak_gib"]
        raise ValueError(f"{e}; memory.plan=phase would need {alt:.1f} GiB") from None
    return {**summary, "shape": vars(shape)}


class Runtime:
    """What every mode uses: actor (DDP), reference, optimizer, rollout engine, task, loss."""

    def __init__(self, cfg: RunConfig):
        from megatron.core import parallel_state as ps

        from rollplex_megatron.dist import init_parallel
        from rollplex_megatron.envs.motion import MotionEnv
        from rollplex_megatron.equivalence import wrap_ddp
        from rollplex_megatron.memory.manager import MemoryManager
        from rollplex_megatron.models.qwen25vl import build_model
        from rollplex_megatron.optim import build_optimizer
        from rollplex_megatron.rollout.embedded import EmbeddedEngine
        from rollplex_megatron.rollout.sampling import SamplingParams

        self.cfg = cfg
        cfg.check_training()
        init_parallel(cfg.parallel.tp, cfg.parallel.pp, cfg.seed, cfg.parallel.backend)
        self.env = MotionEnv(cfg.task, cfg.model)  # bad task/model pairing fails before building models
        self.plan = memory_plan(cfg, self.env)  # over memory.budget_gib: fails here, before any model
        actor = build_model(cfg.model, cfg.dtype)
        if cfg.train.init_hf:
            from rollplex_megatron.checkpoint.hf import HFCheckpoint, load_hf_into_model

            load_hf_into_model(actor, HFCheckpoint(cfg.train.init_hf), cfg.model, ps.get_tensor_model_parallel_rank(),
                               cfg.parallel.tp, ps.get_pipeline_model_parallel_rank(), cfg.parallel.pp)
        self.ref = build_model(cfg.model, cfg.dtype)
        self.ref.load_state_dict(actor.state_dict())  # the reference is the initial policy, frozen
        self.ref.requires_grad_(False)
        self.ddp = wrap_ddp(actor)
        self.optimizer = build_optimizer(self.ddp, cfg.optim, bf16=cfg.dtype == "bfloat16")
        self.memory = MemoryManager(cfg.memory.plan, cfg.mode.name, self.ddp, self.optimizer, self.ref)
        self.recompute = cfg.memory.plan == "phase"  # the actor prefix keeps no graph
        self.engine = EmbeddedEngine(self.ddp, cfg.model, cfg.rollout.max_prompt_len, cfg.rollout.max_response_len,
                                     cfg.memory.kv_cache_gib, cfg.rollout.cuda_graphs,
                                     cfg.rollout.decode_attention)
        r = cfg.rollout
        self.sampling = SamplingParams(r.temperature, r.top_p, r.top_k)
        self.backend = cfg.mode.attention_backend
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.pp_size = ps.get_pipeline_model_parallel_world_size()
        self.dp_group, self.tp_group = ps.get_data_parallel_group(), ps.get_tensor_model_parallel_group()
        self.dev = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"

    def requests(self, step: int):
        """This rank's episodes and rollout requests of `step` (deterministic in seed and step)."""
        from rollplex_megatron.rollout.engine import RolloutRequest

        n, cfg = self.cfg.prompts_per_rank, self.cfg
        base = cfg.seed * 1_000_003 + step * n * self.dp_size + self.dp_rank * n
        episodes = [self.env.episode(base + i) for i in range(n)]
        reqs = [RolloutRequest(self.env.prompt(e), cfg.rollout.group_size, cfg.task.max_answer_tokens,
                               self.env.stop_token_ids, seed=e.seed * 31 + 17) for e in episodes]
        return episodes, reqs

    def score(self, episodes, requests, rollout) -> StepBatch:
        """Rewards, group advantages and Groups from the rollout."""
        from rollplex_megatron.prefix.batch import Group, validate_groups
        from rollplex_megatron.rl.grpo import group_advantages

        said = [[self.env.answer(t) for t in res.tokens] for res in rollout.results]
        rewards = torch.tensor([[self.env.answer_reward(e, a) for a in row] for e, row in zip(episodes, said)])
        correct = torch.tensor([[float(a == e.answer) for a in row] for e, row in zip(episodes, said)])
        answered = torch.tensor([[float(a is not None) for a in row] for row in said])
        adv = group_advantages(rewards, self.cfg.train.normalize_std)
        groups = [Group(r.prompt, res.tokens, a) for r, res, a in zip(requests, rollout.results, adv)]
        validate_groups(self.cfg.model, groups, self.cfg.rollout.max_response_len)
        n_tok = torch.tensor(float(sum(t.numel() for res in rollout.results for t in res.tokens)), device=self.dev)
        dist.all_reduce(n_tok, group=self.dp_group)
        return StepBatch(episodes, requests, groups, rewards, correct, answered, int(n_tok))

    def micro_batches(self, batch: StepBatch, kind: str):
        """Full-sequence or response-stage micro-batches with the advantages laid per token."""
        from rollplex_megatron.prefix import batch as B

        build = B.full_micro_batches if kind == "full" else B.response_micro_batches
        mbs = build(self.cfg.model, batch.groups, self.cfg.workload.responses_per_micro_batch, batch.total_tokens)
        adv = {(gi, ri): torch.full((r.numel(),), float(g.advantages[ri]))
               for gi, g in enumerate(batch.groups) for ri, r in enumerate(g.responses)}
        B.attach_token_data(mbs, "adv", adv)
        return mbs

    def loss(self, batch: StepBatch):
        """The GRPO loss of this step (token mean over the global response-token count)."""
        from rollplex_megatron.rl.grpo import GRPOLoss

        t = self.cfg.train
        return GRPOLoss(t.kl_coef, t.clip_low, t.clip_high, batch.total_tokens, self.tp_group, t.entropy_coef)

    def optimizer_step(self) -> dict:
        """megatron optimizer step (clipping included); gradients are zeroed for the next step."""
        from rollplex_megatron.optim import optimizer_step

        out = optimizer_step(self.optimizer)
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        return out


def _per_response(results, mbs, groups) -> dict | None:
    """Per-response log-probs; None on pipeline stages before the last (they compute none)."""
    from megatron.core import parallel_state as ps

    from rollplex_megatron.prefix.batch import split_token_values

    if not ps.is_pipeline_last_stage():
        return None
    return split_token_values(results, mbs, groups, "logp")


class Mode(ABC):
    """One execution strategy of the step; chosen once from `mode.name`."""

    name: str

    @abstractmethod
    def step(self, rt: Runtime, step: int, t: PhaseTimer) -> tuple[StepBatch, list[dict], dict]:
        """Run one step; returns the batch, the update's loss dicts and mode-specific stats."""

    @staticmethod
    def rollout(rt: Runtime, episodes, reqs, t: PhaseTimer, **kw):
        """Rollout and scoring, shared by every mode."""
        with t("rollout"):
            out = rt.engine.generate(reqs, rt.sampling, **kw)
        with t("reward"):
            batch = rt.score(episodes, reqs, out)
        return batch, out


class Serial(Mode):
    """verl-style colocation: every phase re-runs whole sequences."""

    name = "serial"

    def step(self, rt, step, t):  # noqa: D102
        from rollplex_megatron.prefix import batch as B
        from rollplex_megatron.prefix.execution import full_sequence_step

        batch, out = self.rollout(rt, *rt.requests(step), t)
        mbs = rt.micro_batches(batch, "full")
        with t("old_logp"), torch.no_grad():
            old = _per_response(full_sequence_step(rt.ddp, mbs, forward_only=True, backend=rt.backend), mbs,
                                batch.groups)
        with t("ref_logp"), torch.no_grad():
            ref = _per_response(full_sequence_step(rt.ref, mbs, forward_only=True, backend=rt.backend), mbs,
                                batch.groups)
        B.attach_token_data(mbs, "old_logp", old)
        B.attach_token_data(mbs, "ref_logp", ref)
        with t("update"):
            res = full_sequence_step(rt.ddp, mbs, loss_fn=rt.loss(batch), backend=rt.backend)
        return batch, res, out.stats


class PrefixShared(Mode):
    """Same phase order as serial; each phase computes the prefix once per group."""

    name = "prefix_shared"

    def step(self, rt, step, t):  # noqa: D102
        from rollplex_megatron.prefix import batch as B
        from rollplex_megatron.prefix.execution import actor_prefix_step, reference_prefix_logprobs

        batch, out = self.rollout(rt, *rt.requests(step), t)
        mbs = rt.micro_batches(batch, "response")
        with t("old_logp"):
            old = _per_response(reference_prefix_logprobs(rt.ddp, batch.groups, mbs, rt.backend), mbs, batch.groups)
        with t("ref_logp"):
            ref = _per_response(reference_prefix_logprobs(rt.ref, batch.groups, mbs, rt.backend), mbs, batch.groups)
        B.attach_token_data(mbs, "old_logp", old)
        B.attach_token_data(mbs, "ref_logp", ref)
        with t("update"):
            res = actor_prefix_step(rt.ddp, batch.groups, mbs, rt.backend, loss_fn=rt.loss(batch),
                                    recompute=rt.recompute)
        return batch, res, out.stats


def _reference_prefix(ref, prompt, store, group: int) -> None:
    """Decode-window work item: the reference prefix stage of one group (K/V only)."""
    from rollplex_megatron.prefix.batch import Group
    from rollplex_megatron.prefix.execution import prefix_forward

    with torch.no_grad():
        prefix_forward(ref, [Group(prompt, [], torch.zeros(0))], store, keep_graph=False, group_ids=[group])


class Rollplex(Mode):
    """Prefix stages inside the rollout: prefill = actor prefix, reference prefixes in the decode window."""

    name = "rollplex"

    def step(self, rt, step, t):  # noqa: D102
        from rollplex_megatron.attention.prefix import KVStore, PrefixContext
        from rollplex_megatron.prefix import batch as B
        from rollplex_megatron.prefix.execution import finalize, prefix_backward, run_schedule
        from rollplex_megatron.rollout.window import DecodeWindow

        actor_kv, ref_kv = KVStore(), KVStore()
        mc = rt.cfg.mode
        par = rt.cfg.parallel
        mech = "interleave" if mc.window == "auto" and (par.tp > 1 or par.pp > 1) else mc.window  # side work: tp=pp=1
        window = DecodeWindow(mech, mc.window_items_per_step, mc.window_tail_fraction, mc.window_green_sms)
        episodes, reqs = rt.requests(step)
        for i, r in enumerate(reqs):
            window.submit(f"reference_prefix[{i}]", partial(_reference_prefix, rt.ref, r.prompt, ref_kv, i))
        batch, out = self.rollout(rt, episodes, reqs, t, hooks=window, actor_prefix=actor_kv,
                                  recompute_prefix=rt.recompute)
        mbs = rt.micro_batches(batch, "response")
        use = lambda kv: lambda mb: PrefixContext(mode="use", layout=mb.layout, store=kv,  # noqa: E731
                                                  backend=rt.backend)
        dev_mbs = [mb.to(rt.dev) for mb in mbs]
        with t("ref_logp"), torch.no_grad():
            ref = _per_response(run_schedule(rt.ref, dev_mbs, use(ref_kv), forward_only=True), mbs, batch.groups)
        B.attach_token_data(mbs, "ref_logp", ref)
        ref_kv.leaves.clear()  # the reference prefix K/V's last consumer is done
        dev_mbs = [mb.to(rt.dev) for mb in mbs]
        with t("update"):
            res = run_schedule(rt.ddp, dev_mbs, use(actor_kv), forward_only=False, loss_fn=rt.loss(batch))
            kv_bytes, kv_grad_bytes = actor_kv.nbytes()
            prefix_backward(rt.ddp, out.prefix_states, actor_kv)
            finalize(rt.ddp)
        return batch, res, {**out.stats, **window.stats(), "actor_prefix_kv_bytes": kv_bytes,
                            "prefix_kv_grad_bytes": kv_grad_bytes, "prefix_recompute_drift": actor_kv.recompute_drift}


MODES = {m.name: m for m in (Serial, PrefixShared, Rollplex)}


def _peak_bytes(t: PhaseTimer) -> tuple[int, str]:
    if torch.cuda.is_available():
        return max(t.peaks.values(), default=0), "cuda max_memory_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "cpu process RSS high-water mark"


def _reduce_metrics(rt: Runtime, batch: StepBatch, res: list[dict]) -> dict:
    """Global (DP-summed) loss, KL, entropy, clip fraction; mean reward and response length."""
    keys = ("loss", "kl", "entropy", "clipfrac")
    vals = torch.tensor([sum(float(r[k]) for r in res) for k in keys]
                        + [float(batch.rewards.sum()), float(batch.rewards.numel()),
                           float(sum(t.numel() for g in batch.groups for t in g.responses)),
                           float(batch.correct.sum()), float(batch.answered.sum())],
                        dtype=torch.float64, device=rt.dev)
    dist.all_reduce(vals, group=rt.dp_group)
    if rt.pp_size > 1:  # the loss terms exist on the last pipeline stage only
        from megatron.core import parallel_state as ps

        loss_terms = vals[:len(keys)].clone()
        dist.broadcast(loss_terms, ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
        vals[:len(keys)] = loss_terms
    out = {k: float(vals[i]) for i, k in enumerate(keys)}
    out["reward_mean"] = float(vals[4] / vals[5])
    out["response_len_mean"] = float(vals[6] / vals[5])
    out["accuracy"] = float(vals[7] / vals[5])  # right answers over all responses (chance 1/4 once answering)
    out["answered"] = float(vals[8] / vals[5])
    return out


def run_step(rt: Runtime, mode: Mode, step: int) -> dict:
    """One RL step; returns its metrics record."""
    rt.memory.new_step()
    t = PhaseTimer(rt.memory)
    t0 = time.perf_counter()
    batch, res, stats = mode.step(rt, step, t)
    rt.last_batch = batch  # kept for inspection (tests compare rollouts across modes)
    with t("optimizer"):
        opt = rt.optimizer_step()
    _sync()
    peak, src = _peak_bytes(t)
    return {"step": step + 1, "mode": mode.name, **_reduce_metrics(rt, batch, res),
            "grad_norm": opt["grad_norm"], "step_time_s": time.perf_counter() - t0,
            "phase_times": t.times, "phase_peak_bytes": t.peaks, "peak_mem_bytes": peak, "peak_mem_source": src,
            "memory_plan": rt.cfg.memory.plan, "phase_managed_bytes": dict(rt.memory.phase_bytes),
            "offload_bytes": dict(rt.memory.copy_bytes), "rollout": stats}


def _run_dir(cfg: RunConfig) -> Path:
    """Rank 0 names the run directory; every rank gets the same path."""
    name = [cfg.train.out or os.path.join(cfg.run_dir, time.strftime("%Y%m%d-%H%M%S") + f"-train-{cfg.mode.name}")]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(name, src=0)
    path = Path(name[0]).resolve()
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    return path


class Preemption:
    """SIGTERM (SLURM's preemption signal) asks for a stop: the current step finishes, every rank
    agrees on the step to stop after, a checkpoint is written and the ranks return normally."""

    def __init__(self):
        self.asked = False
        self._old = signal.signal(signal.SIGTERM, self._on_term)

    def _on_term(self, signum, frame) -> None:
        self.asked = True

    def agreed(self, dev) -> bool:
        """Collective: True on every rank when any rank was asked to stop."""
        flag = torch.tensor([int(self.asked)], dtype=torch.int32, device=dev)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(int(flag))

    def close(self) -> None:
        """Give SIGTERM its previous handler back."""
        signal.signal(signal.SIGTERM, self._old)


def train_rank(cfg: RunConfig) -> dict:
    """Train on this rank until `train.steps` (or a SIGTERM); rank 0 writes metrics.jsonl and the
    config, every rank its checkpoint shard. The launcher has checked and locked the run directory."""
    from rollplex_megatron.checkpoint import run_dir, train_state
    from rollplex_megatron.recipes import to_yaml

    preempt = Preemption()
    rt = Runtime(cfg)
    mode = MODES[cfg.mode.name]()
    run = _run_dir(cfg)
    start, rank0 = 0, dist.get_rank() == 0
    if cfg.train.resume:
        latest = train_state.latest_checkpoint(run)
        if latest is None:
            raise FileNotFoundError(f"train.resume=true but {run} has no checkpoint")
        start, _ = train_state.load_checkpoint(latest, rt.ddp.module, rt.ref, rt.optimizer)
    if rank0:
        run_dir.truncate_metrics(run, start)  # steps after the checkpoint are trained again
        (run / "config.yaml").write_text(to_yaml(cfg))
        (run / "memory_plan.json").write_text(json.dumps(rt.plan, indent=1))
    metrics_path = run / run_dir.METRICS
    bar = _progress(cfg, start, rank0)
    records, stopped = [], None
    try:
        for step in range(start, cfg.train.steps):
            rec = run_step(rt, mode, step)
            records.append(rec)
            if rank0:
                with metrics_path.open("a") as f:
                    f.write(json.dumps(rec) + "\n")
                _show(bar, rec)
            stop = preempt.agreed(rt.dev)
            last = step + 1 == cfg.train.steps
            if (last and cfg.train.save_final) or stop or (cfg.train.save_every and (step + 1) % cfg.train.save_every == 0):
                rt.memory.restore_all()  # offloaded classes come back before their state is written
                train_state.save_checkpoint(run, step + 1, rt.ddp.module, rt.ref, rt.optimizer, {}, to_yaml(cfg))
            if stop and not last:
                stopped = step + 1
                break
    finally:
        preempt.close()
        if bar is not None:
            bar.close()
    return {"run_dir": str(run), "records": records, "preempted_at": stopped}


def _progress(cfg: RunConfig, start: int, rank0: bool):
    if not (rank0 and cfg.train.progress):
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.train.steps, initial=start, desc=f"train[{cfg.mode.name}]", unit="step", dynamic_ncols=True)


def _show(bar, rec: dict) -> None:
    phases = " ".join(f"{k}={v:.2f}s" for k, v in rec["phase_times"].items())
    line = (f"step {rec['step']:4d} reward {rec['reward_mean']:.3f} acc {rec['accuracy']:.3f} kl {rec['kl']:.2e} loss {rec['loss']:+.3e} "
            f"entropy {rec['entropy']:.2f} | {rec['step_time_s']:.2f}s: {phases}")
    if bar is None:
        print(line, flush=True)
    else:
        bar.update(1)
        bar.set_postfix(reward=f"{rec['reward_mean']:.3f}")
        bar.write(line)
