"""`verify-equivalence`: prefix/response execution against full sequences on one random batch.

Both paths run on the same DDP-wrapped model, weights and batch; the gradients compared are the
DP-reduced ones. Reported errors are relative, ||a - b|| / ||b||, with the full-sequence path as
the reference, maximised over ranks (and over parameters for gradients).
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from rollplex_megatron.attention.prefix import resolve_backend
from rollplex_megatron.config import RunConfig
from rollplex_megatron.dist import init_parallel
from rollplex_megatron.models.registry import model_spec, open_hf
from rollplex_megatron.prefix import batch as B
from rollplex_megatron.prefix import execution as X
from rollplex_megatron.prefix.batch import Group, Prompt
from rollplex_megatron.runtime import device, sync, wrap_ddp
from rollplex_megatron.verify.flops import group_flops
from rollplex_megatron.verify.numerics import rel_err
from rollplex_megatron.verify.parity import synthetic_inputs

# docs/design.md §3: fp32 on CPU 1e-5 for all; bf16 loss 1e-3, log-probs 1e-2, and gradients 1e-2
# *in excess of the serial path's own bf16 error*, both measured against an fp32 evaluation of the
# same step (see `_against_fp32`); without that evaluation the bf16 gradient bound is direct.
TOLERANCES = {"float32": {"logp": 1e-5, "loss": 1e-5, "grad": 1e-5},
              "bfloat16": {"logp": 1e-2, "loss": 1e-3, "grad": 1e-2}}

def random_groups(cfg: RunConfig, dp_rank: int):
    """This DP rank's groups: prompts with an image and a video, G responses of random lengths."""
    v, m = cfg.verify, cfg.model
    g = torch.Generator().manual_seed(v.seed * 1000 + dp_rank)
    text_hi = min(m.vocab_size, m.image_token_id, m.video_token_id, m.vision_start_token_id,
                  m.vision_end_token_id)
    groups = []
    for i in range(v.groups_per_rank):
        x = synthetic_inputs(m, v.seed * 1000 + dp_rank * 100 + i, 1, tuple(v.image_grid),
                             tuple(v.video_grid), v.text_tokens + i)
        prompt = Prompt(x["input_ids"][0], x["pixel_values"], x["image_grid_thw"], x["pixel_values_videos"],
                        x["video_grid_thw"], x["second_per_grid_ts"])
        lens = torch.randint(v.min_response_len, v.max_response_len + 1, (cfg.rollout.group_size,), generator=g)
        responses = [torch.randint(0, text_hi, (int(n),), generator=g) for n in lens]
        adv = v.advantage_mean + torch.randn(cfg.rollout.group_size, generator=g)
        groups.append(Group(prompt, responses, adv))
    return groups


def _grads(ddp) -> dict[str, torch.Tensor]:
    return {n: p.main_grad.detach().float().clone() for n, p in ddp.module.named_parameters()
            if p.requires_grad}


def _collect(res: list[dict]):
    if not res:
        return None, None
    return torch.cat([r["logp"].float() for r in res]), sum(float(r["loss"]) for r in res)


def _median_after_first(xs: list[float]) -> float:
    return statistics.median(xs[1:] if len(xs) > 1 else xs)


def _flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """All gradients as one vector, in name order."""
    return torch.cat([grads[n].flatten() for n in sorted(grads)])


def _against_fp32(cfg: RunConfig, model, full_mbs, backend: str, serial: dict, prefix: dict, worst: str) -> dict:
    """Both paths' gradients against the serial step evaluated in fp32 on the same (rounded) weights.

    In bf16 both paths carry rounding error; this says whether the prefix path carries more than
    the serial path it replaces. TF32 is off for the fp32 evaluation (convolutions included).
    """
    exact = model_spec(cfg.model).build(cfg.model, "float32", cfg.megatron)
    exact.load_state_dict({k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
                           for k, v in model.state_dict().items()})
    ddp = wrap_ddp(exact)
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        X.full_sequence_step(ddp, full_mbs, backend=backend)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    ref = _grads(ddp)
    del ddp, exact
    e_serial = {n: rel_err(serial[n], ref[n]) for n in ref}
    e_prefix = {n: rel_err(prefix[n], ref[n]) for n in ref}
    ratio = {n: e_prefix[n] / max(e_serial[n], 1e-30) for n in ref}
    excess = {n: e_prefix[n] - e_serial[n] for n in ref}
    top = max(e_prefix, key=e_prefix.get)
    return {"max_rel_err_grad_prefix": e_prefix[top], "param_prefix": top,
            "max_rel_err_grad_serial": max(e_serial.values()), "param_serial": max(e_serial, key=e_serial.get),
            "serial_err_at_param_prefix": e_serial[top],
            "rel_err_grad_global_prefix": rel_err(_flat(prefix), _flat(ref)),
            "rel_err_grad_global_serial": rel_err(_flat(serial), _flat(ref)),
            "max_excess_over_serial": max(excess.values()), "param_max_excess": max(excess, key=excess.get),
            "max_ratio_prefix_over_serial": max(ratio.values()), "param_max_ratio": max(ratio, key=ratio.get),
            "worst_pair_param": worst, "worst_pair_errs": [e_prefix[worst], e_serial[worst]]}


def run_rank(cfg: RunConfig, hf_dir: str | None = None, position_offset: int = 0) -> dict:
    """One rank: build, run both paths (actor and reference variants), compare."""



    ck = open_hf(hf_dir) if hf_dir is not None else None
    if ck is not None:
        cfg.model = ck.model_config()  # the checkpoint defines the shape
    init_parallel(cfg.parallel.tp, cfg.parallel.pp, cfg.seed, cfg.parallel.backend)
    spec = model_spec(cfg.model)
    model = spec.build(cfg.model, cfg.dtype, cfg.megatron)
    if ck is not None:
        spec.hf.load(model, ck, cfg.model, ps.get_tensor_model_parallel_rank(), cfg.parallel.tp,
                     ps.get_pipeline_model_parallel_rank(), cfg.parallel.pp)
    ddp = wrap_ddp(model)
    groups = random_groups(cfg, ps.get_data_parallel_rank())
    B.validate_groups(cfg.model, groups, cfg.rollout.max_response_len)
    dev = device()  # NCCL needs CUDA tensors
    n_tok = torch.tensor(float(sum(r.numel() for g in groups for r in g.responses)), device=dev)
    dist.all_reduce(n_tok, group=ps.get_data_parallel_group())
    per_mb = cfg.verify.responses_per_micro_batch
    full_mbs = B.full_micro_batches(cfg.model, groups, per_mb, int(n_tok))
    resp_mbs = B.response_micro_batches(cfg.model, groups, per_mb, int(n_tok), position_offset)

    be = cfg.verify.attention_backend
    times: dict[str, list] = {"full_fwd_bwd_s": [], "prefix_fwd_bwd_s": [], "reference_prefix_fwd_s": []}
    peaks: dict[str, int] = {}

    def timed(name, fn):
        sync()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = fn()
        sync()
        times[name].append(time.perf_counter() - t0)
        if torch.cuda.is_available():
            peaks[name] = torch.cuda.max_memory_allocated()
        return out

    for _ in range(cfg.verify.repeats):
        ddp.zero_grad_buffer()
        full = timed("full_fwd_bwd_s", lambda: X.full_sequence_step(ddp, full_mbs, backend=be))
        full_logp, full_loss = _collect(full)
        full_grads = _grads(ddp)
        ddp.zero_grad_buffer()
        pack = cfg.workload.prefix_pack_tokens  # several groups' prefixes as one forward
        pre_logp, pre_loss = _collect(timed("prefix_fwd_bwd_s", lambda: X.actor_prefix_step(
            ddp, groups, resp_mbs, be, pack_tokens=pack)))
        pre_grads = _grads(ddp)
        ref_logp, _ = _collect(timed("reference_prefix_fwd_s",
                                     lambda: X.reference_prefix_logprobs(ddp, groups, resp_mbs, be, pack_tokens=pack)))

    errs = torch.zeros(5, dtype=torch.float64, device=dev)
    if full_logp is not None:
        errs[0] = rel_err(pre_logp, full_logp)
        errs[1] = abs(pre_loss - full_loss) / max(abs(full_loss), 1e-30)
        errs[3] = rel_err(ref_logp, full_logp)
    grad_errs = {n: rel_err(pre_grads[n], full_grads[n]) for n in full_grads}
    worst = max(grad_errs, key=grad_errs.get)
    errs[2] = grad_errs[worst]
    global_err = rel_err(_flat(pre_grads), _flat(full_grads))
    floor = None
    if cfg.verify.noise_floor:
        # The serial path against itself with one response per micro-batch: how far two serial
        # executions that differ only in summation order drift apart in this dtype.
        ddp.zero_grad_buffer()
        X.full_sequence_step(ddp, B.full_micro_batches(cfg.model, groups, 1, int(n_tok)), backend=be)
        alt = _grads(ddp)
        floor_errs = {n: rel_err(alt[n], full_grads[n]) for n in full_grads}
        floor = {"max_rel_err_grad": max(floor_errs.values()), "param": max(floor_errs, key=floor_errs.get),
                 "rel_err_grad_global": rel_err(_flat(alt), _flat(full_grads)),
                 "worst_prefix_param_serial_err": floor_errs[worst]}
    fp32_ref = None
    if cfg.verify.fp32_reference and cfg.dtype != "float32":
        fp32_ref = _against_fp32(cfg, model, full_mbs, be, full_grads, pre_grads, worst)
        errs[4] = fp32_ref["max_excess_over_serial"]
    zero_ref = [n for n, gr in full_grads.items() if float(gr.norm()) == 0.0]
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    # The loss lives on the last stage; count it once per DP rank (TP rank 0), summed over DP.
    owner = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    loss_t = torch.tensor(full_loss if owner else 0.0, dtype=torch.float64, device=dev)
    dist.all_reduce(loss_t)
    tol = TOLERANCES[cfg.dtype]
    out = {"max_rel_err_logp": float(errs[0]), "max_rel_err_loss": float(errs[1]),
           "max_rel_err_grad": float(errs[2]), "max_rel_err_ref_logp": float(errs[3]),
           "tp": cfg.parallel.tp, "pp": cfg.parallel.pp, "dp": ps.get_data_parallel_world_size(),
           "group_size": cfg.rollout.group_size, "dtype": cfg.dtype, "tolerance": tol,
           "worst_grad_param_local": worst, "rel_err_grad_global_local": global_err,
           "top_grad_errs_local": dict(sorted(grad_errs.items(), key=lambda kv: -kv[1])[:6]),
           "serial_noise_floor_local": floor, "fp32_reference_local": fp32_ref, "zero_reference_grads_local": zero_ref,
           "response_tokens": int(n_tok), "loss": float(loss_t),
           "times_s": {k: _median_after_first(v) for k, v in times.items()}, "times_all_s": times,
           "peak_mem_bytes": peaks, "micro_batches": len(full_mbs),
           "flops_local_batch": group_flops(cfg.model, groups),
           "prompt_lens": [int(g.prompt.input_ids.numel()) for g in groups],
           "attention_backend": be if be != "auto" else resolve_backend(getattr(torch, cfg.dtype), dev,
                                                                       cfg.model.head_dim)}  # what auto ran
    if fp32_ref is not None:
        out["grad_rule"] = "excess of the prefix path's error over the serial path's, both against fp32"
        out["max_grad_excess_over_serial"] = float(errs[4])
        grad_ok = out["max_grad_excess_over_serial"] <= tol["grad"]
    else:
        out["grad_rule"] = "prefix path against the serial path"
        grad_ok = out["max_rel_err_grad"] <= tol["grad"]
    out["ok"] = (out["max_rel_err_logp"] <= tol["logp"] and out["max_rel_err_ref_logp"] <= tol["logp"]
                 and out["max_rel_err_loss"] <= tol["loss"] and grad_ok)
    return out
