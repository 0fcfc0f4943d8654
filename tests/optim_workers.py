"""Workers for the optimizer and training-checkpoint tests (importable for spawn), including mutants."""
from __future__ import annotations

import os
import random

import torch
import torch.distributed as dist

EXTRA = {"rollout_cursor": 17, "note": "resume me"}


def _setup(cfg, hf_dir: str | None = None):
    """Parallel state, DDP-wrapped actor (optionally loaded from `hf_dir`), megatron optimizer."""
    from megatron.core import parallel_state as ps

    from rollplex_megatron.models.qwen25vl.hf import HFCheckpoint, load_hf_into_model
    from rollplex_megatron.dist import init_parallel
    from rollplex_megatron.runtime import wrap_ddp
    from rollplex_megatron.models.qwen25vl import build_model
    from rollplex_megatron.optim import build_optimizer

    init_parallel(cfg.parallel.tp, cfg.parallel.pp, cfg.seed, cfg.parallel.backend)
    random.seed(cfg.seed)  # the batch seeds below come from Python's RNG, so resume must restore it
    model = build_model(cfg.model, cfg.dtype)
    if hf_dir is not None:
        load_hf_into_model(model, HFCheckpoint(hf_dir), cfg.model, ps.get_tensor_model_parallel_rank(),
                           cfg.parallel.tp, ps.get_pipeline_model_parallel_rank(), cfg.parallel.pp)
    ddp = wrap_ddp(model)
    return ddp, build_optimizer(ddp, cfg.optim, cfg.dtype == "bfloat16")


def _reference(cfg):
    """A separate reference model whose weights differ from the actor's (sign-flipped)."""
    from rollplex_megatron.models.qwen25vl import build_model

    ref = build_model(cfg.model, cfg.dtype)
    with torch.no_grad():
        for p in ref.parameters():
            p.neg_()
    return ref


def train_step(cfg, ddp, optimizer) -> dict:
    """One full-sequence forward/backward on a fresh random batch, then one optimizer step."""
    from megatron.core import parallel_state as ps

    from rollplex_megatron.verify.equivalence import random_groups
    from rollplex_megatron.optim import optimizer_step
    from rollplex_megatron.prefix.batch import full_micro_batches
    from rollplex_megatron.prefix.execution import full_sequence_step

    cfg.verify.seed = random.randrange(1_000_000)
    groups = random_groups(cfg, ps.get_data_parallel_rank())
    dev = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"  # NCCL needs CUDA tensors
    n_tok = torch.tensor(float(sum(r.numel() for g in groups for r in g.responses)), device=dev)
    dist.all_reduce(n_tok, group=ps.get_data_parallel_group())
    mbs = full_micro_batches(cfg.model, groups, cfg.verify.responses_per_micro_batch, int(n_tok))
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    full_sequence_step(ddp, mbs, backend=cfg.verify.attention_backend)
    return optimizer_step(optimizer)


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in getattr(model, "module", model).named_parameters()}


def train(cfg, run_dir: str, steps: int, save_at: int) -> dict:
    """`steps` optimizer steps, saving a checkpoint (with a reference model) after `save_at` of them."""
    from rollplex_megatron.checkpoint.train_state import save_checkpoint
    from rollplex_megatron.recipes import to_yaml

    ddp, opt = _setup(cfg)
    ref = _reference(cfg)
    stats = []
    for step in range(1, steps + 1):
        stats.append(train_step(cfg, ddp, opt))
        if step == save_at:
            save_checkpoint(run_dir, step, ddp, ref, opt, EXTRA, to_yaml(cfg))
    return {"params": _params(ddp), "reference": _params(ref), "stats": stats}


def resume(cfg, run_dir: str, steps: int, mutation: str | None = None) -> dict:
    """Fresh models, load the latest checkpoint (optionally broken by `mutation`), train to `steps`."""
    from rollplex_megatron.checkpoint import train_state as T
    from rollplex_megatron.models.qwen25vl import build_model

    ddp, opt = _setup(cfg)
    ref = build_model(cfg.model, cfg.dtype)
    set_rng = T.set_rng_states
    if mutation == "skip_optimizer":
        opt.load_state_dict = lambda state: None
    elif mutation == "skip_rng":
        T.set_rng_states = lambda states: None
    elif mutation is not None:
        raise ValueError(f"unknown mutation {mutation!r}")
    try:
        done, extra = T.load_checkpoint(T.latest_checkpoint(run_dir), ddp, ref, opt)
    finally:
        T.set_rng_states = set_rng
    for _ in range(done, steps):
        train_step(cfg, ddp, opt)
    return {"params": _params(ddp), "reference": _params(ref), "step": done, "extra": extra}


def resume_mutants(cfg, run_dir: str, steps: int, mutations: list[str]) -> dict:
    """`resume` once per mutation in this process (each from freshly built, freshly seeded models)."""
    return {m: resume(cfg, run_dir, steps, m)["params"] for m in mutations}


def broken_resumes(cfg, run_dir: str, steps: int, mutations: list[str], foreign_run_dir: str,
                   swapped_run_dir: str) -> dict:
    """One launch for the failing cases: `resume_mutants`, then `load_error` on another layout's run and on a run
    whose rank files were swapped."""
    return {"mutants": resume_mutants(cfg, run_dir, steps, mutations),
            "foreign_error": load_error(cfg, foreign_run_dir), "swapped_error": load_error(cfg, swapped_run_dir),
            "without_reference": load_without_reference(cfg, run_dir)}


def load_without_reference(cfg, run_dir: str) -> dict:
    """Load a checkpoint that holds a reference into a run that builds none (train.reference=auto at kl_coef 0):
    whether the checkpoint had one, and whether the actor came back equal to its saved state."""
    import torch.distributed as dist

    from rollplex_megatron.checkpoint import train_state as T

    ddp, opt = _setup(cfg)
    path = T.latest_checkpoint(run_dir)
    T.load_checkpoint(path, ddp, None, opt)
    saved = torch.load(path / T.rank_file_name(dist.get_rank()), map_location="cpu", weights_only=False)
    mine = T._module(ddp).state_dict()
    return {"saved_reference": saved["reference"] is not None,
            "actor_equal": all(torch.equal(mine[k], v) for k, v in saved["model"].items() if torch.is_tensor(v))}


class InjectedFailure(RuntimeError):
    """The crash the atomicity test injects."""


def _partial_save(obj, f, *a, **k):
    f.write(b"half a checkpoint")
    raise InjectedFailure("torch.save crashed mid-file")


def _failing_save(run_dir, step, ddp, opt, where: str) -> str:
    """Save `step` with a crash injected at `where`; returns the error text."""
    from rollplex_megatron.checkpoint import train_state as T

    orig_save, orig_replace = torch.save, os.replace
    target = {"rename": T.step_dir_name(step), "latest": T.LATEST}.get(where)

    def replace(src, dst):
        if os.path.basename(dst) == target:
            raise InjectedFailure(f"crashed just before the rename to {target}")
        return orig_replace(src, dst)

    torch.save, os.replace = (_partial_save, orig_replace) if where == "rank_file" else (orig_save, replace)
    try:
        T.save_checkpoint(run_dir, step, ddp, None, opt, {"step": step}, "")
    except InjectedFailure as e:
        return str(e)
    finally:
        torch.save, os.replace = orig_save, orig_replace
    raise AssertionError(f"the failure injected at {where} did not surface")


def _snapshot(run_dir: str) -> dict:
    from rollplex_megatron.checkpoint import train_state as T

    root = os.path.join(run_dir, T.CHECKPOINTS)
    return {"listing": sorted(os.listdir(root)), "latest": T.latest_checkpoint(run_dir).name,
            "tmp_files": sorted(f for d in os.listdir(root) if d.startswith("step_") and ".tmp-" in d
                                for f in os.listdir(os.path.join(root, d)))}


def atomic_failures(cfg, run_dir: str) -> dict:
    """Checkpoint step 1; crash saves of step 2 mid-file, before the directory rename and before the
    `latest` rename; load what `latest` names; then save step 2 for real."""
    from rollplex_megatron.checkpoint import train_state as T

    ddp, opt = _setup(cfg)
    train_step(cfg, ddp, opt)
    T.save_checkpoint(run_dir, 1, ddp, None, opt, {"step": 1}, "")
    at_1 = _params(ddp)
    train_step(cfg, ddp, opt)
    errors = [_failing_save(run_dir, 2, ddp, opt, w) for w in ("rank_file", "rename")]
    after_failures = _snapshot(run_dir)
    errors.append(_failing_save(run_dir, 2, ddp, opt, "latest"))
    after_latest_failure = _snapshot(run_dir)
    step, extra = T.load_checkpoint(T.latest_checkpoint(run_dir), ddp, None, opt)
    restored = all(torch.equal(p, at_1[n]) for n, p in _params(ddp).items())
    train_step(cfg, ddp, opt)
    T.save_checkpoint(run_dir, 2, ddp, None, opt, {"step": 2}, "")
    return {"errors": errors, "after_failures": after_failures, "after_latest_failure": after_latest_failure,
            "loaded_step": step, "loaded_extra": extra, "restored": restored, "after_retry": _snapshot(run_dir)}


def load_error(cfg, run_dir: str) -> str:
    """Load the run's latest checkpoint into this layout; return the error message."""
    from rollplex_megatron.checkpoint import train_state as T

    ddp, opt = _setup(cfg)
    try:
        T.load_checkpoint(T.latest_checkpoint(run_dir), ddp, None, opt)
    except ValueError as e:
        return str(e)
    raise AssertionError("loading a checkpoint of another layout succeeded")


def one_step_hf(cfg, hf_dir: str) -> dict:
    """From HF weights: one optimizer step; the updated weights gathered into HF names on rank 0."""
    from rollplex_megatron.models.qwen25vl.hf import HFCheckpoint, export_hf_tensors

    ck = HFCheckpoint(hf_dir)
    cfg.model = ck.model_config()
    ddp, opt = _setup(cfg, hf_dir)
    stats = train_step(cfg, ddp, opt)
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, _params(ddp))
    tp = cfg.parallel.tp
    return {"stats": stats, "weights": dict(export_hf_tensors([states], cfg.model, tp, 1, ck.naming))}


def disk_full_saves(cfg, run_dir: str) -> dict:
    """Checkpoint step 1; then save step 2 on a filesystem reported too full before the write (refused up front),
    and on one that fills up mid-write (torch's zip writer fails as on a real full disk); then save step 2 for
    real. The snapshot after each failure shows what was left behind."""
    from rollplex_megatron.checkpoint import train_state as T

    ddp, opt = _setup(cfg)
    train_step(cfg, ddp, opt)
    T.save_checkpoint(run_dir, 1, ddp, None, opt, {"step": 1}, "")
    real_usage, real_save = T.shutil.disk_usage, torch.save
    out = {}

    def tiny(path):
        return real_usage(path)._replace(free=1 << 20)

    def fills_up(obj, f, *a, **k):
        f.write(b"x" * 4096)
        T.shutil.disk_usage = tiny  # the disk is full from here on
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4160 vs 4096")

    for case, usage, save in (("before", tiny, real_save), ("midway", real_usage, fills_up)):
        T.shutil.disk_usage, torch.save = usage, save
        try:
            T.save_checkpoint(run_dir, 2, ddp, None, opt, {"step": 2}, "")
            out[case] = "saved"
        except T.DiskFullError as e:
            out[case] = str(e)
        finally:
            T.shutil.disk_usage, torch.save = real_usage, real_save
        out[f"{case}_snapshot"] = _snapshot(run_dir)
    T.save_checkpoint(run_dir, 2, ddp, None, opt, {"step": 2}, "")
    out["after_retry"] = _snapshot(run_dir)
    return out
