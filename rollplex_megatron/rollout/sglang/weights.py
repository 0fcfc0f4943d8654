"""Megatron's training shards as SGLang's parameters: per SGLang TP rank, aliases wherever the layouts agree.

The classifier (`weights/plan.py`, layout `sglang`: QKVParallelLinear's [q; k; v] per rank,
MergedColumnParallelLinear's [gate; up], row-parallel column chunks, the 64-padded vocabulary)
decides per tensor: a view of the training storage (no bytes), or a buffer rebuilt from the training
shards after every optimizer step (a local permutation, or a bucketed all-gather over the training
TP group). `SGLangShards` holds both, named as SGLang names its parameters (q/k/v stacked into
`qkv_proj`, gate/up into `gate_up_proj`, the vision attention's `attn.qkv` as `attn.qkv_proj`).

Binding (`alias_loader`, also SGLang's `custom_weight_loader` signature `loader(model, named_tensors)`)
makes every SGLang parameter that tensor: the views alias the training weights, the buffers belong to
the trainer and are refreshed there in place. SGLang's CUDA graphs record parameter addresses when they
are captured, so the binding must happen before the capture: the plugin binds right after SGLang has
loaded its (dummy) weights (`ModelRunner.load_model`), and frees what SGLang had allocated for them.
Afterwards no weight crosses the processes again: an optimizer step changes the views' storage, and
`refresh()` the buffers', before the next rollout.
"""
from __future__ import annotations

import torch

from rollplex_megatron.models.hf_rules import Rule
from rollplex_megatron.weights.share import SharedRolloutWeights

LOADER = "rollplex_megatron.rollout.sglang.weights.alias_loader"  # for ServerArgs.custom_weight_loader


def sglang_name(rule: Rule) -> str:
    """SGLang's parameter name for a megatron parameter (released-checkpoint naming, stacked linears)."""
    hf = rule.hf[0]
    if rule.kind == "qkv":
        return hf.replace(".q_proj.", ".qkv_proj.")
    if rule.kind == "qkv_fused":
        return hf.replace(".attn.qkv.", ".attn.qkv_proj.")
    if rule.kind == "fc1":
        return hf.replace(".gate_proj.", ".gate_up_proj.")
    return hf


def _holder(names_shapes: dict, like: torch.Tensor) -> torch.nn.Module:
    """A module tree with a meta parameter of each (dotted) name and shape: what `SharedRolloutWeights` binds."""
    root = torch.nn.Module()
    for name, shape in names_shapes.items():
        mod = root
        *path, attr = name.split(".")
        for part in path:
            if part not in mod._modules:
                mod._modules[part] = torch.nn.Module()
            mod = mod._modules[part]
        mod._parameters[attr] = torch.nn.Parameter(torch.empty(shape, dtype=like.dtype, device="meta"),
                                                   requires_grad=False)
    return root


class SGLangShards:
    """This training rank's tensors in SGLang's per-rank layout (views of training storage, or rebuilt buffers)."""

    def __init__(self, train_model, cfg, t: int, r: int, train_tp_group, gpu: int):
        """`gpu`: this GPU's index in the max(t, r) group where training and SGLang both place TP rank g on
        GPU g % degree (SGLang's own placement: consecutive)."""
        from rollplex_megatron.weights.plan import plan_weights

        like = next(train_model.parameters())
        train = dict(train_model.named_parameters())
        plan = plan_weights(cfg, t, r, "sglang", like.element_size(), "consecutive").gpus[gpu]
        shapes = {}
        for p in plan:
            shape = list(train[p.name].shape)
            if p.dim is not None:
                shape[p.dim] = p.need.index.numel()
            shapes[p.name] = shape
        self.holder = _holder(shapes, like)
        self.names = {p.name: sglang_name(p.rule) for p in plan}
        self.shared = SharedRolloutWeights(train_model, self.holder, cfg, t, r, train_tp_group, gpu=gpu,
                                           mapping="consecutive", layout="sglang")
        self.classes = {p.name: p.klass for p in plan}

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(SGLang name, tensor) of every parameter, in plan order."""
        held = dict(self.holder.named_parameters())
        return [(self.names[n], held[n].data) for n in self.names]

    def refresh(self) -> float:
        """Rebuild the buffers from the current training weights (after the optimizer step); seconds."""
        return self.shared.refresh()

    def allocated_bytes(self) -> int:
        """Bytes the buffers own (the views own none)."""
        return self.shared.allocated_bytes()


def alias_loader(model, named_tensors) -> None:
    """Make each named SGLang parameter the given tensor (same storage, no copy); shapes and dtypes must match."""
    params = dict(model.named_parameters())
    for name, tensor in named_tensors:
        if name not in params:
            raise KeyError(f"SGLang's model has no parameter {name!r}; the rollplex weight names follow SGLang's "
                           f"Qwen2.5-VL (qkv_proj, gate_up_proj, attn.qkv_proj)")
        param = params[name]
        if tuple(param.shape) != tuple(tensor.shape) or param.dtype != tensor.dtype:
            raise ValueError(f"SGLang parameter {name}: {tuple(param.shape)} {param.dtype} here, "
                             f"{tuple(tensor.shape)} {tensor.dtype} from the trainer; the TP degrees or dtypes differ")
        param.data = tensor
