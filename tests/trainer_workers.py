"""Worker functions for the trainer tests (importable for spawn)."""
from __future__ import annotations


def no_reward(response, ground_truth, extra_info):
    """A reward function (`reward.fn=tests.trainer_workers:no_reward`) under which every advantage is 0."""
    return 0.0


def run_steps(cfg, steps: int, mutant: str = "", weights_after: int = 0):
    """`steps` RL steps of cfg.mode; per-step rollout tokens and records, initial and final weights (with
    `weights_after`, also the weights after that many steps: a longer run stands in for a shorter one), and
    how many responses each micro-batch the trainer built holds (`micro_batches`: one list per build)."""
    import torch
    from megatron.core import parallel_state as ps

    from rollplex_megatron.models import triton_rope
    from rollplex_megatron.trainer.loop import run_step
    from rollplex_megatron.trainer.modes import MODES
    from rollplex_megatron.trainer.runtime import Runtime

    if not hasattr(triton_rope, "launches"):  # the fused RoPE's kernels, counted once per process
        launch, triton_rope.launches = triton_rope._launch, {"forward": 0, "backward": 0}

        def counted(x, cos, sin, backward):
            triton_rope.launches["backward" if backward else "forward"] += 1
            return launch(x, cos, sin, backward)

        triton_rope._launch = counted
    launches_before = dict(triton_rope.launches)
    if mutant == "unrotated_rope":  # the attention contexts take the rotary tables and leave q and k as they are
        triton_rope.fused_rope = lambda x, tables: x
    if mutant == "skip_prefix_backward":
        from rollplex_megatron.prefix import execution

        execution.prefix_backward = lambda model, states, store: None
    if mutant == "stale_reference":  # the reference drifts with the actor (is not the initial policy)
        Runtime.optimizer_step_orig = Runtime.optimizer_step

        def drift(self, advance=True):
            out = Runtime.optimizer_step_orig(self, advance)
            self.memory.restore_all()  # under memory.plan=phase the reference may be offloaded here
            self.ref.load_state_dict(self.ddp.module.state_dict())
            return out

        Runtime.optimizer_step = drift
    if mutant == "stale_prefix":  # later PPO mini-batches read the rollout's prefix K/V (no recompute)
        from rollplex_megatron.attention.kv_store import KVStore
        from rollplex_megatron.prefix import execution
        from rollplex_megatron.trainer.modes.rollplex import Rollplex

        prepare, update = Rollplex.prepare, Rollplex.update

        def keep_all(self, rt, step, t):
            release, KVStore.release = KVStore.release, lambda store, group: None
            try:
                prep = prepare(self, rt, step, t)
            finally:
                KVStore.release = release
            prep.state["stale"] = (prep.state["actor_kv"], list(prep.state["states"]))
            return prep

        def stale(self, rt, prep, m, fresh):
            if fresh or m == 0 or "stale" not in prep.state:  # the first epoch's second mini-batch goes stale
                return update(self, rt, prep, m, fresh)
            store, states = prep.state.pop("stale")
            own = set(prep.minis[m].groups)
            return execution.actor_response_step(rt.ddp, prep.mbs[m], store, [s for s in states if s.group in own],
                                                 rt.backend, loss_fn=rt.loss(prep.minis[m]))[0]

        Rollplex.prepare, Rollplex.update = keep_all, stale
    if mutant == "twice_overflow":  # the token packer puts the response that overflows in two micro-batches
        from rollplex_megatron.prefix import batch

        packer, batch.pack_responses = batch.pack_responses, _twice_overflow
        try:  # this run only: the job's later cases pack with the real packer
            return run_steps(cfg, steps, "", weights_after)
        finally:
            batch.pack_responses = packer
    rt = Runtime(cfg)
    built, sizes = rt.micro_batches, []

    def counted(batch, kind, mini):
        mbs = built(batch, kind, mini)
        sizes.append([len(mb.responses) for mb in mbs])
        return mbs

    rt.micro_batches = counted
    if mutant in ("untempered", "unbanned"):  # the loss scores another policy than the one sampled
        from functools import partial

        from rollplex_megatron.prefix import execution
        from rollplex_megatron.rl.grpo import GRPOLoss

        temp = 1.0 if mutant == "untempered" else cfg.rollout.temperature
        banned = () if mutant == "unbanned" else rt.banned
        rt.score_loss = partial(execution.logprob_loss, temperature=temp, banned=banned)
        rt.loss = lambda batch: GRPOLoss(cfg.train.kl_coef, cfg.train.clip_low, cfg.train.clip_high,
                                         batch.total_tokens, rt.tp_group, temperature=temp,
                                         kl_estimator=cfg.train.kl_estimator, banned=banned)
    mode = MODES[cfg.mode.name]()
    first = {n: p.detach().float().clone() for n, p in rt.ddp.module.named_parameters()}
    tokens, records, informative, after = [], [], [], None
    for step in range(steps):
        records.append(run_step(rt, mode, step))
        tokens.append([[t.tolist() for t in g.responses] for g in rt.last_batch.groups])
        informative.append(sum(rt.last_batch.informative()))
        if step + 1 == weights_after:
            after = {n: p.detach().float().clone() for n, p in rt.ddp.module.named_parameters()}
    last = {n: p.detach().float().clone() for n, p in rt.ddp.module.named_parameters()}
    reference = [] if rt.ref is None else list(rt.ref.modules())  # none without the reference (train.reference)
    keep = ps.get_tensor_model_parallel_world_size() == 1 and ps.get_pipeline_model_parallel_world_size() == 1
    return {"tokens": tokens, "records": records, "informative": informative, "first": first if keep else None,
            "last": last if keep else None, "after": after if keep else None, "micro_batches": sizes,
            "logprob_kernel": rt.logprob_kernel, "norm_kernel": rt.norm_kernel, "rope_kernel": rt.rope_kernel,
            "memory_ahead": rt.plan.get("ahead"), "memory_manager_ahead": rt.memory.ahead,
            "rope_launches": {k: n - launches_before[k] for k, n in triton_rope.launches.items()},
            "ropes": sorted({m.rope_kernel for m in [*rt.ddp.module.modules(), *reference]
                             if hasattr(m, "rope_kernel")}),
            "norms": sorted({type(m).__name__ for m in [*rt.ddp.module.modules(), *reference]
                             if isinstance(m, torch.nn.RMSNorm)}),
            "has_reference": rt.ref is not None}


def _twice_overflow(lens, per_mb, max_tokens=0):
    """A broken token packer: the response that does not fit stays in the full micro-batch and also opens
    the next (packed twice: its tokens weigh double in the update)."""
    out, used = [[]], 0
    for i, n in enumerate(lens):
        if out[-1] and used + n > max_tokens:
            out[-1].append(i)
            out.append([])
            used = 0
        out[-1].append(i)
        used += n
    return out


def reward_extra_means(per_rank: list) -> dict:
    """`metrics.reward_extra_means` over a gloo world, this rank's extras `per_rank[rank]`."""
    import torch.distributed as dist

    from rollplex_megatron.trainer.metrics import reward_extra_means as means

    dist.init_process_group("gloo")
    try:
        return means(per_rank[dist.get_rank()], dist.group.WORLD, "cpu")
    finally:
        dist.destroy_process_group()


def dr_grpo_weights(cfg) -> dict:
    """One step's rollout and scoring, then the per-token loss weights `seq-mean-token-sum-norm` laid on the first
    mini-batch: their distinct values, the responses of the mini-batch and the data source's generation cap."""
    import torch

    from rollplex_megatron.trainer.modes import MODES
    from rollplex_megatron.trainer.metrics import PhaseTimer
    from rollplex_megatron.trainer.runtime import Runtime

    rt = Runtime(cfg)
    prep = MODES[cfg.mode.name]().prepare(rt, 0, PhaseTimer(rt.memory))
    w = torch.cat([mb.token_data["loss_w"][mb.label_mask] for mb in prep.mbs[0]])
    return {"weights": sorted(set(w.tolist())), "responses": prep.minis[0].responses,
            "cap": rt.source.max_new_tokens}
