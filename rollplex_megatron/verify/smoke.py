"""`smoke`: forward + backward of the model through megatron's schedule on synthetic prompts.

Until the trainer lands this is the embedded default job: it builds the configured preset at the
configured TP/PP, runs warm-up and timed steps of next-token loss on image+video prompts, and writes
`summary.json` (times, peak memory, device, versions) into a fresh run directory.
"""
from __future__ import annotations

import datetime
import json
import os
import resource
import statistics
import time
from functools import partial
from pathlib import Path

import torch
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

from rollplex_megatron.config import RunConfig
from rollplex_megatron.dist import check_launch, destroy_parallel, init_parallel, launch_on_ranks, under_torchrun
from rollplex_megatron.models.registry import model_spec, open_hf
from rollplex_megatron.recipes import load_run_config, to_yaml
from rollplex_megatron.runtime import device, environment_record
from rollplex_megatron.verify.parity import position_ids_for, synthetic_inputs


def _batch(cfg: RunConfig, seed: int) -> dict:

    s = cfg.smoke
    b = synthetic_inputs(cfg.model, seed, s.batch, tuple(s.image_grid), tuple(s.video_grid), s.text_tokens)
    b["position_ids"] = position_ids_for(cfg.model, b)
    b["labels"] = torch.roll(b["input_ids"], -1, dims=1)
    dev = device()
    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    out = {k: v.to(dev) for k, v in b.items() if k != "second_per_grid_ts"}
    for k in ("pixel_values", "pixel_values_videos"):
        out[k] = out[k].to(dtype)
    return out


def _loss(labels_BS: torch.Tensor, logits_BSV: torch.Tensor):

    ce = tensor_parallel.vocab_parallel_cross_entropy(logits_BSV.float(), labels_BS)
    n = torch.tensor(labels_BS.numel(), device=ce.device, dtype=torch.int)
    loss = ce.sum()
    return loss, n, {"lm loss": torch.stack([loss.detach(), n.float()])}


def _forward_step(batches, data_iterator, model):
    b = batches[next(data_iterator)]
    out = model(input_ids=b["input_ids"], position_ids=b["position_ids"], pixel_values=b["pixel_values"],
                image_grid_thw=b["image_grid_thw"], pixel_values_videos=b["pixel_values_videos"],
                video_grid_thw=b["video_grid_thw"])
    return out, partial(_loss, b["labels"])


def _peak_bytes() -> int:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # process peak RSS (Linux: KiB)


def run_rank(cfg: RunConfig) -> dict:
    """One rank of the smoke run; every rank returns its own measurements."""


    init_parallel(cfg.parallel.tp, cfg.parallel.pp, cfg.seed, cfg.parallel.backend)
    t0 = time.perf_counter()
    spec = model_spec(cfg.model)
    model = spec.build(cfg.model, cfg.dtype, cfg.megatron)
    if cfg.train.init_hf:  # the checkpoint's weights, not only its shape (as training starts from them)
        spec.hf.load(model, open_hf(cfg.train.init_hf), cfg.model, ps.get_tensor_model_parallel_rank(),
                     cfg.parallel.tp, ps.get_pipeline_model_parallel_rank(), cfg.parallel.pp)
    build_s = time.perf_counter() - t0
    s = cfg.smoke
    batches = [_batch(cfg, cfg.seed + i) for i in range(s.micro_batches)]
    seq = batches[0]["input_ids"].shape[1]
    fb = get_forward_backward_func()
    times, losses = [], []
    for step in range(s.warmup + s.steps):
        model.zero_grad(set_to_none=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            if step == s.warmup:
                torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        res = fb(forward_step_func=partial(_forward_step, batches), data_iterator=iter(range(s.micro_batches)),
                 model=[model], num_microbatches=s.micro_batches, seq_length=seq,
                 micro_batch_size=s.batch, forward_only=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if step >= s.warmup:
            times.append(time.perf_counter() - t)
        if res:
            losses.append(sum(r["lm loss"][0].item() for r in res) / sum(r["lm loss"][1].item() for r in res))
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    grad_norm_sq = float(sum(g.float().pow(2).sum() for g in grads)) if grads else 0.0
    n_params = sum(p.numel() for p in model.parameters())
    return {"rank": torch.distributed.get_rank(), "tp_rank": ps.get_tensor_model_parallel_rank(),
            "pp_rank": ps.get_pipeline_model_parallel_rank(), "params_local": n_params,
            "build_s": build_s, "fwd_bwd_s": times, "fwd_bwd_median_s": statistics.median(times),
            "peak_mem_bytes": _peak_bytes(), "loss": losses[-1] if losses else None,
            "grad_norm_sq_local": grad_norm_sq, "seq_len": seq, "grads_finite": all(
                bool(torch.isfinite(g).all()) for g in grads)}


def main(argv: list[str]) -> int:
    """Entry point of `python -m rollplex_megatron smoke [overrides]`."""
    cfg = load_run_config(argv)
    if cfg.parallel.dp != 1:
        raise ValueError("smoke runs tp*pp processes; set parallel.dp=1")
    check_launch(cfg.parallel)  # under torchrun: as many processes as tp*pp
    if Path(cfg.run_dir).exists() and not Path(cfg.run_dir).is_dir():  # before the work, not when writing
        raise ValueError(f"run_dir={cfg.run_dir} is a file; run_dir is the folder the smoke summary is written "
                         f"under: choose a folder")
    print(to_yaml(cfg), flush=True)
    world = cfg.parallel.world_size
    if world == 1 and not under_torchrun():

        ranks = [run_rank(cfg)]
        destroy_parallel()
    else:
        ranks = launch_on_ranks(run_rank, world, cfg)
    if under_torchrun() and world > 1:
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, ranks[0])
        ranks = gathered
        if torch.distributed.get_rank() != 0:
            return 0
    summary = _summarise(cfg, ranks)
    run_dir = Path(cfg.run_dir) / f"smoke-{datetime.datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"model {cfg.model.name} tp={cfg.parallel.tp} pp={cfg.parallel.pp} {cfg.dtype}: "
          f"seq {summary['seq_len']} x batch {cfg.smoke.batch}, fwd+bwd median "
          f"{summary['fwd_bwd_median_s']:.3f} s, peak {summary['peak_mem_bytes_max'] / 2**30:.2f} GiB, "
          f"loss {summary['loss']:.4f}, grads finite: {summary['grads_finite']}")
    print(run_dir)
    return 0 if summary["grads_finite"] else 1


def _summarise(cfg: RunConfig, ranks: list[dict]) -> dict:
    last = [r for r in ranks if r["loss"] is not None]
    return {
        "command": "python -m rollplex_megatron smoke", "model": cfg.model.name,
        "weights": cfg.train.init_hf or "random", "tp": cfg.parallel.tp, "pp": cfg.parallel.pp, "dtype": cfg.dtype,
        "smoke": vars(cfg.smoke),
        "seq_len": ranks[0]["seq_len"], "loss": last[0]["loss"] if last else None,
        "fwd_bwd_median_s": max(r["fwd_bwd_median_s"] for r in ranks),
        "peak_mem_bytes_max": max(r["peak_mem_bytes"] for r in ranks),
        "peak_mem_kind": "torch.cuda.max_memory_allocated" if torch.cuda.is_available() else "process peak RSS",
        "grads_finite": all(r["grads_finite"] for r in ranks), "ranks": ranks,
        "environment": environment_record(),
    }
