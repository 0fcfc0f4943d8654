"""Hugging Face <-> megatron tensor layouts for Qwen2.5-VL, as pure functions per tensor.

A `Rule` ties one megatron parameter (global layer numbering) to the HF tensors it is made of and
knows how to cut this TP rank's shard from them (`to_shard`) and how to rebuild them from all TP
shards (`from_shards`). Megatron layouts: fused QKV is group-major `[ng, (np/ng)*hd + 2*hd, ...]`;
gated fc1 is `[gate_r; up_r]` on each rank; row-parallel weights shard dim 1; vocabulary rows are
padded to a multiple of 128*TP; the vision SwiGLU width is zero-padded to a multiple of TP.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from rollplex_megatron.config import ModelConfig


@dataclass(frozen=True)
class Rule:
    """One megatron parameter and the HF tensors that make it."""

    mcore: str  # megatron name with global layer index
    hf: tuple[str, ...]  # HF tensor names, in the order `to_shard` takes them
    kind: str  # replicate | rows | cols | qkv | qkv_fused | fc1
    stage: int  # pipeline stage that holds it (-1: last stage)
    layer: int | None = None  # global LLM layer index (renumbered per stage)
    opts: dict = field(default_factory=dict, hash=False, compare=False)  # kind parameters
    export: bool = True  # False: a tied copy that export must not write twice


def _pad_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    return t if t.shape[0] == n else F.pad(t, [0, 0] * (t.dim() - 1) + [0, n - t.shape[0]])


def _pad_cols(t: torch.Tensor, n: int) -> torch.Tensor:
    return t if t.shape[1] == n else F.pad(t, (0, n - t.shape[1]))


def _qkv_fuse(q, k, v, ng: int) -> torch.Tensor:
    """[q; k; v] (HF) -> megatron group-major fused rows."""
    hd = k.shape[0] // ng
    rest = q.shape[1:]
    qg = q.reshape(ng, -1, *rest)
    kg, vg = k.reshape(ng, hd, *rest), v.reshape(ng, hd, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)


def _qkv_split(fused: torch.Tensor, ng: int, np_: int, hd: int):
    """Megatron group-major fused rows -> (q, k, v) in HF order."""
    rest = fused.shape[1:]
    g = fused.reshape(ng, (np_ // ng + 2) * hd, *rest)
    q, k, v = g.split([np_ // ng * hd, hd, hd], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def to_shard(rule: Rule, tensors: list[torch.Tensor], tp_rank: int, tp: int) -> torch.Tensor:
    """This TP rank's megatron shard from the HF tensors of `rule`."""
    o, k = rule.opts, rule.kind
    if k == "replicate":
        return tensors[0]
    if k == "rows":
        return _pad_rows(tensors[0], o.get("pad_to", tensors[0].shape[0])).chunk(tp)[tp_rank]
    if k == "cols":
        return _pad_cols(tensors[0], o.get("pad_to", tensors[0].shape[1])).chunk(tp, dim=1)[tp_rank]
    if k in ("qkv", "qkv_fused"):
        q, kk, v = tensors if k == "qkv" else tensors[0].chunk(3)
        return _qkv_fuse(q, kk, v, o["ng"]).chunk(tp)[tp_rank]
    if k == "fc1":
        gate, up = (_pad_rows(t, o.get("pad_to", t.shape[0])) for t in tensors)
        return torch.cat([gate.chunk(tp)[tp_rank], up.chunk(tp)[tp_rank]])
    raise ValueError(f"unknown layout kind {k!r} for {rule.mcore}")


def from_shards(rule: Rule, shards: list[torch.Tensor], hf_shapes: list[tuple]) -> list[torch.Tensor]:
    """The HF tensors of `rule` rebuilt from its TP shards (rank order); padding dropped."""
    o, k = rule.opts, rule.kind
    if k == "replicate":
        return [shards[0]]
    if k == "rows":
        return [torch.cat(shards)[: hf_shapes[0][0]]]
    if k == "cols":
        return [torch.cat(shards, dim=1)[:, : hf_shapes[0][1]]]
    if k in ("qkv", "qkv_fused"):
        q, kk, v = _qkv_split(torch.cat(shards), o["ng"], o["np"], o["hd"])
        return [q, kk, v] if k == "qkv" else [torch.cat([q, kk, v])]
    if k == "fc1":
        halves = [s.chunk(2) for s in shards]
        gate = torch.cat([h[0] for h in halves])[: hf_shapes[0][0]]
        up = torch.cat([h[1] for h in halves])[: hf_shapes[1][0]]
        return [gate, up]
    raise ValueError(f"unknown layout kind {k!r} for {rule.mcore}")


@dataclass(frozen=True)
class HFNaming:
    """Name prefixes of a Qwen2.5-VL checkpoint: released files, or transformers' module tree."""

    llm: str = "model."  # released: model.layers...; module tree: model.language_model.layers...
    vision: str = "visual."  # released: visual.blocks...; module tree: model.visual.blocks...

    @staticmethod
    def detect(keys) -> "HFNaming":
        """Pick the scheme that the checkpoint's tensor names use."""
        if any(k.startswith("model.language_model.") for k in keys):
            return HFNaming(llm="model.language_model.", vision="model.visual.")
        return HFNaming()


def model_rules(cfg: ModelConfig, tp: int, pp: int, naming: HFNaming = HFNaming()) -> list[Rule]:
    """Every megatron parameter of the model with its HF sources, stage and layout."""
    return _vision_rules(cfg, tp, naming.vision) + _llm_rules(cfg, tp, pp, naming.llm)


def _vision_rules(cfg: ModelConfig, tp: int, pre: str) -> list[Rule]:
    v = cfg.vision
    ffn = cfg.padded_vision_ffn(tp)
    qkv = {"ng": v.num_heads, "np": v.num_heads, "hd": v.hidden_size // v.num_heads}
    rules = [Rule("vision.patch_embed.weight", (f"{pre}patch_embed.proj.weight",), "replicate", 0)]
    for i in range(v.depth):
        m, h = f"vision.blocks.layers.{i}.", f"{pre}blocks.{i}."
        rules += [
            Rule(m + "input_layernorm.weight", (h + "norm1.weight",), "replicate", 0),
            Rule(m + "pre_mlp_layernorm.weight", (h + "norm2.weight",), "replicate", 0),
            Rule(m + "self_attention.linear_qkv.weight", (h + "attn.qkv.weight",), "qkv_fused", 0, opts=qkv),
            Rule(m + "self_attention.linear_qkv.bias", (h + "attn.qkv.bias",), "qkv_fused", 0, opts=qkv),
            Rule(m + "self_attention.linear_proj.weight", (h + "attn.proj.weight",), "cols", 0),
            Rule(m + "self_attention.linear_proj.bias", (h + "attn.proj.bias",), "replicate", 0),
            Rule(m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"),
                 "fc1", 0, opts={"pad_to": ffn}),
            Rule(m + "mlp.linear_fc1.bias", (h + "mlp.gate_proj.bias", h + "mlp.up_proj.bias"),
                 "fc1", 0, opts={"pad_to": ffn}),
            Rule(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), "cols", 0, opts={"pad_to": ffn}),
            Rule(m + "mlp.linear_fc2.bias", (h + "mlp.down_proj.bias",), "replicate", 0),
        ]
    mp = f"{pre}merger."
    rules += [
        Rule("vision.merger.ln_q.weight", (mp + "ln_q.weight",), "replicate", 0),
        Rule("vision.merger.fc1.weight", (mp + "mlp.0.weight",), "rows", 0),
        Rule("vision.merger.fc1.bias", (mp + "mlp.0.bias",), "rows", 0),
        Rule("vision.merger.fc2.weight", (mp + "mlp.2.weight",), "cols", 0),
        Rule("vision.merger.fc2.bias", (mp + "mlp.2.bias",), "replicate", 0),
    ]
    return rules


def _llm_rules(cfg: ModelConfig, tp: int, pp: int, pre: str) -> list[Rule]:
    vocab = {"pad_to": cfg.padded_vocab_size(tp)}
    qkv = {"ng": cfg.num_query_groups, "np": cfg.num_attention_heads, "hd": cfg.head_dim}
    per_stage = cfg.num_layers // pp
    embed = f"{pre}embed_tokens.weight"
    rules = [Rule("language_model.embedding.word_embeddings.weight", (embed,), "rows", 0, opts=vocab)]
    for i in range(cfg.num_layers):
        m, h, st = f"language_model.decoder.layers.{i}.", f"{pre}layers.{i}.", i // per_stage
        a = h + "self_attn."
        rules += [
            Rule(m + "input_layernorm.weight", (h + "input_layernorm.weight",), "replicate", st, i),
            Rule(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), "replicate", st, i),
            Rule(m + "self_attention.linear_qkv.weight",
                 (a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"), "qkv", st, i, opts=qkv),
            Rule(m + "self_attention.linear_qkv.bias",
                 (a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"), "qkv", st, i, opts=qkv),
            Rule(m + "self_attention.linear_proj.weight", (a + "o_proj.weight",), "cols", st, i),
            Rule(m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"),
                 "fc1", st, i),
            Rule(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), "cols", st, i),
        ]
    rules.append(Rule("language_model.decoder.final_layernorm.weight", (f"{pre}norm.weight",),
                      "replicate", pp - 1))
    if not cfg.tie_word_embeddings:
        rules.append(Rule("language_model.output_layer.weight", ("lm_head.weight",), "rows", pp - 1,
                          opts=vocab))
    elif pp > 1:
        # Tied weights on a separate last stage: megatron keeps a copy, synced by finalize_model_grads.
        rules.append(Rule("language_model.output_layer.weight", (embed,), "rows", pp - 1, opts=vocab,
                          export=False))
    return rules


def local_name(rule: Rule, cfg: ModelConfig, pp: int) -> str:
    """The parameter's name inside its stage's module (layer index renumbered from 0)."""
    if rule.layer is None:
        return rule.mcore
    local = rule.layer % (cfg.num_layers // pp)
    return rule.mcore.replace(f"layers.{rule.layer}.", f"layers.{local}.", 1)


def stage_rules(rules: list[Rule], stage: int, pp: int) -> list[Rule]:
    """The rules whose parameter lives on pipeline stage `stage`."""
    return [r for r in rules if (r.stage if r.stage >= 0 else pp - 1) == stage]
