"""Workers for the weight-sharing tests: training model at TP=t, rollout model at TP=r, same GPUs."""
from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist


def _logits(model, cfg):
    from rollplex_megatron.models.qwen25vl import gather_vocab_logits
    from rollplex_megatron.verify.parity import position_ids_for, sample_inputs

    x = sample_inputs(cfg, seed=4)
    with torch.no_grad():
        out = model(input_ids=x["input_ids"], position_ids=position_ids_for(cfg, x), pixel_values=x["pixel_values"],
                    image_grid_thw=x["image_grid_thw"], pixel_values_videos=x["pixel_values_videos"],
                    video_grid_thw=x["video_grid_thw"])
        return gather_vocab_logits(out, cfg.vocab_size)


def _reference(cfg, ck, r):
    """A rollout model loaded from a full, independent copy of the weights."""
    from megatron.core import parallel_state as ps

    from rollplex_megatron.models.qwen25vl.hf import load_hf_into_model
    from rollplex_megatron.models.qwen25vl import build_model

    ref = build_model(cfg)
    load_hf_into_model(ref, ck, cfg, ps.get_tensor_model_parallel_rank(), r, 0, 1)
    return ref


def _export_training(train, cfg, t, group, naming, src_dir):
    """The training weights as an HF directory (gathered over the training TP group)."""
    from rollplex_megatron.models.qwen25vl.hf import HFCheckpoint, export_hf_tensors, write_safetensors

    mine = {n: p.detach().clone() for n, p in train.named_parameters()}
    states = [None] * t
    dist.all_gather_object(states, mine, group=group)
    out = tempfile.mkdtemp(prefix=f"rank{dist.get_rank()}_")
    write_safetensors(export_hf_tensors([states], cfg, t, 1, naming), out)
    with open(os.path.join(out, "config.json"), "w") as f, open(os.path.join(src_dir, "config.json")) as g:
        f.write(g.read())
    return HFCheckpoint(out)


def shared_vs_full(hf_dir: str, t: int, r: int, skip_refresh: bool = False, split_gemm: bool = False) -> dict:
    """Rollout logits on shared weights vs a full copy, before and after an optimizer step."""
    from megatron.core import parallel_state as ps

    from rollplex_megatron.models.qwen25vl.hf import HFCheckpoint, load_hf_into_model
    from rollplex_megatron.compat import apply_cpu_shims
    from rollplex_megatron.models.qwen25vl import build_model
    from rollplex_megatron.dist import parallel_orders
    from rollplex_megatron.weights.share import SharedRolloutWeights

    apply_cpu_shims()
    dist.init_process_group("gloo")
    g = dist.get_rank()
    t_order, r_order = parallel_orders(t, r)
    ck = HFCheckpoint(hf_dir)
    cfg = ck.model_config()
    ps.initialize_model_parallel(tensor_model_parallel_size=t, order=t_order)
    torch.manual_seed(0)
    train = build_model(cfg)
    load_hf_into_model(train, ck, cfg, ps.get_tensor_model_parallel_rank(), t, 0, 1)
    train_group = ps.get_tensor_model_parallel_group()
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=r, order=r_order)
    rollout = build_model(cfg)  # random init: every parameter must be rebound
    shared = SharedRolloutWeights(train, rollout, cfg, t, r, train_group, gpu=g, split_gemm=split_gemm)
    before = (_logits(rollout, cfg) - _logits(_reference(cfg, ck, r), cfg)).abs().max().item()

    tparams, rparams = dict(train.named_parameters()), dict(rollout.named_parameters())
    aliasing = {}
    for p in shared.plan:
        if p.name in shared.remote:
            aliasing[p.name] = (p.klass, rparams[p.name].numel() == 0)  # weight lives in views + remote buffer
            continue
        a, b = rparams[p.name], tparams[p.name]
        same = a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        if p.klass in ("view", "strided_view"):
            off = 0 if p.dim is None else int(p.positions[0]) * b.stride(p.dim)
            aliasing[p.name] = (p.klass, same and a.storage_offset() == b.storage_offset() + off)
        else:
            aliasing[p.name] = (p.klass, not same)

    opt = torch.optim.Adam(train.parameters(), lr=5e-2)
    for prm in train.parameters():
        prm.grad = torch.sin(3 * prm.detach()) + 0.1  # deterministic: TP replicas stay identical
    opt.step()
    refresh_s = 0.0 if skip_refresh else shared.refresh()
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=t, order=t_order)
    new_ck = _export_training(train, cfg, t, ps.get_tensor_model_parallel_group(), ck.naming, hf_dir)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=r, order=r_order)
    after = (_logits(rollout, cfg) - _logits(_reference(cfg, new_ck, r), cfg)).abs().max().item()
    changed = (_logits(_reference(cfg, new_ck, r), cfg) - _logits(_reference(cfg, ck, r), cfg)).abs().max().item()
    return {"before": before, "after": after, "changed": changed, "aliasing": aliasing, "refresh_s": refresh_s,
            "allocated": shared.allocated_bytes(), "classes": sorted({p.klass for p in shared.plan})}
