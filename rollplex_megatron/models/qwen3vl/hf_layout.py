"""Hugging Face <-> megatron tensor layouts for Qwen3-VL: one `Rule` per megatron parameter, and the HF shapes.

Naming: Qwen3-VL's released files use transformers' module tree (`model.language_model.` / `model.visual.`), the
only names transformers 5.24 loads for this family, so that is `HFNaming()` (an export writes it); a file in
Qwen2.5-VL's older flat scheme (`model.` / `visual.`) is still read. The rule kinds are shared
(models/hf_rules.py); the vision MLP is not gated, so its fc1 is a plain row split (zero-padded to a multiple of
TP, exact: GELU(0) = 0).
"""
from __future__ import annotations

from dataclasses import dataclass

from rollplex_megatron.config import ModelConfig
from rollplex_megatron.models.hf_rules import Rule
from rollplex_megatron.models.qwen25vl import hf_layout as Q25
from rollplex_megatron.models.qwen25vl.hf_layout import _llm_rules as _qwen25_llm_rules


@dataclass(frozen=True)
class HFNaming(Q25.HFNaming):
    """Name prefixes of a Qwen3-VL checkpoint: transformers' module tree (the released files'), or the flat scheme."""

    llm: str = "model.language_model."
    vision: str = "model.visual."

    @staticmethod
    def detect(keys) -> "HFNaming":
        """Pick the scheme that the checkpoint's tensor names use."""
        flat = not any(k.startswith("model.language_model.") for k in keys) and any(
            k.startswith("model.layers.") for k in keys)
        return HFNaming(llm="model.", vision="visual.") if flat else HFNaming()


def model_rules(cfg: ModelConfig, tp: int, pp: int, naming: HFNaming = HFNaming()) -> list[Rule]:
    """Every megatron parameter of the model with its HF sources, stage and layout."""
    return _vision_rules(cfg, tp, naming.vision) + _llm_rules(cfg, tp, pp, naming.llm)


def _merger_rules(m: str, h: str) -> list[Rule]:
    return [Rule(m + "norm.weight", (h + "norm.weight",), "replicate", 0),
            Rule(m + "norm.bias", (h + "norm.bias",), "replicate", 0),
            Rule(m + "fc1.weight", (h + "linear_fc1.weight",), "rows", 0),
            Rule(m + "fc1.bias", (h + "linear_fc1.bias",), "rows", 0),
            Rule(m + "fc2.weight", (h + "linear_fc2.weight",), "cols", 0),
            Rule(m + "fc2.bias", (h + "linear_fc2.bias",), "replicate", 0)]


def _vision_rules(cfg: ModelConfig, tp: int, pre: str) -> list[Rule]:
    v = cfg.vision
    pad = {"pad_to": cfg.padded_vision_ffn(tp)}
    qkv = {"ng": v.num_heads, "np": v.num_heads, "hd": v.hidden_size // v.num_heads}
    rules = [Rule("vision.patch_embed.weight", (f"{pre}patch_embed.proj.weight",), "replicate", 0),
             Rule("vision.patch_embed.bias", (f"{pre}patch_embed.proj.bias",), "replicate", 0),
             Rule("vision.pos_embed.weight", (f"{pre}pos_embed.weight",), "replicate", 0)]
    for i in range(v.depth):
        m, h = f"vision.blocks.layers.{i}.", f"{pre}blocks.{i}."
        for ours, theirs in (("input_layernorm", "norm1"), ("pre_mlp_layernorm", "norm2")):
            rules += [Rule(f"{m}{ours}.{p}", (f"{h}{theirs}.{p}",), "replicate", 0) for p in ("weight", "bias")]
        rules += [
            Rule(m + "self_attention.linear_qkv.weight", (h + "attn.qkv.weight",), "qkv_fused", 0, opts=qkv),
            Rule(m + "self_attention.linear_qkv.bias", (h + "attn.qkv.bias",), "qkv_fused", 0, opts=qkv),
            Rule(m + "self_attention.linear_proj.weight", (h + "attn.proj.weight",), "cols", 0),
            Rule(m + "self_attention.linear_proj.bias", (h + "attn.proj.bias",), "replicate", 0),
            Rule(m + "mlp.linear_fc1.weight", (h + "mlp.linear_fc1.weight",), "rows", 0, opts=pad),
            Rule(m + "mlp.linear_fc1.bias", (h + "mlp.linear_fc1.bias",), "rows", 0, opts=pad),
            Rule(m + "mlp.linear_fc2.weight", (h + "mlp.linear_fc2.weight",), "cols", 0, opts=pad),
            Rule(m + "mlp.linear_fc2.bias", (h + "mlp.linear_fc2.bias",), "replicate", 0),
        ]
    rules += _merger_rules("vision.merger.", f"{pre}merger.")
    for j in range(len(v.deepstack_visual_indexes)):
        rules += _merger_rules(f"vision.deepstack_mergers.{j}.", f"{pre}deepstack_merger_list.{j}.")
    return rules


def _llm_rules(cfg: ModelConfig, tp: int, pp: int, pre: str) -> list[Rule]:
    """Qwen2.5-VL's LLM rules without the QKV biases, with the per-head q/k norms."""
    rules = [r for r in _qwen25_llm_rules(cfg, tp, pp, pre) if not r.mcore.endswith("linear_qkv.bias")]
    per_stage = cfg.num_layers // pp
    for i in range(cfg.num_layers):
        m, a = f"language_model.decoder.layers.{i}.self_attention.", f"{pre}layers.{i}.self_attn."
        rules += [Rule(m + "q_layernorm.weight", (a + "q_norm.weight",), "replicate", i // per_stage, i),
                  Rule(m + "k_layernorm.weight", (a + "k_norm.weight",), "replicate", i // per_stage, i)]
    return rules


def _merger_shapes(h: str, width: int, norm: int, out: int) -> dict[str, tuple[int, ...]]:
    return {h + "norm.weight": (norm,), h + "norm.bias": (norm,), h + "linear_fc1.weight": (width, width),
            h + "linear_fc1.bias": (width,), h + "linear_fc2.weight": (out, width), h + "linear_fc2.bias": (out,)}


def expected_hf_shapes(cfg: ModelConfig, naming: HFNaming) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of this config with its shape (lm_head included only when untied)."""
    v, vp, lp = cfg.vision, naming.vision, naming.llm
    vh, vf, h, hd = v.hidden_size, v.ffn_hidden_size, cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_query_groups * hd
    out = {f"{vp}patch_embed.proj.weight": (vh, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size),
           f"{vp}patch_embed.proj.bias": (vh,), f"{vp}pos_embed.weight": (v.num_position_embeddings, vh)}
    for i in range(v.depth):
        b = f"{vp}blocks.{i}."
        out.update({b + "norm1.weight": (vh,), b + "norm1.bias": (vh,), b + "norm2.weight": (vh,),
                    b + "norm2.bias": (vh,), b + "attn.qkv.weight": (3 * vh, vh), b + "attn.qkv.bias": (3 * vh,),
                    b + "attn.proj.weight": (vh, vh), b + "attn.proj.bias": (vh,),
                    b + "mlp.linear_fc1.weight": (vf, vh), b + "mlp.linear_fc1.bias": (vf,),
                    b + "mlp.linear_fc2.weight": (vh, vf), b + "mlp.linear_fc2.bias": (vh,)})
    mw = vh * v.spatial_merge_size ** 2
    out.update(_merger_shapes(f"{vp}merger.", mw, vh, h))
    for j in range(len(v.deepstack_visual_indexes)):
        out.update(_merger_shapes(f"{vp}deepstack_merger_list.{j}.", mw, mw, h))
    out[f"{lp}embed_tokens.weight"] = (cfg.vocab_size, h)
    out[f"{lp}norm.weight"] = (h,)
    for i in range(cfg.num_layers):
        b, a = f"{lp}layers.{i}.", f"{lp}layers.{i}.self_attn."
        out.update({b + "input_layernorm.weight": (h,), b + "post_attention_layernorm.weight": (h,),
                    a + "q_proj.weight": (q, h), a + "k_proj.weight": (kv, h), a + "v_proj.weight": (kv, h),
                    a + "o_proj.weight": (h, q), a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,),
                    b + "mlp.gate_proj.weight": (cfg.ffn_hidden_size, h),
                    b + "mlp.up_proj.weight": (cfg.ffn_hidden_size, h),
                    b + "mlp.down_proj.weight": (h, cfg.ffn_hidden_size)})
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    return out
