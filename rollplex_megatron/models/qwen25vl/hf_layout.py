"""Hugging Face <-> megatron tensor layouts for Qwen2.5-VL: its checkpoint naming and one `Rule` per parameter.

The rule kinds and their shard arithmetic are shared by every family (models/hf_rules.py, re-exported here).
Vocabulary rows are padded to a multiple of 128*TP; the vision SwiGLU width is zero-padded to a multiple of TP.
"""
from __future__ import annotations

from dataclasses import dataclass

from rollplex_megatron.config import ModelConfig
from rollplex_megatron.models.hf_rules import (Rule, _qkv_fuse, _qkv_split, from_shards, local_name,  # noqa: F401
                                               stage_rules, to_shard)


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
