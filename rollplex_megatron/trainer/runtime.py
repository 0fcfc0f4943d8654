"""What every mode uses: actor (DDP), reference, optimizer, rollout engine, data source, loss, and
the memory manager with the planner's plan for this run."""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from rollplex_megatron.config import RunConfig
from rollplex_megatron.data import build_source
from rollplex_megatron.dist import ParallelLayouts, default_group_is_train_world, init_parallel, layouts, train_world
from rollplex_megatron.memory.machine import check_run_fits
from rollplex_megatron.memory.manager import MemoryManager
from rollplex_megatron.memory.auto import ahead_phases, auto_release, auto_size, auto_size_text, fit_fixes
from rollplex_megatron.memory.budget import check_budget, check_cap, gib_text
from rollplex_megatron.memory.planner import (pack_groups, plan, releasable, released, rollout_rank_plan, runtime_cfg,
                                              runtime_plan, summarize, workload_shape)
from rollplex_megatron.models.registry import model_spec, open_hf
from rollplex_megatron.models.triton_norm import norm_kernel_for, use_norm_kernel
from rollplex_megatron.models.triton_rope import rope_kernel_for, use_rope_kernel
from rollplex_megatron.optim import build_optimizer, build_scheduler, current_lr, optimizer_step
from rollplex_megatron.prefix import batch as B
from rollplex_megatron.prefix import execution as X
from rollplex_megatron.prefix.batch import Group, validate_groups
from rollplex_megatron.prefix.graphs import PrefixGraphs
from rollplex_megatron.rl.grpo import GRPOLoss, group_advantages, logprob_kernel_for, loss_weights
from rollplex_megatron.rollout.embedded import EmbeddedEngine, check_decode_settings, check_kv_budget
from rollplex_megatron.rollout.engine import RolloutRequest
from rollplex_megatron.rollout.sglang.engine import SGLangEngine, import_sglang
from rollplex_megatron.rollout.disaggregated import RemoteRollout
from rollplex_megatron.rollout.replicas import RolloutReplicas
from rollplex_megatron.rollout.sampling import SamplingParams
from rollplex_megatron.runtime import device, wrap_ddp
from rollplex_megatron.spans import span


@dataclass
class StepBatch:
    """This rank's rollout batch: the data source's rows, the requests and the sampled groups with
    their advantages (one entry per group in every list)."""

    rows: list  # data.source.Row
    requests: list
    groups: list  # prefix.batch.Group with responses and advantages
    rewards: torch.Tensor  # [N, G]
    correct: torch.Tensor  # [N, G] 1 where the answer is right (reward without shaping)
    answered: torch.Tensor  # [N, G] 1 where the response gives an answer at all
    rollout_logprobs: list  # [N] lists of G tensors [R]: the sampler's log-probs
    # [N] lists of G dicts: the reward function's extra metrics of each response (its other numeric keys)
    reward_extra: list = field(default_factory=list)

    def take(self, picks: list[int]) -> "StepBatch":
        """The groups at `picks`, in that order."""
        return StepBatch([self.rows[i] for i in picks], [self.requests[i] for i in picks],
                         [self.groups[i] for i in picks], self.rewards[picks], self.correct[picks],
                         self.answered[picks], [self.rollout_logprobs[i] for i in picks],
                         [self.reward_extra[i] for i in picks])

    @staticmethod
    def concat(batches: list["StepBatch"]) -> "StepBatch":
        """Several rounds' batches as one (groups in round order)."""
        cat = lambda k: [x for b in batches for x in getattr(b, k)]  # noqa: E731
        return StepBatch(cat("rows"), cat("requests"), cat("groups"), torch.cat([b.rewards for b in batches]),
                         torch.cat([b.correct for b in batches]), torch.cat([b.answered for b in batches]),
                         cat("rollout_logprobs"), cat("reward_extra"))

    def informative(self) -> list[bool]:
        """Per group: its rewards are not all equal (its advantages are not all 0)."""
        return [bool((r != r[0]).any()) for r in self.rewards]


@dataclass
class MiniBatch:
    """One PPO mini-batch: whole groups of the step's batch, and its global counts (every DP rank's
    share of it), which normalise its loss."""

    groups: list[int]  # indices into StepBatch.groups
    total_tokens: int  # response tokens over all DP ranks (the token-mean denominator)
    responses: int  # responses over all DP ranks (the seq-mean denominator)


def drawn_lengths(mean: float, sigma: float, cap: int, n: int, seed: int) -> list[int]:
    """`n` response lengths from a lognormal of mean `mean` and log-std `sigma` (a seeded stream),
    rounded and clipped to [1, cap] (`rollout.length_dist=lognormal`)."""
    g = torch.Generator().manual_seed(seed)
    mu = math.log(mean) - sigma**2 / 2  # E[exp(N(mu, sigma^2))] = mean
    x = torch.exp(mu + sigma * torch.randn(n, generator=g, dtype=torch.float64))
    return [int(v) for v in x.round().clamp(1, cap)]


def run_shape(cfg: RunConfig, source):
    """The step's shape (`planner.Shape`) from the source's real prompts: the longest and shortest prefix, the most
    patches, its longest response."""
    prompts = source.shape_prompts(16)  # the source's prompt shapes (questions vary)
    patches = max(sum(getattr(p, k).shape[0] for k in ("pixel_values", "pixel_values_videos")
                      if getattr(p, k) is not None) for p in prompts)
    lens = [p.input_ids.numel() - 1 for p in prompts]
    return workload_shape(cfg, max(lens), patches, source.max_new_tokens, min(lens))


def auto_sizes(cfg: RunConfig, source) -> tuple[RunConfig, dict]:
    """The run's sizes left to the planner, resolved (`auto.auto_size`) for this device: with CUDA under
    `auto_budget_gib` (memory.budget_gib, else the free memory less the margin, the least over the ranks); without,
    the fixed values of a CPU run."""
    if not cfg.auto_sized:
        return cfg, {}
    budget = auto_budget_gib(cfg) if torch.cuda.is_available() else None
    shape = run_shape(cfg, source) if budget is not None else None
    return auto_size(cfg, shape, budget, torch.cuda.device_count())


def memory_plan(cfg: RunConfig, source, release: frozenset | None = None) -> dict:
    """The planner's phases for this run (mode, `memory.plan`, the source's real prompt shape, the actor's
    packs `actor_pack_tokens`); raises when the peak exceeds `memory.budget_gib`, naming the class and what
    would make it fit. `release`: under `memory.plan=auto`, the set a recorded run released, planned as it ran
    instead of chosen again (benchmarks/plan_vs_measured.py)."""
    shape = run_shape(cfg, source)
    pack = max(cfg.workload.prefix_pack_tokens, 0)  # -1 (auto, not resolved: `auto_sizes`) packs nothing
    if cfg.memory.plan == "auto":
        budget = auto_budget_gib(cfg)
        # the release set is chosen with one group a recomputed pack (the least a recomputation holds), then
        # the actor's packs grow as far as that set allows
        rel = release if release is not None else frozenset() if budget is None else auto_release(
            with_pack_tokens(cfg, min(pack, shape.P)), shape, budget, torch.cuda.device_count())
        actor_pack = actor_pack_tokens(cfg, shape, budget or 0.0, rel)
        rc = runtime_cfg(with_pack_tokens(cfg, actor_pack))
        ahead = _ahead(cfg, rc, rel, shape, budget)
        summary = summarize(plan(rc, cfg.mode.name, rel, "embedded", shape, ahead), cfg.mode.name)
        return {**summary, "shape": vars(shape), "released": [n for n in releasable(cfg) if n in rel],
                "auto_budget_gib": budget, "actor_pack_tokens": actor_pack, "ahead": ahead}
    budget = cfg.memory.budget_gib
    if cfg.budget_from_free_memory and pack and "actor_prefix_graph" in released(cfg.memory.plan):
        # a recomputed pack's graph is held at once: checked against the device, not left to run out of memory
        budget = auto_budget_gib(cfg) or 0.0
    actor_pack = actor_pack_tokens(cfg, shape, budget, released(cfg.memory.plan))
    cfg = with_pack_tokens(cfg, actor_pack)
    ahead = _ahead(cfg, runtime_cfg(cfg), cfg.memory.plan, shape, budget)
    summary = summarize(runtime_plan(cfg, shape, ahead), cfg.mode.name)
    summary["actor_pack_tokens"], summary["ahead"] = actor_pack, ahead
    if cfg.parallel.rollout_ranks:  # mode=disaggregated: what a rollout rank holds (its own weights, its cache)
        summary["rollout_rank"] = rollout_rank_plan(cfg, shape)
    try:
        check_budget(summary, budget, f"{cfg.mode.name} (memory.plan={cfg.memory.plan})", runtime=True,
                     fit=lambda: fit_fixes(cfg, shape, budget, torch.cuda.device_count()))
    except ValueError as e:
        if cfg.memory.plan == "phase":
            raise
        alt = summarize(plan(runtime_cfg(cfg), cfg.mode.name, "phase", "embedded", shape), cfg.mode.name)["peak_gib"]
        raise ValueError(f"{e}; memory.plan=phase would need {gib_text(alt)} GiB") from None
    return {**summary, "shape": vars(shape), "released": [n for n in releasable(cfg) if n in released(cfg.memory.plan)]}


def _ahead(cfg: RunConfig, rc: RunConfig, residency, shape, budget_gib: float | None) -> dict:
    """`memory.prefetch_ahead`'s classes (`auto.ahead_phases` over the runtime config `rc`): under `budget_gib`,
    else `auto_budget_gib`'s; none when it is off or there is no budget (CPU without memory.budget_gib)."""
    if not cfg.memory.prefetch_ahead:
        return {}
    budget_gib = budget_gib or auto_budget_gib(cfg)  # no memory.budget_gib (budget_from_free_memory)
    return ahead_phases(rc, cfg.mode.name, residency, shape, budget_gib) if budget_gib else {}


def with_pack_tokens(cfg: RunConfig, tokens: int) -> RunConfig:
    """`cfg` with `workload.prefix_pack_tokens=tokens`."""
    return dataclasses.replace(cfg, workload=dataclasses.replace(cfg.workload, prefix_pack_tokens=tokens))


def actor_pack_tokens(cfg: RunConfig, shape, budget_gib: float, rel: frozenset) -> int:
    """The actor's prefix packs (`workload.prefix_pack_tokens` for its graph-bearing prefix stages: the rollout's
    prefill in rollplex, the actor's scoring and update prefixes): that setting, lowered a group at a time
    while the plan releasing `rel`, which then recomputes one pack's graph at a time, is over `budget_gib`
    (0: no budget). Kept graphs cost the same in any packs; the reference's prefixes pack to the full setting."""
    pack = cfg.workload.prefix_pack_tokens
    while "actor_prefix_graph" in rel and budget_gib > 0 and pack_groups(with_pack_tokens(cfg, pack), shape) > 1:
        c = with_pack_tokens(cfg, pack)
        if summarize(plan(runtime_cfg(c), cfg.mode.name, rel, "embedded", shape), cfg.mode.name)["peak_gib"] \
                <= budget_gib:
            break
        pack = (pack_groups(c, shape) - 1) * (shape.P_min or shape.P)
    return pack


def auto_budget_gib(cfg: RunConfig) -> float | None:
    """`memory.plan=auto`'s budget: `memory.budget_gib`, else the device's free memory now minus
    `memory.auto_margin_gib` (None on CPU: no budget, nothing released)."""
    if cfg.memory.budget_gib > 0:
        return cfg.memory.budget_gib
    if not torch.cuda.is_available():
        return None
    free, _ = torch.cuda.mem_get_info()
    budget = torch.tensor([free / 2**30 - cfg.memory.auto_margin_gib], dtype=torch.float64, device="cuda")
    if dist.is_initialized():  # every rank takes the same release set (the prefix recompute has collectives)
        dist.all_reduce(budget, op=dist.ReduceOp.MIN, group=train_world())
    return float(budget)


def training_model(cfg: RunConfig):
    """This rank's stage of a training-side model (megatron's init) with `train.norm_kernel`'s RMSNorms and
    `train.rope_kernel`'s RoPE.

    The switches apply to the models built here: the actor, the reference and `eval`'s policy (and, through
    ROLLPLEX_VERL_NORM_KERNEL and ROLLPLEX_VERL_ROPE_KERNEL, the verl engine's). The rollout's own models
    (replicas at `rollout.tp`, the disaggregated rollout ranks, SGLang's prefix jobs) and the
    benchmark/verification builds keep torch's RMSNorm and megatron's rotary; the decode step has its own
    kernel context (rollout/triton_norm.py) and rotates in its attention kernel over either."""
    model = model_spec(cfg.model).build(cfg.model, cfg.dtype, cfg.megatron)
    use_norm_kernel(model, norm_kernel_for(cfg.train.norm_kernel, device()))
    use_rope_kernel(model, rope_kernel_for(cfg.train.rope_kernel, device()))
    return model


def build_policy(cfg: RunConfig):
    """This rank's stage of the model (`training_model`), with `train.init_hf`'s weights when it is set
    (else megatron's init)."""
    model = training_model(cfg)
    if cfg.train.init_hf:
        model_spec(cfg.model).hf.load(model, open_hf(cfg.train.init_hf), cfg.model, ps.get_tensor_model_parallel_rank(),
                                      cfg.parallel.tp, ps.get_pipeline_model_parallel_rank(), cfg.parallel.pp)
    return model


def build_engine(model, cfg: RunConfig, at: ParallelLayouts | None = None, reference=None,
                 actor_pack_tokens: int | None = None):
    """The embedded rollout engine with the run's rollout and KV settings: over `model`'s own modules,
    or, when `rollout.tp` differs from the training TP (or `rollout.bound_model`), over rollout replicas
    bound to its storage; under mode=disaggregated, the rollout ranks' engines; under
    rollout.engine=sglang, SGLang on the training storage with the window's jobs in its scheduler.
    `actor_pack_tokens`: the packs of a prefill that is the actor prefix stage (`actor_pack_tokens`)."""
    if cfg.rollout.engine == "sglang":
        return SGLangEngine(X.unwrap(model), reference, cfg, ps.get_tensor_model_parallel_group())
    if at is not None and at.rollout_ranks:
        return RemoteRollout(X.unwrap(model), cfg, at)
    if at is not None and (at.differ or cfg.rollout.bound_model):
        return RolloutReplicas(X.unwrap(model), cfg, at)
    return EmbeddedEngine.for_run(model, cfg, actor_pack_tokens)


def check_window_graphs(cfg: RunConfig, released, cuda: bool) -> None:
    """mode.window_graphs where graphs are captured (CUDA) needs the reference resident between steps: a plan that
    releases its weights brings them back at other addresses each step, so every step would capture its items'
    graphs again, inside the decode window (each capture synchronises the device)."""
    if cfg.mode.window_graphs and cuda and "reference_weights" in released:
        raise ValueError(f"mode.window_graphs=true: memory.plan={cfg.memory.plan} releases the reference's weights "
                         "between steps, so its window items would be captured again every step; use memory.plan=keep,"
                         " or auto with room for the reference, or drop the override")


def run_plan(cfg: RunConfig, source) -> tuple[RunConfig, dict]:
    """The run's sizes left to the planner resolved for this device (`auto_sizes`) and the plan for them
    (`memory_plan`, which raises over memory.budget_gib), the choices kept in the plan as `auto_choices`."""
    cfg, auto = auto_sizes(cfg, source)
    plan = memory_plan(cfg, source)
    check_cap(plan, cfg.memory.cap_gib, cfg.mode.name)  # a cap under the plan would stop the run where it peaks
    plan["auto_choices"] = auto
    return cfg, plan


def cap_allocator(cap_gib: float) -> None:
    """`memory.cap_gib`: torch's allocator on this process's GPU stops at `cap_gib` (0: no cap)."""
    if not cap_gib:
        return
    if not torch.cuda.is_available():
        raise ValueError(f"memory.cap_gib={cap_gib:g} caps a GPU's allocator and this run has no GPU: drop it")
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    if cap_gib * 2**30 > total:
        raise ValueError(f"memory.cap_gib={cap_gib:g} is more than this GPU's {total / 2**30:.1f} GiB: lower it, "
                         "or 0 for no cap")
    torch.cuda.set_per_process_memory_fraction(cap_gib * 2**30 / total)


class Runtime:
    """What every mode uses: actor (DDP), reference, optimizer, rollout engine, data source, loss."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        cfg.check_training()
        init_parallel(cfg.parallel.tp, cfg.parallel.pp, cfg.seed, cfg.parallel.backend, cfg.rollout.tp,
                      cfg.parallel.rollout_ranks)
        self.layouts = layouts()
        self.source = build_source(cfg)  # bad data settings fail before building models
        samples = {"rollout.group_size": cfg.rollout.group_size, **({"val.n": cfg.val.n} if cfg.data.val_files else {})}
        # one group of the longest prompt fits the rollout's KV cache; a rollout model of its own (a weights phase)
        # holds every layer
        check_kv_budget(cfg, self.source, samples, cfg.weights_phase is not None)
        cfg, self.plan = run_plan(cfg, self.source)  # over memory.budget_gib: fails here, before any model
        self.cfg, auto = cfg, self.plan["auto_choices"]
        if auto and dist.get_rank() == 0:
            print(auto_size_text(auto, self.plan["released"] if cfg.memory.plan == "auto" else None), flush=True)
        check_run_fits(cfg, self.source, self.plan)  # over the machine's free memory (CPU: the host's) too
        check_window_graphs(cfg, self.plan["released"], torch.cuda.is_available())
        cap_allocator(cfg.memory.cap_gib)
        if cfg.rollout.engine == "embedded":
            check_decode_settings(cfg)  # the decode kernels this device can run, before any model
        # Built in the order the planner's `setup` point counts (memory/planner.py `setup_classes`), each class the
        # plan releases released as soon as it exists: the actor, DDP's grads, the optimizer's fp32 masters, the
        # reference (a copy of the initial actor). The run so never holds them all at once, as no phase does.
        rel = frozenset(self.plan["released"])  # what memory.plan releases (auto: what the budget needs)
        if cfg.rollout.engine == "sglang" and "reference_weights" in rel:
            # SGLang's scheduler holds CUDA IPC handles of the reference's parameters: an offload would free
            # nothing (IPC keeps the allocation alive) and the prefetch would allocate a second copy
            rel = rel - {"reference_weights"}
            self.plan["released"] = [n for n in self.plan["released"] if n != "reference_weights"]
            self.plan["sglang"] = ("reference_weights kept resident (shared with SGLang's scheduler); the per-phase "
                                   "bytes above were planned with it released")
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()  # start-up's own peak (`measured_setup_gib`)
        actor = build_policy(cfg)
        self.ddp = wrap_ddp(actor)
        ahead = {k: v for k, v in self.plan.get("ahead", {}).items() if k in rel}  # SGLang's reference: kept
        self.memory = MemoryManager(rel, cfg.mode.name, self.ddp, None, None, cfg.memory.copy_streams, ahead,
                                    cfg.memory.optimizer_step, cfg.memory.optimizer_bucket_mib,
                                    cfg.memory.optimizer_buckets)
        self.memory.release_built(("grads",))
        with default_group_is_train_world():
            self.optimizer = build_optimizer(self.ddp, cfg.optim, bf16=cfg.dtype == "bfloat16")
        self.memory.set_optimizer(self.optimizer)
        self.memory.release_built(("main_weights",))
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
        self.ref = None  # train.reference: none where the loss does not read it (kl_coef 0 under auto)
        if cfg.train.uses_reference:
            self.ref = training_model(cfg)
            self.ref.load_state_dict(actor.state_dict())  # the reference is the initial policy, frozen
            self.ref.requires_grad_(False)
            self.memory.add_reference(self.ref)
            self.memory.release_built(("reference_weights",))
        self.memory.reserve_host()  # the rest (Adam's states: sized from the parameters they mirror)
        self.plan["host_buffers_s"] = self.memory.host_reserve_s  # a start-up cost, not step 1's and 2's
        self.record_setup_peak()
        self.recompute = "actor_prefix_graph" in rel  # the actor prefix keeps no graph
        if cfg.rollout.engine == "sglang":
            import_sglang()  # a one-line error before any SGLang work when it is missing
        # the actor's graph-bearing prefix packs, lowered by the plan until one recomputed pack fits (auto: as set)
        self.actor_pack_tokens = self.plan.get("actor_pack_tokens", cfg.workload.prefix_pack_tokens)
        self.engine = build_engine(self.ddp, cfg, self.layouts, self.ref, self.actor_pack_tokens)
        # the window's reference items as CUDA graphs (the planner counts their pool: reference_prefix_graphs)
        self.prefix_graphs = PrefixGraphs(cfg.mode.window_graph_buckets) if cfg.mode.window_graphs else None
        if isinstance(self.engine, RolloutReplicas):  # what the rollout model owns on this rank (views: nothing)
            self.plan["rollout_layout"] = {"rollout_tp": self.layouts.rollout_tp, "replicas": self.engine.replicas,
                                           "allocated_bytes": self.engine.allocated_bytes(),
                                           "split_gemm": cfg.rollout.split_gemm}
        r = cfg.rollout
        self.sampling = SamplingParams(r.temperature, r.top_p, r.top_k)
        # every log-prob the loss sees is the sampled policy's: its temperature, its banned tokens (docs/design.md §3)
        self.banned = cfg.model.vision_token_ids  # the engine's sampler bans them too
        self.logprob_kernel = logprob_kernel_for(cfg.train.logprob_kernel, device())
        self.norm_kernel = norm_kernel_for(cfg.train.norm_kernel, device())  # what training_model applied
        self.rope_kernel = rope_kernel_for(cfg.train.rope_kernel, device())
        self.score_loss = partial(X.logprob_loss, temperature=r.temperature, banned=self.banned,
                                  tp_rank=ps.get_tensor_model_parallel_rank(),
                                  tp_group=ps.get_tensor_model_parallel_group(), kernel=self.logprob_kernel)
        self.backend = cfg.mode.attention_backend
        self.pack_tokens = cfg.workload.prefix_pack_tokens  # prefix stages of several groups as one forward
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.pp_size = ps.get_pipeline_model_parallel_world_size()
        self.dp_group, self.tp_group = ps.get_data_parallel_group(), ps.get_tensor_model_parallel_group()
        self.dev = device()
        self.data_seconds = 0.0
        self.data_cursor = 0  # the data stream's next batch index (the step, unless dynamic sampling resampled)

    def record_setup_peak(self) -> None:
        """The allocator's peak since start-up began into the plan (`measured_setup_gib`, beside its `setup`
        entry): after construction, and again after a resume's load, which the planner's point includes."""
        if torch.cuda.is_available():
            self.plan["measured_setup_gib"] = torch.cuda.max_memory_allocated() / 2**30

    def requests(self, index: int):
        """This rank's rows and rollout requests of the data stream's batch `index` (deterministic in
        seed, index and rank; without dynamic sampling the index is the step); `data_seconds` adds the
        time this rank waited for them (prompt building, or its prefetch)."""
        src, g = self.source, self.cfg.rollout.group_size
        t0 = time.perf_counter()
        rows = src.rows(index, self.dp_rank, self.dp_size, self.cfg.prompts_per_rank)
        self.data_seconds += time.perf_counter() - t0
        r = self.cfg.rollout
        if not r.length_dist:
            return rows, [RolloutRequest(q.prompt, g, src.max_new_tokens, src.stop_token_ids, seed=q.seed)
                          for q in rows]
        lens = drawn_lengths(r.length_mean, r.length_sigma, src.max_new_tokens, len(rows),
                             self.cfg.seed * 1_000_003 + index * self.dp_size + self.dp_rank)
        return rows, [RolloutRequest(q.prompt, g, n, (), seed=q.seed) for q, n in zip(rows, lens)]

    def score(self, rows, requests, rollout) -> StepBatch:
        """Rewards, group advantages and Groups from the rollout."""
        scores = [[self.source.score(row, t) for t in res.tokens] for row, res in zip(rows, rollout.results)]
        rewards, correct, answered = self._agreed(torch.tensor([[[s.reward, s.correct, s.answered] for s in row]
                                                                for row in scores])).unbind(-1)
        adv = group_advantages(rewards, self.cfg.train.normalize_std)
        groups = [Group(r.prompt, res.tokens, a) for r, res, a in zip(requests, rollout.results, adv)]
        validate_groups(self.cfg.model, groups, self.cfg.rollout.max_response_len)
        return StepBatch(rows, requests, groups, rewards, correct, answered,
                         [list(res.logprobs) for res in rollout.results], [[s.extra for s in row] for row in scores])

    def _agreed(self, scores: torch.Tensor) -> torch.Tensor:
        """The model replica's first rank's scores on every rank of it (TP and PP peers score the same
        tokens, but a reward function need not be deterministic: one replica must train on one set of
        advantages and take the same dynamic-sampling decisions, or its collectives would diverge)."""
        group = ps.get_model_parallel_group()
        if dist.get_world_size(group) == 1:
            return scores
        t = scores.to(self.dev)
        dist.broadcast(t, dist.get_global_rank(group, 0), group=group)
        return t.cpu()

    def mini_batches(self, batch: StepBatch) -> list[MiniBatch]:
        """`train.ppo_mini_batches` consecutive slices of whole groups, with their global counts."""
        slices = X.mini_batch_slices(len(batch.groups), self.cfg.train.ppo_mini_batches)
        counts = torch.tensor([[float(sum(r.numel() for gi in sl for r in batch.groups[gi].responses)),
                                float(sum(len(batch.groups[gi].responses) for gi in sl))] for sl in slices],
                              dtype=torch.float64, device=self.dev)
        dist.all_reduce(counts, group=self.dp_group)
        return [MiniBatch(sl, int(c[0]), int(c[1])) for sl, c in zip(slices, counts.tolist())]

    def pack_starts(self, n: int) -> frozenset[int]:
        """Of a batch of `n` groups, those where a prefix pack must start: its PPO mini-batches' first groups."""
        return X.mini_batch_starts(n, self.cfg.train.ppo_mini_batches)

    def micro_batches(self, batch: StepBatch, kind: str, mini: MiniBatch):
        """Full-sequence or response-stage micro-batches of one mini-batch, with the advantages (and
        the loss aggregation's weights) laid per token."""
        build = B.full_micro_batches if kind == "full" else B.response_micro_batches
        w = self.cfg.workload
        mbs = build(self.cfg.model, batch.groups, w.responses_per_micro_batch, mini.total_tokens, select=mini.groups,
                    max_tokens=w.micro_batch_tokens)
        keys = [(gi, ri) for gi in mini.groups for ri in range(len(batch.groups[gi].responses))]
        lens = [batch.groups[gi].responses[ri].numel() for gi, ri in keys]
        B.attach_token_data(mbs, "adv", {(gi, ri): torch.full((n,), float(batch.groups[gi].advantages[ri]))
                                         for (gi, ri), n in zip(keys, lens)})
        t = self.cfg.train
        if t.loss_agg_mode != "token-mean":  # token-mean is GRPOLoss's own weighting (no tensor needed)
            # Dr. GRPO's constant: the longest response this run generates (a rendered task's
            # task.max_answer_tokens, a dataset's rollout.max_response_len)
            ws = loss_weights(lens, t.loss_agg_mode, mini.responses, mini.total_tokens, self.source.max_new_tokens)
            B.attach_token_data(mbs, "loss_w", {k: torch.full((n,), w) for k, n, w in zip(keys, lens, ws)})
        return mbs

    def loss(self, mini: MiniBatch):
        """The GRPO loss of one mini-batch (its statistics are token means over its global token count)."""
        t = self.cfg.train
        return GRPOLoss(t.kl_coef, t.clip_low, t.clip_high, mini.total_tokens, self.tp_group, t.entropy_coef,
                        self.cfg.rollout.temperature, t.kl_estimator, self.banned, t.clip_ratio_c,
                        self.logprob_kernel)

    def sync_rollout_weights(self) -> float:
        """After the step's optimizer steps: the rollout's weights brought up to date (its engine's
        `weights_phase`: rebuilt views, or weights sent to the rollout ranks); seconds."""
        return self.engine.sync_weights()

    def optimizer_step(self, advance: bool = True) -> dict:
        """megatron optimizer step (clipping included) at the scheduler's learning rate, then (with
        `advance`: after an RL step's last mini-batch) the scheduler's step: the schedule counts RL
        steps, as verl's does. Gradients are zeroed for the next update."""
        lr = current_lr(self.optimizer)
        with span("optimizer_step"):
            out = {**optimizer_step(self.optimizer, self.memory.streamed_step), "lr": lr}
        if advance:
            self.scheduler.step(increment=1)
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        return out
