"""Worker functions for the memory-manager tests (importable for spawn)."""
from __future__ import annotations

import torch


def round_trip(cfg):
    """Offload every managed class, check the device storage is gone, bring it back: bytes equal?"""
    from rollplex_megatron.trainer.loop import run_step
    from rollplex_megatron.trainer.modes import MODES
    from rollplex_megatron.trainer.runtime import Runtime

    rt = Runtime(cfg)
    mode = MODES[cfg.mode.name]()
    run_step(rt, mode, 0)  # Adam's states exist from the first optimizer step on
    mm = rt.memory
    mm.restore_all()  # after the step the reference is offloaded (rollplex); reading it needs it back
    for p in rt.ddp.module.parameters():  # nonzero gradients, to see them freed and come back zeroed
        p.main_grad.add_(1.0)
    names = ("main_weights", "optimizer_states", "reference_weights")
    before = {n: [t.detach().clone() for t in mm.classes[n].tensors()] for n in names}
    out = {"counts": {n: len(v) for n, v in before.items()}}
    mm.enter("update")  # reference offloaded (rollplex), main weights and states offloaded
    out["released_update"] = {n: sum(t.untyped_storage().nbytes() for t in mm.classes[n].tensors())
                              for n in ("main_weights", "optimizer_states", "reference_weights")}
    mm.enter("rollout")  # gradients freed, reference back
    out["grads_rollout"] = mm.resident_bytes()["grads"]
    same = lambda n: all(a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # noqa: E731
                         for a, b in zip(before[n], mm.classes[n].tensors()))
    out["bit_exact"] = {"reference_weights": same("reference_weights")}  # back for the rollout
    mm.enter("optimizer")  # main weights and Adam states back (the reference is offloaded again)
    out["bit_exact"].update({n: same(n) for n in ("main_weights", "optimizer_states")})
    out["grads_zero_after_restore"] = all(float(p.main_grad.abs().max()) == 0 for p in rt.ddp.module.parameters())
    out["managed"] = mm.phase_bytes
    return out


def setup_points(cfg, mutant: str = ""):
    """The runtime's start-up on this rank: the bytes of the actor, DDP's grads, the fp32 masters and the reference
    on the device at each construction point (each `release_built` call, before it releases, and the end), their
    full sizes, and what the plan released. `mutant="no_release"`: start-up releases nothing."""
    from rollplex_megatron.memory import manager as M
    from rollplex_megatron.trainer.runtime import Runtime

    def held(mm, full: bool = False) -> dict:
        n = (lambda ts: sum(t.numel() * t.element_size() for t in ts)) if full else \
            (lambda ts: sum(s.nbytes() for s in M._storages(ts)))
        ref = mm.classes.get("reference_weights")
        return {"actor_weights": n(list(mm.ddp.module.parameters())),
                "grads": n([b.grad_data for b in mm.ddp.buffers]),
                "main_weights": n(M._main_weights(mm.optimizer)),
                "reference_weights": n(ref.tensors()) if ref else 0}

    points, orig = [], M.MemoryManager.release_built

    def recording(mm, names):
        points.append(held(mm))
        if mutant != "no_release":
            orig(mm, names)
    M.MemoryManager.release_built = recording
    try:
        rt = Runtime(cfg)
    finally:
        M.MemoryManager.release_built = orig
    points.append(held(rt.memory))
    return {"points": points, "sizes": held(rt.memory, full=True), "released": sorted(rt.memory.released)}


def load_without_holding(cfg):
    """Mutation of the resume under a release plan: the latest checkpoint of cfg.train.out loaded with the released
    classes left off the device (raises)."""
    from rollplex_megatron.checkpoint import train_state
    from rollplex_megatron.trainer.runtime import Runtime

    rt = Runtime(cfg)
    latest = train_state.latest_checkpoint(cfg.train.out)
    return train_state.load_checkpoint(latest, rt.ddp.module, rt.ref, rt.optimizer)


def plan_steps(cfg, steps: int, mutant: str = ""):
    """`steps` steps of cfg.mode under cfg.memory.plan; tokens, records and final weights."""
    from rollplex_megatron.memory import manager as M
    from tests.trainer_workers import run_steps

    if mutant == "copy_once":  # the offload copies each class to the host only the first time
        orig = M.MemoryManager._copy

        def copy_once(self, c, src, dst, kind):
            if kind == "d2h" and getattr(c, "copied", False):
                return
            c.copied = bool(src)
            orig(self, c, src, dst, kind)

        M.MemoryManager._copy = copy_once
    return run_steps(cfg, steps)


def recompute_vs_saved(cfg, hf_dir, mutant: str = ""):
    """actor_prefix_step with the prefix recomputed at backward against the saved graph (any TP/PP)."""
    from rollplex_megatron.prefix import execution

    if mutant == "empty_recompute":  # the recomputed graph never reaches the backward
        orig = execution._recompute
        def empty(m, st, store):
            state, _, drift = orig(m, st, store)
            return state, {}, drift

        execution._recompute = empty
    if mutant == "empty_pack_recompute":  # a recomputed pack's graph never reaches the backward
        orig_pack = execution._recompute_pack

        def empty_pack(m, pack, members, store):
            state, _, drift = orig_pack(m, pack, members, store)
            return state, {}, drift

        execution._recompute_pack = empty_pack
    from megatron.core import parallel_state as ps

    from rollplex_megatron.models.qwen25vl.hf import HFCheckpoint, load_hf_into_model
    from rollplex_megatron.dist import init_parallel
    from rollplex_megatron.verify.equivalence import _grads, random_groups
    from rollplex_megatron.runtime import wrap_ddp
    from rollplex_megatron.models.qwen25vl import build_model
    from rollplex_megatron.prefix import batch as B
    from rollplex_megatron.prefix import execution as X

    ck = HFCheckpoint(hf_dir)
    cfg.model = ck.model_config()
    init_parallel(cfg.parallel.tp, cfg.parallel.pp, cfg.seed, cfg.parallel.backend)
    model = build_model(cfg.model, cfg.dtype)
    load_hf_into_model(model, ck, cfg.model, ps.get_tensor_model_parallel_rank(), cfg.parallel.tp,
                       ps.get_pipeline_model_parallel_rank(), cfg.parallel.pp)
    ddp = wrap_ddp(model)
    groups = random_groups(cfg, ps.get_data_parallel_rank())
    n_tok = sum(r.numel() for g in groups for r in g.responses)
    mbs = B.response_micro_batches(cfg.model, groups, cfg.verify.responses_per_micro_batch, n_tok)
    out = {}
    for recompute in (False, True):
        ddp.zero_grad_buffer()
        res = X.actor_prefix_step(ddp, groups, mbs, "sdpa", recompute=recompute,
                                  pack_tokens=cfg.workload.prefix_pack_tokens)
        out[recompute] = (_grads(ddp), [r["logp"] for r in res])
    g0, g1 = out[False][0], out[True][0]
    err = max(float((g1[n] - g0[n]).norm() / g0[n].norm().clamp_min(1e-30)) for n in g0)
    moved = sum(float(g0[n].norm()) for n in g0)
    same_logp = all(torch.equal(a, b) for a, b in zip(out[False][1], out[True][1]))
    return {"err": err, "grad_norm_sum": moved, "same_logp": same_logp,
            "vision_grads": any(n.startswith("vision") or "visual" in n for n in g0)}
