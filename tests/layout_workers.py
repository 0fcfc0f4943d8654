"""Workers for the rollout-layout tests: the rollout at rollout.tp != parallel.tp inside the step."""
from __future__ import annotations

import dataclasses
import os
import tempfile

import torch
import torch.distributed as dist

from tests.numerics import rel_err


def _full_copy(rt, cfg, src_dir):
    """A rollout model at the rollout layout loaded from a full, independent copy of the training weights
    (gathered over the training TP group, written as an HF directory, loaded like any checkpoint)."""
    from megatron.core import parallel_state as ps

    from rollplex_megatron.models.qwen25vl import build_model
    from rollplex_megatron.models.qwen25vl.hf import (HFCheckpoint, export_hf_tensors, load_hf_into_model,
                                                      write_safetensors)

    t = cfg.parallel.tp
    mine = {n: p.detach().clone() for n, p in rt.ddp.module.named_parameters()}
    states = [None] * t
    dist.all_gather_object(states, mine, group=rt.tp_group)
    out = tempfile.mkdtemp(prefix=f"rank{dist.get_rank()}_")
    ck = HFCheckpoint(src_dir)
    write_safetensors(export_hf_tensors([states], cfg.model, t, 1, ck.naming), out)
    with open(os.path.join(out, "config.json"), "w") as f, open(os.path.join(src_dir, "config.json")) as g:
        f.write(g.read())
    with rt.layouts.use("rollout"):
        model = build_model(cfg.model, cfg.dtype, cfg.megatron)
        load_hf_into_model(model, HFCheckpoint(out), cfg.model, ps.get_tensor_model_parallel_rank(),
                           rt.layouts.rollout_tp, 0, 1)
    return model


def shared_vs_full_copy(cfg, steps: int, mutant: str = "") -> dict:
    """Before every step: this rank's next requests decoded on the shared weights and on a full copy of the
    same weights (same layout, same replicas); then the step trains (serial mode). Also the storage
    identity of the view-class tensors and the bytes the rollout model owns."""
    from rollplex_megatron.memory.planner import shared_rollout_bytes
    from rollplex_megatron.rollout.replicas import RolloutReplicas
    from rollplex_megatron.trainer.loop import run_step
    from rollplex_megatron.trainer.modes import MODES
    from rollplex_megatron.trainer.runtime import Runtime

    if mutant == "skip_refresh":
        Runtime.sync_rollout_weights = lambda self: 0.0
    rt = Runtime(cfg)
    mode = MODES[cfg.mode.name]()
    shared = rt.engine
    roll = dict(shared.model.named_parameters())
    train = dict(rt.ddp.module.named_parameters())
    views, own = {}, 0
    for p in shared.weights.plan:
        same = roll[p.name].untyped_storage().data_ptr() == train[p.name].untyped_storage().data_ptr()
        if p.klass in ("view", "strided_view"):
            views[p.name] = same
        elif not same:
            own += roll[p.name].numel() * roll[p.name].element_size()
    train_ptrs = {p.untyped_storage().data_ptr() for p in train.values()}
    own += sum(b.numel() * b.element_size() for b in shared.weights.remote.values()  # split GEMMs' received pieces
               if b.numel() == 0 or b.untyped_storage().data_ptr() not in train_ptrs)
    steps_out = []
    for step in range(steps):
        _, reqs = rt.requests(rt.data_cursor)
        a = shared.generate(reqs, rt.sampling)
        b = RolloutReplicas(rt.ddp.module, cfg, rt.layouts, full_copy=_full_copy(rt, cfg, cfg.train.init_hf))
        b = b.generate(reqs, rt.sampling)
        toks = [[x.tolist() for x in r.tokens] for r in a.results]
        same_tokens = toks == [[x.tolist() for x in r.tokens] for r in b.results]
        lp = rel_err(torch.cat([x for r in a.results for x in r.logprobs]),
                  torch.cat([x for r in b.results for x in r.logprobs])) if same_tokens else float("inf")
        steps_out.append({"same_tokens": same_tokens, "logp_rel": lp, "tokens": toks})
        run_step(rt, mode, step)
    return {"steps": steps_out, "views": views, "view_classes": sum(views.values()), "own_bytes": own,
            "allocated": shared.allocated_bytes(), "planned": shared_rollout_bytes(cfg),
            "planned_off": shared_rollout_bytes(dataclasses.replace(cfg, rollout=dataclasses.replace(
                cfg.rollout, split_gemm="off"))),
            "replicas": shared.replicas, "rank": dist.get_rank()}


def uneven_steps(cfg, steps: int, short: int, long: int, mutant: str = "") -> dict:
    """`steps` RL steps where the first half of the global requests (the first replicas') get `short`-token
    responses and the rest `long`-token ones (stop tokens ignored, as `rollout.length_dist` does)."""
    from rollplex_megatron.rollout.engine import RolloutRequest
    from rollplex_megatron.trainer.runtime import Runtime
    from tests.trainer_workers import run_steps

    def requests(self, index):
        rows, reqs = plain(self, index)
        n_all = len(reqs) * self.dp_size
        out = []
        for k, q in enumerate(reqs):
            pos = self.dp_rank * len(reqs) + k  # place in the global (DP-rank ordered) request list
            out.append(RolloutRequest(q.prompt, q.n, short if pos < n_all // 2 else long, (), q.seed))
        return rows, out

    plain, Runtime.requests = Runtime.requests, requests
    res = run_steps(cfg, steps, mutant)
    res["lengths"] = [[len(x) for x in g] for g in res["tokens"][0]]
    return res


def disaggregated_steps(cfg, steps: int, mutant: str = "") -> dict:
    """`steps` RL steps under mode=disaggregated: the rollout ranks serve, the training ranks train (as
    trainer_workers.run_steps does) and stop them at the end. `skip_transfer`: no weights are sent after
    the optimizer steps (the rollout keeps the initial weights)."""
    from rollplex_megatron.dist import init_parallel, layouts
    from rollplex_megatron.rollout.disaggregated import RolloutWorker, command
    from rollplex_megatron.trainer.runtime import Runtime
    from tests.trainer_workers import run_steps

    p = cfg.parallel
    init_parallel(p.tp, p.pp, cfg.seed, p.backend, cfg.rollout.tp, p.rollout_ranks)
    if layouts().role == "rollout":
        return {"rollout": RolloutWorker(cfg, layouts()).serve()}
    if mutant == "skip_transfer":
        Runtime.sync_rollout_weights = lambda self: 0.0
    try:
        return run_steps(cfg, steps)
    finally:
        command(("stop", None))


def train_run(cfg, out: str, steps: int, resume: bool, mutant: str = "") -> list[dict]:
    """The training loop (`train_rank`) into `out` for `steps` steps (resuming its checkpoint with `resume`);
    the step records. `skip_sync`: the rollout's weights are never brought up to date (after a resume
    the rollout model would keep the weights it was bound with before the checkpoint was loaded)."""
    from rollplex_megatron.trainer.loop import train_rank
    from rollplex_megatron.trainer.runtime import Runtime

    if mutant == "skip_sync":
        Runtime.sync_rollout_weights = lambda self: 0.0
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, out=out, steps=steps, resume=resume,
                                                             progress=False))
    return train_rank(cfg)["records"]
