"""Hugging Face Qwen3-VL checkpoints: config parsing both ways, the lazy reader, validation, load, shard, export.

The reader is Qwen2.5-VL's (safetensors opened lazily, tensor by tensor) with this family's model types, config
parsing and shape checks; the rest goes through this family's rules (models/qwen3vl/hf_layout.py).
"""
from __future__ import annotations

import torch
from transformers import Qwen3VLConfig

from rollplex_megatron.checkpoint.files import CheckpointError
from rollplex_megatron.config import ModelConfig, VisionConfig
from rollplex_megatron.models import hf_rules as R
from rollplex_megatron.models.qwen25vl import hf as Q25
from rollplex_megatron.models.qwen3vl import hf_layout as L

SUPPORTED_MODEL_TYPES = {"qwen3_vl": "Qwen3VLForConditionalGeneration"}


def check_model_type(hf: dict, where: str) -> None:
    """config.json must describe Qwen3-VL (dense) before any field is read."""
    mt = hf.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"{where}: model_type {mt!r} is not supported by the qwen3_vl family; supported: "
                              + ", ".join(f"{k} ({v})" for k, v in SUPPORTED_MODEL_TYPES.items()))


def _vision_config(vc: dict, out_hidden: int) -> VisionConfig:
    """VisionConfig of a Qwen3-VL vision_config dict: no windows (every block attends in full within a frame)."""
    patch, merge = vc.get("patch_size", 16), vc.get("spatial_merge_size", 2)
    return VisionConfig(
        depth=vc["depth"], hidden_size=vc["hidden_size"], ffn_hidden_size=vc["intermediate_size"],
        num_heads=vc["num_heads"], out_hidden_size=vc.get("out_hidden_size", out_hidden), patch_size=patch,
        temporal_patch_size=vc.get("temporal_patch_size", 2), spatial_merge_size=merge,
        window_size=patch * merge, fullatt_block_indexes=list(range(vc["depth"])),  # windows unused: all full
        in_channels=vc.get("in_channels", 3), rope_theta=(vc.get("rope_parameters") or {}).get("rope_theta", 10000.0),
        num_position_embeddings=vc.get("num_position_embeddings", 2304),
        deepstack_visual_indexes=list(vc.get("deepstack_visual_indexes", [8, 16, 24])))


def model_config_from_hf(hf: dict, name: str = "hf") -> ModelConfig:
    """ModelConfig (family qwen3_vl) from a Qwen3-VL config.json dict."""
    check_model_type(hf, f"{name}: config.json")
    text = dict(hf.get("text_config") or {})
    get = lambda k, d=None: text.get(k, hf.get(k, d))  # noqa: E731
    rope = get("rope_parameters") or get("rope_scaling") or {}
    vc = hf["vision_config"]
    if vc.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh" or get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{name}: only Qwen3-VL's activations (vision gelu_pytorch_tanh, LLM silu) are supported")
    if not rope.get("mrope_interleaved", True) or get("attention_bias", False):
        raise CheckpointError(f"{name}: config.json sets mrope_interleaved=false or attention_bias=true, which "
                              f"Qwen3-VL does not; only the released layout is supported")
    heads = get("num_attention_heads")
    return ModelConfig(
        name=name, family="qwen3_vl", vocab_size=get("vocab_size"), hidden_size=get("hidden_size"),
        ffn_hidden_size=get("intermediate_size"), num_layers=get("num_hidden_layers"), num_attention_heads=heads,
        num_query_groups=get("num_key_value_heads") or heads, kv_channels=get("head_dim", 128),
        rms_norm_eps=get("rms_norm_eps", 1e-6), rope_theta=rope.get("rope_theta", 5e6),
        mrope_section=list(rope.get("mrope_section", [24, 20, 20])),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        max_position_embeddings=get("max_position_embeddings", 262144),
        image_token_id=hf.get("image_token_id", 151655), video_token_id=hf.get("video_token_id", 151656),
        vision_start_token_id=hf.get("vision_start_token_id", 151652),
        vision_end_token_id=hf.get("vision_end_token_id", 151653), vision=_vision_config(vc, get("hidden_size")))


def config_to_hf(cfg: ModelConfig) -> dict:
    """A Qwen3-VL config.json for `cfg`, built by transformers' own config class."""
    v = cfg.vision
    text = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
                num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
                num_key_value_heads=cfg.num_query_groups, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
                max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings,
                rope_parameters=dict(rope_type="default", rope_theta=cfg.rope_theta, mrope_interleaved=True,
                                     mrope_section=list(cfg.mrope_section)))
    for key, default in (("bos_token_id", 151643), ("eos_token_id", 151645)):  # see Qwen2.5-VL's config_to_hf
        text[key] = default if default < cfg.vocab_size else None
    vision = dict(depth=v.depth, hidden_size=v.hidden_size, intermediate_size=v.ffn_hidden_size, num_heads=v.num_heads,
                  out_hidden_size=v.out_hidden_size, patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
                  spatial_merge_size=v.spatial_merge_size, in_channels=v.in_channels,
                  num_position_embeddings=v.num_position_embeddings,
                  deepstack_visual_indexes=list(v.deepstack_visual_indexes))
    hf = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=cfg.tie_word_embeddings,
                       image_token_id=cfg.image_token_id, video_token_id=cfg.video_token_id,
                       vision_start_token_id=cfg.vision_start_token_id,
                       vision_end_token_id=cfg.vision_end_token_id).to_dict()
    hf["architectures"] = ["Qwen3VLForConditionalGeneration"]
    return hf


class HFCheckpoint(Q25.HFCheckpoint):
    """Lazy, per-tensor view of a Qwen3-VL safetensors checkpoint directory."""

    check_model_type = staticmethod(check_model_type)
    naming_scheme = L.HFNaming
    config_from_hf = staticmethod(model_config_from_hf)

    def check_config_shapes(self) -> None:
        """config.json's widths and counts against the tensors' shapes, before any data is read."""
        cfg = model_config_from_hf(self.raw_config, name=str(self.path))
        want = L.expected_hf_shapes(cfg, self.naming)
        n = self.naming
        for name in (f"{n.llm}embed_tokens.weight", f"{n.llm}layers.0.self_attn.q_proj.weight",
                     f"{n.llm}layers.0.self_attn.k_proj.weight", f"{n.llm}layers.0.mlp.gate_proj.weight",
                     f"{n.vision}blocks.0.attn.qkv.weight", f"{n.vision}blocks.0.mlp.linear_fc1.weight",
                     f"{n.vision}pos_embed.weight"):
            if name in self.weight_map and self.shape(name) != want[name]:
                raise CheckpointError(f"{self.path}: config.json gives {name} the shape {want[name]}, but the tensor "
                                      f"has {self.shape(name)}; config.json and the weights disagree")


def validate_checkpoint(ckpt: HFCheckpoint, cfg: ModelConfig) -> None:
    """Missing, unexpected or mis-shaped tensors: one error listing them, before any data is read."""
    want, have = L.expected_hf_shapes(cfg, ckpt.naming), ckpt.keys()
    optional = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    problems = [f"{what} ({len(names)}): {', '.join(names[:8])}" for what, names in (
        ("missing tensors", sorted(set(want) - have)), ("unexpected tensors", sorted(have - set(want) - optional)),
        ("shape mismatches", [f"{k}: checkpoint {ckpt.shape(k)} vs model {want[k]}"
                              for k in sorted(set(want) & have) if ckpt.shape(k) != want[k]])) if names]
    if problems:
        raise CheckpointError(f"{ckpt.path} does not match model '{cfg.name}': " + " | ".join(problems))


def shard_checkpoint(ckpt: HFCheckpoint, cfg: ModelConfig, tp_rank: int, tp: int, pp_rank: int,
                     pp: int) -> dict[str, torch.Tensor]:
    """One rank's megatron state (local names) straight from the HF files, without a model."""
    validate_checkpoint(ckpt, cfg)
    rules = R.stage_rules(L.model_rules(cfg, tp, pp, ckpt.naming), pp_rank, pp)
    return {R.local_name(r, cfg, pp): R.to_shard(r, [ckpt.get(n) for n in r.hf], tp_rank, tp).clone() for r in rules}


def load_hf_into_model(model: torch.nn.Module, ckpt: HFCheckpoint, cfg: ModelConfig, tp_rank: int, tp: int,
                       pp_rank: int, pp: int) -> int:
    """Copy this rank's shards into `model` (one stage), tensor by tensor; returns tensors loaded."""
    validate_checkpoint(ckpt, cfg)
    params = dict(model.named_parameters())
    rules = R.stage_rules(L.model_rules(cfg, tp, pp, ckpt.naming), pp_rank, pp)
    missing = sorted(set(params) - {R.local_name(r, cfg, pp) for r in rules})
    if missing:
        raise CheckpointError(f"model parameters with no checkpoint source: {missing[:8]}")
    with torch.no_grad():
        for r in rules:
            name, shard = R.local_name(r, cfg, pp), R.to_shard(r, [ckpt.get(n) for n in r.hf], tp_rank, tp)
            if tuple(shard.shape) != tuple(params[name].shape):
                raise CheckpointError(f"{name} (from {', '.join(r.hf)}): shard {tuple(shard.shape)} vs parameter "
                                      f"{tuple(params[name].shape)} at tp={tp}")
            params[name].copy_(shard.to(params[name].dtype))
    return len(rules)


def export_hf_tensors(rank_states, cfg: ModelConfig, tp: int, pp: int, naming: L.HFNaming):
    """Yield (hf_name, tensor) one at a time from `rank_states[pp_rank][tp_rank]` (lazy dicts ok)."""
    shapes = L.expected_hf_shapes(cfg, naming)
    for r in L.model_rules(cfg, tp, pp, naming):
        if not r.export:
            continue
        stage, name = (r.stage if r.stage >= 0 else pp - 1), R.local_name(r, cfg, pp)
        shards = [rank_states[stage][t][name] for t in range(tp)]
        for hf_name, t in zip(r.hf, R.from_shards(r, shards, [shapes[n] for n in r.hf])):
            yield hf_name, t.contiguous()
