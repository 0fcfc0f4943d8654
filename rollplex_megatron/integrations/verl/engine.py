"""The `rollplex` engine for verl: verl's log-prob and update calls through the prefix/response execution.

Registered (`plugin.py`) under `EngineRegistry` for `language_model` / `megatron` with vendor `rollplex`, so it is
chosen with `VERL_ENGINE_VENDOR=rollplex` and verl's own Megatron engine stays as it is. It builds this
project's model of the HF checkpoint verl points at (`actor_rollout_ref.model.path`; its config.json's model_type
picks the family through the registry: Qwen2.5-VL or Qwen3-VL) on megatron-core, at verl's
`tensor_model_parallel_size` / `pipeline_model_parallel_size`, with megatron's DDP and Adam.

Per call (`infer_batch`, `train_batch`): the batch's rows are grouped by verl's `uid` (`batch.verl_groups`); each
group's prompt runs once (the prefix stage, vision tower included), its responses are packed into response-stage
micro-batches through megatron's `get_forward_backward_func()`, and in training the prefix backward runs once per
group after the schedule. verl's own loss function (`ppo_loss` with its loss-aggregation and policy-loss
settings) is called per micro-batch on verl's layout of that micro-batch's samples, with the global token count
and DP size verl's megatron engine writes, so the update is verl's. Outputs are verl's: `log_probs` (and
`entropy` when asked) as jagged nested tensors of each sample's full length, in the batch's order.
"""
from __future__ import annotations

import os
import shutil
from contextlib import contextmanager

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from verl.utils import tensordict_utils as tu
from verl.utils.py_functional import append_to_dict
from verl.workers.engine.base import BaseEngine

from rollplex_megatron.attention.kv_store import KVStore
from rollplex_megatron.checkpoint import train_state
from rollplex_megatron.attention.prefix import PrefixContext
from rollplex_megatron.config import ATTENTION_BACKENDS, OptimConfig
from rollplex_megatron.dist import init_parallel
from rollplex_megatron.integrations.verl.batch import (as_nested, check_verl_positions, full_length, loss_rows,
                                                     verl_groups)
from rollplex_megatron.models.registry import model_spec, open_hf
from rollplex_megatron.models.triton_norm import norm_kernel_for, use_norm_kernel
from rollplex_megatron.models.triton_rope import rope_kernel_for, use_rope_kernel
from rollplex_megatron.optim import build_optimizer, build_scheduler, current_lr, optimizer_step
from rollplex_megatron.prefix import execution as X
from rollplex_megatron.prefix.batch import full_micro_batches, response_micro_batches
from rollplex_megatron.rl.grpo import policy_logits, rows_at, vocab_parallel_entropy
from rollplex_megatron.runtime import device, wrap_ddp

ENV_PREFIX = "ROLLPLEX_VERL_PREFIX"  # shared (default) | full: every group as full sequences (the plain path)
ENV_DTYPE = "ROLLPLEX_VERL_DTYPE"  # float32 overrides verl's engine dtype (which allows bf16 / fp16 only)
ENV_NORM = "ROLLPLEX_VERL_NORM_KERNEL"  # auto (default) | triton | torch: the model's RMSNorms (train.norm_kernel)
ENV_ROPE = "ROLLPLEX_VERL_ROPE_KERNEL"  # auto (default) | triton | torch: the model's RoPE (train.rope_kernel)
# auto (default: split where its flash kernels run, sdpa elsewhere) | sdpa | flex | split: the scoring and update
# attention (attention/prefix.py, attention/split.py)
ENV_ATTENTION = "ROLLPLEX_VERL_ATTENTION"
PREFIX_MODES = ("shared", "full")  # ENV_PREFIX's values
DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32"}


def _setting(cfg, name: str, default=None):
    return getattr(cfg, name, default) if cfg is not None else default


def check_engine_config(ec) -> None:
    """What this engine does not run, refused by name before any model is built."""
    for name, ok in (("context_parallel_size", 1), ("expert_model_parallel_size", 1),
                     ("virtual_pipeline_model_parallel_size", None)):
        v = _setting(ec, name, ok)
        if v != ok:
            raise ValueError(f"rollplex verl engine: {name}={v} is not supported (use {ok}); the prefix/response "
                             f"execution runs at TP x PP x DP")
    for name in ("param_offload", "grad_offload", "optimizer_offload"):
        if _setting(ec, name, False):
            raise ValueError(f"rollplex verl engine: {name}=True is not supported; set it to False (this engine "
                             f"keeps its model and optimizer resident)")
    if _setting(ec, "sequence_parallel", False):
        raise ValueError("rollplex verl engine: sequence_parallel=True is not supported; set megatron.sequence_parallel"
                         "=false for the actor and the reference (this engine runs without sequence parallelism; the "
                         "recipe sets it)")
    if not _setting(ec, "forward_only", False) and _setting(ec, "use_distributed_optimizer", False):
        raise ValueError("rollplex verl engine: use_distributed_optimizer=True is not supported; set the actor's "
                         "megatron.use_distributed_optimizer=false (this engine trains with megatron's plain "
                         "optimizer; the recipe sets it)")


def micro_batch_plan(data, vg) -> tuple[int, int, int]:
    """How the batch's samples are packed: (responses per response-stage micro-batch, that micro-batch's token
    budget, responses per full-sequence micro-batch). verl's `micro_batch_size_per_gpu` (8 when unset) counts
    responses; under its dynamic batch size (`use_dynamic_bsz`, `max_token_len_per_gpu`) a response-stage
    micro-batch holds responses up to that many tokens (it holds response tokens only: the prompt runs once per
    group; `prefix.batch.pack_responses`, a longer response alone), and a full-sequence micro-batch as many of
    the longest prompt + response as fit. The loss and the gradient do not depend on the packing."""
    budget = int(tu.get(data, "max_token_len_per_gpu", None) or 0) if tu.get(data, "use_dynamic_bsz", False) else 0
    if budget > 0:
        longest = max([vg.prompt_lens[s] + vg.response_lens[s] for g in vg.full for s in vg.rows[g]] or [1])
        return 1, budget, max(1, budget // longest)
    per = int(tu.get(data, "micro_batch_size_per_gpu", None) or 8)
    return per, 0, per


class RollplexMegatronEngine(BaseEngine):
    """verl engine over this project's model families and prefix/response execution (see the module docstring)."""

    delta_pin_snapshots = False

    def __init__(self, model_config, engine_config, optimizer_config=None, checkpoint_config=None,
                 share_prefix: bool | None = None, dtype: str | None = None, attention: str | None = None):
        check_engine_config(engine_config)
        self.model_config, self.engine_config = model_config, engine_config
        self.optimizer_config, self.checkpoint_config = optimizer_config, checkpoint_config
        if share_prefix is None:
            mode = os.environ.get(ENV_PREFIX, "shared")
            if mode not in PREFIX_MODES:
                raise ValueError(f"{ENV_PREFIX}={mode!r}; use shared or full")
            share_prefix = mode == "shared"
        self.share_prefix = share_prefix
        self.attention = attention or os.environ.get(ENV_ATTENTION, "auto")
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"{ENV_ATTENTION}={self.attention!r}; use one of {', '.join(ATTENTION_BACKENDS)}")
        self.last_packing: dict = {}  # the last batch's micro-batches: response tokens (shared), responses (full)
        self.forward_only = bool(_setting(engine_config, "forward_only", False))
        dtype = dtype or os.environ.get(ENV_DTYPE) or str(_setting(engine_config, "dtype", "bfloat16"))
        if dtype not in DTYPES:
            raise ValueError(f"rollplex verl engine: dtype {dtype!r} ({ENV_DTYPE} or the engine's dtype); use one of "
                             f"{sorted(DTYPES)}")
        self.dtype = DTYPES[dtype]
        # verl asks for the DP rank right after construction, before initialize(): the groups exist here.
        # verl's Ray workers say their node's rank count in RAY_LOCAL_WORLD_SIZE (LOCAL_WORLD_SIZE reads 1 there)
        if os.environ.get("RAY_LOCAL_WORLD_SIZE"):
            os.environ["LOCAL_WORLD_SIZE"] = os.environ["RAY_LOCAL_WORLD_SIZE"]
        init_parallel(int(_setting(engine_config, "tensor_model_parallel_size", 1)),
                      int(_setting(engine_config, "pipeline_model_parallel_size", 1)),
                      int(_setting(engine_config, "seed", 42)))
        self.module = self.ddp = self.optimizer = self.scheduler = None
        self.mode = None
        # prefix K/V computed before a scoring phase: the reference's decode-window end under SGLang
        # (window.RefWindow, set by the rollplex worker), or what a rollplex rollout held (held.HeldPrefixes)
        self.window = None
        self.updates = 0  # optimizer steps taken: K/V held at other weights are not read
        self.last_window: dict = {}  # the last scoring batch: groups whose prefix came from the window, computed
        self._saved = []  # checkpoints this engine wrote, oldest first (max_ckpt_to_keep)

    # -- set-up -------------------------------------------------------------------------------------------------
    def initialize(self):
        path = _setting(self.model_config, "local_path") or _setting(self.model_config, "path")
        if not path:
            raise ValueError("rollplex verl engine: the model config has no path (actor_rollout_ref.model.path)")
        ckpt = open_hf(path)
        self.model_path = path  # what verl hands SGLang as model_path too (the decode window matches on it)
        self.cfg, self.naming = ckpt.model_config(), ckpt.naming
        spec = model_spec(self.cfg)
        model = spec.build(self.cfg, self.dtype, dict(_setting(self.engine_config, "override_transformer_config",
                                                                {}) or {}))
        use_norm_kernel(model, norm_kernel_for(os.environ.get(ENV_NORM, "auto"), device()))
        use_rope_kernel(model, rope_kernel_for(os.environ.get(ENV_ROPE, "auto"), device()))
        spec.hf.load(model, ckpt, self.cfg, ps.get_tensor_model_parallel_rank(),
                     ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank(),
                     ps.get_pipeline_model_parallel_world_size())
        if self.forward_only:
            model.requires_grad_(False)
            self.module = model
            return
        self.ddp = self.module = wrap_ddp(model)
        oc = self.optimizer_config
        betas = tuple(_setting(oc, "betas", (0.9, 0.999)))
        steps = max(int(_setting(oc, "total_training_steps", -1) or -1), 1)
        decay = int(_setting(oc, "lr_decay_steps", None) or steps)
        warm = int(_setting(oc, "lr_warmup_steps", -1) or -1)
        if warm <= 0:  # verl's rule: the ratio of the decay steps when no positive step count is given
            warm = int(float(_setting(oc, "lr_warmup_steps_ratio", 0.0) or 0.0) * decay)
        ocfg = OptimConfig(lr=float(_setting(oc, "lr", 1e-6)), weight_decay=float(_setting(oc, "weight_decay", 0.0)),
                           adam_beta1=float(betas[0]), adam_beta2=float(betas[1]),
                           clip_grad=float(_setting(oc, "clip_grad", 1.0)), lr_warmup_steps=warm,
                           lr_warmup_init=float(_setting(oc, "lr_warmup_init", 0.0) or 0.0),
                           lr_decay_style=str(_setting(oc, "lr_decay_style", "constant")),
                           min_lr=float(_setting(oc, "min_lr", 0.0) or 0.0), lr_decay_steps=decay)
        self.optimizer = build_optimizer(self.ddp, ocfg, bf16=self.dtype == "bfloat16")
        self.scheduler = build_scheduler(self.optimizer, ocfg, steps)

    @property
    def is_param_offload_enabled(self) -> bool:
        return False

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return False

    @contextmanager
    def _mode(self, mode: str, zero_grad_on_exit: bool = True, **_):
        self.mode = mode
        (self.module.train if mode == "train" else self.module.eval)()
        try:
            yield
        finally:
            if mode == "train" and zero_grad_on_exit and self.optimizer is not None:
                self.optimizer_zero_grad()
            self.mode = None

    def train_mode(self, **kwargs):
        if self.forward_only:
            raise RuntimeError("rollplex verl engine: train_mode on a forward-only engine (the reference)")
        return self._mode("train", **kwargs)

    def eval_mode(self, **kwargs):
        return self._mode("eval", **kwargs)

    # -- optimizer ----------------------------------------------------------------------------------------------
    def optimizer_zero_grad(self):
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def optimizer_step(self):
        self.updates += 1
        return optimizer_step(self.optimizer)["grad_norm"]

    def lr_scheduler_step(self):
        self.scheduler.step(1)
        return current_lr(self.optimizer)

    # -- parallel layout ----------------------------------------------------------------------------------------
    def get_data_parallel_size(self):
        return ps.get_data_parallel_world_size()

    def get_data_parallel_rank(self):
        return ps.get_data_parallel_rank()

    def get_data_parallel_group(self):
        return ps.get_data_parallel_group()

    def is_mp_src_rank_with_outputs(self):
        return ps.get_tensor_model_parallel_rank() == 0 and ps.is_pipeline_last_stage()

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        super().to(device, model=model, optimizer=optimizer, grad=grad)
        if model or optimizer:
            raise NotImplementedError("rollplex verl engine keeps its model and optimizer resident; set "
                                      "param_offload / optimizer_offload to False")

    # -- the work -----------------------------------------------------------------------------------------------
    def forward_backward_batch(self, data, loss_function=None, forward_only=False):
        """verl's batch through the prefix/response execution; verl's output dict on the last pipeline stage."""
        vg = verl_groups(data, self.share_prefix)
        check_verl_positions(data, vg, self.cfg)
        temperature = tu.get(data, "temperature")
        if temperature is None or (torch.is_tensor(temperature) and temperature.numel() != 1):
            raise ValueError("rollplex verl engine: the batch needs one scalar `temperature` (the rollout's; verl's "
                             "trainer sets it)")
        temperature = max(float(temperature), 1e-8)
        entropy = bool(tu.get(data, "calculate_entropy", False))
        mask = data["loss_mask"]
        tokens = torch.tensor([float(mask.values().sum() if mask.is_nested else mask.sum())], device=device())
        dp_group = ps.get_data_parallel_group()
        dp_size = ps.get_data_parallel_world_size()
        if dp_size > 1:
            dist.all_reduce(tokens, group=dp_group)
        tu.assign_non_tensor(data, dp_size=dp_size, batch_num_tokens=int(tokens.item()))
        if loss_function is not None and tu.get(data, "global_batch_size") is None:
            raise ValueError("rollplex verl engine: the batch has no `global_batch_size` (verl's trainer sets it "
                             "from ppo_mini_batch_size * rollout.n)")
        per_mb, budget, per_full = micro_batch_plan(data, vg)
        shared = response_micro_batches(self.cfg, vg.groups, per_mb, 1, select=vg.shared, max_tokens=budget)
        full = full_micro_batches(self.cfg, vg.groups, per_full, 1, select=vg.full)
        self.last_packing = {"shared": [int(mb.label_mask.sum()) for mb in shared],
                             "full": [len(mb.responses) for mb in full]}
        outputs: dict[int, dict] = {}
        loss_fn = self._loss_fn(vg, data, loss_function, temperature, entropy, dp_size, outputs)
        model, dev = self.module, device()
        store = KVStore()
        train = not forward_only and loss_function is not None
        todo = vg.shared
        if self.window is not None and not train:  # scoring: prefixes the rollout already ran, where they match
            todo = self.window.adopt(vg, todo, store, self.updates)
            self.last_window = {"from_window": len(vg.shared) - len(todo), "computed": len(todo)}
        with torch.set_grad_enabled(train):
            states = X.prefix_forward(model, [vg.groups[i] for i in todo], store, keep_graph=train, group_ids=todo)
            res = []
            if shared:
                res += X.run_schedule(model, [mb.to(dev) for mb in shared],
                                      lambda mb: PrefixContext(mode="use", layout=mb.layout, store=store,
                                                               backend=self.attention),
                                      forward_only=not train, loss_fn=loss_fn)
            if full:
                res += X.run_schedule(model, [mb.to(dev) for mb in full],
                                      lambda mb: PrefixContext(mode="packed", layout=mb.layout,
                                                               backend=self.attention),
                                      forward_only=not train, loss_fn=loss_fn)
        if train:
            X.prefix_backward(model, states, store)
            X.finalize(model)
        store.leaves.clear()
        if not ps.is_pipeline_last_stage():
            return {}
        n = len(vg.prompt_lens)
        missing = [i for i in range(n) if i not in outputs]
        if missing:
            raise RuntimeError(f"rollplex verl engine: samples {missing[:4]} got no log-probs")
        model_output = {k: as_nested([outputs[i][k] for i in range(n)]) for k in outputs[0]}
        metrics: dict = {}
        for r in res:
            append_to_dict(metrics, r.get("metrics", {}))
        return {"model_output": model_output, "loss": [float(r["loss"]) for r in res], "metrics": metrics}

    def _loss_fn(self, vg, data, loss_function, temperature: float, entropy: bool, dp_size: int, outputs: dict):
        """The schedule's loss function (megatron's per-token contract, the loss pre-scaled): verl's log-probs of a
        packed micro-batch, laid out as verl's outputs of its samples, and verl's loss over them."""
        tp_rank, tp_group = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
        dp_group = ps.get_data_parallel_group()
        # the sampled policy's distribution (docs/design.md §3): the rollout never emits the vision placeholders,
        # so they are out of the softmax here too, or every log-prob is off by log(1 - their mass); the ids are the
        # checkpoint's (its family's config.json), not a fixed family's
        banned = tuple(self.cfg.vision_token_ids)

        def fn(mb, logits):
            x = policy_logits(logits, temperature, banned, tp_rank)
            ent = rows_at(vocab_parallel_entropy(x, tp_group), mb.label_at) if entropy else None
            logp = -tensor_parallel.vocab_parallel_cross_entropy(x.clone() if entropy else x, mb.labels)
            logp = rows_at(logp, mb.label_at)
            samples = [vg.sample(g, r) for g, r in mb.responses]
            lens = [vg.response_lens[s] for s in samples]
            out = {"log_probs": torch.cat([full_length(vg, s, v) for s, v in zip(samples, logp.split(lens))])}
            if ent is not None:
                out["entropy"] = torch.cat([full_length(vg, s, v) for s, v in zip(samples, ent.split(lens))])
            offsets = [0]
            for s in samples:
                offsets.append(offsets[-1] + vg.prompt_lens[s] + vg.response_lens[s])
            for j, s in enumerate(samples):
                outputs[s] = {k: v[offsets[j]:offsets[j + 1]].detach() for k, v in out.items()}
            n = mb.label_mask.sum().to(torch.int)
            if loss_function is None:  # log-probs only (verl's compute_log_prob / compute_ref_log_prob)
                return logp.sum() * 0.0, n, {"loss": torch.tensor(1.0), "logp": logp.detach()}
            loss, metrics = loss_function(model_output=out, data=loss_rows(data, samples),
                                          dp_group=dp_group)
            # verl's loss is its share of a DP average (x dp_size); megatron's DDP here sums over DP
            # (calculate_per_token_loss), so each rank contributes loss / dp_size
            return loss / dp_size, n, {"loss": loss.detach(), "logp": logp.detach(), "metrics": metrics}

        return fn

    # -- weights and checkpoints --------------------------------------------------------------------------------
    def get_per_tensor_param(self, **kwargs):
        """Full HF-named tensors of this model (for verl's weight sync to its rollout), gathered over TP and PP
        when first read: a rollout that decodes on these modules (`rollout.name=rollplex`) never reads them, and
        then no gather runs (every model-parallel rank reads them, or none)."""
        return self._hf_tensors(), None

    def _hf_tensors(self):
        tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
        mine = {k: v.detach().cpu() for k, v in X.unwrap(self.module).state_dict().items() if torch.is_tensor(v)}
        every = [None] * (tp * pp)
        if tp * pp > 1:  # every model-parallel rank's shards, ordered by (pp rank, tp rank)
            dist.all_gather_object(every, (ps.get_pipeline_model_parallel_rank(),
                                           ps.get_tensor_model_parallel_rank(), mine),
                                   group=ps.get_model_parallel_group())
        else:
            every = [(0, 0, mine)]
        states = [[None] * tp for _ in range(pp)]
        for p_rank, t_rank, st in every:
            states[p_rank][t_rank] = st
        yield from model_spec(self.cfg).hf.export(states, self.cfg, tp, pp, self.naming)

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs):
        """Collective: this rank's model, optimizer, learning-rate schedule and RNG states as the project's
        training checkpoint under `local_path/checkpoints/step_<global_step>` (written aside, fsynced, published
        by rename; a step that exists is refused). With `max_ckpt_to_keep`, checkpoints this engine wrote
        earlier beyond that count are removed, oldest first (verl's checkpoint-manager rule)."""
        if hdfs_path:
            raise ValueError(f"rollplex verl engine: hdfs_path={hdfs_path!r} is not supported; checkpoints are "
                             f"written to local_path only (unset the HDFS checkpoint directory)")
        if self.optimizer is None:
            raise RuntimeError("rollplex verl engine: a forward-only engine (the reference) has no training state "
                               "to save")
        path = train_state.save_checkpoint(local_path, int(global_step), self.module, None, self.optimizer,
                                           extra={"lr_scheduler": self.scheduler.state_dict()})
        self._saved.append(path)
        keep = int(max_ckpt_to_keep or 0)
        while keep > 0 and len(self._saved) > keep:
            old = self._saved.pop(0)  # verl saves each step under its own local_path: drop that whole tree
            if dist.get_rank() == 0:
                shutil.rmtree(old if old.parent == path.parent else old.parent)
            dist.barrier()
        return path

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True, **kwargs):
        """Restore the latest checkpoint `save_checkpoint` wrote under `local_path` (the layout must be the
        checkpoint's); nothing is deleted, whatever `del_local_after_load` says (verl deletes only copies it
        downloaded from HDFS, which this engine does not use)."""
        if hdfs_path:
            raise ValueError(f"rollplex verl engine: hdfs_path={hdfs_path!r} is not supported; resume from local_path")
        if self.optimizer is None:
            raise RuntimeError("rollplex verl engine: a forward-only engine (the reference) loads its weights from "
                               "the HF checkpoint, not from a training checkpoint")
        path = train_state.latest_checkpoint(local_path)
        if path is None:
            raise FileNotFoundError(f"rollplex verl engine: no checkpoint under {local_path}/"
                                    f"{train_state.CHECKPOINTS} (save_checkpoint writes them there); check "
                                    f"trainer.resume_mode / resume_from_path")
        _, extra = train_state.load_checkpoint(path, self.module, None, self.optimizer)
        self.updates += 1  # other weights: K/V held before are not read
        self.scheduler.load_state_dict(extra["lr_scheduler"])
        return path
