"""megatron-core's own optimizer (Adam, global-norm clipping) around the DDP-wrapped actor.

No distributed optimizer: every DP rank holds the full optimizer state of its TP/PP shard, so a
training checkpoint is one plain `optimizer.state_dict()` per rank. With bf16 parameters megatron's
Float16 optimizer keeps fp32 main weights; with fp32 parameters its FP32 optimizer steps them in
place. The learning rate follows megatron-core's `OptimizerParamScheduler` (warm-up, then
constant / linear / cosine decay), stepped once per optimizer step; its state is checkpointed.
"""
from __future__ import annotations

from functools import partial

import torch
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from rollplex_megatron.compat.optim import use_foreach_fallbacks
from rollplex_megatron.config import OptimConfig


def build_optimizer(ddp_model, cfg: OptimConfig, bf16: bool):
    """megatron-core Adam over `ddp_model` (a megatron DistributedDataParallel); without transformer-engine or
    apex, its multi-tensor fallbacks are the foreach ones of `compat.optim` (no host read per tensor)."""
    use_foreach_fallbacks()
    ocfg = OptimizerConfig(optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
                           adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
                           clip_grad=cfg.clip_grad, bf16=bf16,
                           params_dtype=torch.bfloat16 if bf16 else torch.float32,
                           use_distributed_optimizer=False)
    return get_megatron_optimizer(ocfg, [ddp_model])


def optimizer_step(optimizer, streamed=None) -> dict:
    """One optimizer step on the finalised (DP-reduced) main grads; megatron's step statistics. `streamed`: the
    memory manager's `StreamedStep` (memory.optimizer_step=stream), which runs megatron's step with the update
    streamed from host memory; None: megatron's step as it is."""
    step = optimizer.step if streamed is None else partial(streamed.step, optimizer)
    update_successful, grad_norm, num_zeros = step()
    return {"grad_norm": None if grad_norm is None else float(grad_norm),
            "update_successful": bool(update_successful), "num_zeros": num_zeros}


def build_scheduler(optimizer, cfg: OptimConfig, steps: int) -> OptimizerParamScheduler:
    """megatron's learning-rate (and weight-decay) scheduler over `steps` optimizer steps; the lr of the
    first step is set on construction (`lr_warmup_init` with a warm-up, else `lr`)."""
    return OptimizerParamScheduler(
        optimizer, init_lr=cfg.lr_warmup_init if cfg.lr_warmup_steps else cfg.lr, max_lr=cfg.lr, min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.lr_warmup_steps, lr_decay_steps=cfg.lr_decay_steps or steps,
        lr_decay_style=cfg.lr_decay_style, start_wd=cfg.weight_decay, end_wd=cfg.weight_decay,
        wd_incr_steps=cfg.lr_decay_steps or steps, wd_incr_style="constant")


def current_lr(optimizer) -> float:
    """The learning rate the next optimizer step uses (the first parameter group's)."""
    return float(optimizer.param_groups[0]["lr"])
