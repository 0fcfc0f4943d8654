"""Hugging Face Qwen2.5-VL checkpoints: config parsing, streaming reads, validation, load, export.

Reads go tensor by tensor through safetensors' lazy `safe_open`, so the checkpoint is never held in
memory twice; exports write size-capped safetensors shards with an index, each file atomically.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import Qwen2_5_VLConfig

from rollplex_megatron.checkpoint.files import check_model_type as check_model_type_in
from rollplex_megatron.checkpoint.files import (INDEX, CheckpointError, atomic_save, atomic_write_text,  # noqa: F401
                                                load_torch_file, read_json, write_safetensors)
from rollplex_megatron.config import ModelConfig, VisionConfig
from rollplex_megatron.models.qwen25vl import hf_layout as L


SUPPORTED_MODEL_TYPES = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}


def check_model_type(hf: dict, where: str) -> None:
    """config.json must describe a supported architecture (before any field is read)."""
    check_model_type_in(hf, where, SUPPORTED_MODEL_TYPES)


def _text_fields(hf: dict):
    text = dict(hf.get("text_config") or {})
    return lambda k, d=None: text.get(k, hf.get(k, d))


def model_config_from_hf(hf: dict, name: str = "hf") -> ModelConfig:
    """ModelConfig from a config.json dict (released flat layout or transformers' text_config layout)."""
    check_model_type(hf, f"{name}: config.json")
    text = dict(hf.get("text_config") or {})
    get = _text_fields(hf)
    rope = get("rope_parameters") or get("rope_scaling") or {}
    vc = hf["vision_config"]
    vision = VisionConfig(
        depth=vc["depth"], hidden_size=vc["hidden_size"], ffn_hidden_size=vc["intermediate_size"],
        num_heads=vc["num_heads"], out_hidden_size=vc["out_hidden_size"],
        patch_size=vc.get("patch_size", 14), temporal_patch_size=vc.get("temporal_patch_size", 2),
        spatial_merge_size=vc.get("spatial_merge_size", 2), window_size=vc.get("window_size", 112),
        fullatt_block_indexes=list(vc.get("fullatt_block_indexes", [7, 15, 23, 31])),
        tokens_per_second=vc.get("tokens_per_second", 2), in_channels=vc.get("in_channels", vc.get("in_chans", 3)),
        rope_theta=(vc.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    if vc.get("hidden_act", "silu") != "silu" or get("hidden_act", "silu") != "silu":
        raise CheckpointError("only SiLU-gated MLPs (hidden_act='silu') are supported")
    return ModelConfig(
        name=name, family="qwen2_5_vl", vocab_size=get("vocab_size"), hidden_size=get("hidden_size"),
        ffn_hidden_size=get("intermediate_size"), num_layers=get("num_hidden_layers"),
        num_attention_heads=get("num_attention_heads"),
        num_query_groups=get("num_key_value_heads") or get("num_attention_heads"),
        rms_norm_eps=get("rms_norm_eps", 1e-6), rope_theta=rope.get("rope_theta", get("rope_theta", 1e6)),
        mrope_section=list(rope.get("mrope_section", [16, 24, 24])),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        max_position_embeddings=get("max_position_embeddings", 128000),
        image_token_id=hf.get("image_token_id", 151655), video_token_id=hf.get("video_token_id", 151656),
        vision_start_token_id=hf.get("vision_start_token_id", 151652),
        vision_end_token_id=hf.get("vision_end_token_id", 151653), vision=vision)


def config_to_hf(cfg: ModelConfig) -> dict:
    """A Qwen2.5-VL config.json for `cfg`, built by transformers' own config class."""
    v = cfg.vision
    text = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
                num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
                num_key_value_heads=cfg.num_query_groups, rms_norm_eps=cfg.rms_norm_eps,
                max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings,
                rope_parameters=dict(rope_type="default", rope_theta=cfg.rope_theta,
                                     mrope_section=list(cfg.mrope_section)))
    # transformers' defaults are the released vocabulary's <|endoftext|> / <|im_end|>; a smaller vocabulary has none
    for key, default in (("bos_token_id", 151643), ("eos_token_id", 151645)):
        text[key] = default if default < cfg.vocab_size else None
    vision = dict(depth=v.depth, hidden_size=v.hidden_size, intermediate_size=v.ffn_hidden_size,
                  num_heads=v.num_heads, out_hidden_size=v.out_hidden_size, patch_size=v.patch_size,
                  temporal_patch_size=v.temporal_patch_size, spatial_merge_size=v.spatial_merge_size,
                  window_size=v.window_size, fullatt_block_indexes=list(v.fullatt_block_indexes),
                  tokens_per_second=v.tokens_per_second, in_channels=v.in_channels)
    hf = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=cfg.tie_word_embeddings,
                          image_token_id=cfg.image_token_id, video_token_id=cfg.video_token_id,
                          vision_start_token_id=cfg.vision_start_token_id,
                          vision_end_token_id=cfg.vision_end_token_id).to_dict()
    hf["architectures"] = ["Qwen2_5_VLForConditionalGeneration"]
    return hf


class HFCheckpoint:
    """Lazy, per-tensor view of a safetensors checkpoint directory."""

    # a family that reads the same file layout subclasses this with its own three (models/qwen3vl/hf.py)
    check_model_type = staticmethod(check_model_type)
    config_from_hf = staticmethod(model_config_from_hf)
    naming_scheme = L.HFNaming

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if self.path.is_file():
            raise CheckpointError(f"{self.path} is a file; name the Hugging Face model folder that holds it (the one "
                                  f"with config.json)")
        if not (self.path / "config.json").is_file():
            raise CheckpointError(f"{self.path}: no config.json (expected a Hugging Face model directory)")
        self.raw_config = read_json(self.path / "config.json")
        self.check_model_type(self.raw_config, f"{self.path / 'config.json'}")
        self._handles: dict[str, object] = {}
        if (self.path / INDEX).is_file():
            wmap = read_json(self.path / INDEX)["weight_map"]
            for f in sorted(set(wmap.values())):
                self._open(f)  # headers only: a missing or truncated file fails here, by name
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.path}: no *.safetensors files")
            wmap = {}
            for f in files:
                wmap.update({k: f for k in self._open(f).keys()})
        self.weight_map: dict[str, str] = wmap
        self.naming = self.naming_scheme.detect(wmap)

    def _open(self, f: str):
        if f not in self._handles:
            path = self.path / f
            if not path.is_file():
                raise CheckpointError(f"{path}: listed in {INDEX} but missing; download the checkpoint again")
            try:
                self._handles[f] = safe_open(path, "pt")
            except Exception as e:  # safetensors raises its own error types without the file name
                raise CheckpointError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e}); "
                                      f"it is truncated or corrupt, download it again") from None
        return self._handles[f]

    def model_config(self) -> ModelConfig:
        """The ModelConfig this checkpoint describes; config.json's sizes are checked against the
        tensors first, so a wrong size is reported by tensor, not by a derived check."""
        self.check_config_shapes()
        return self.config_from_hf(self.raw_config, name=f"hf:{self.path.name}")

    def check_config_shapes(self) -> None:
        """config.json's widths and counts against a few tensors' shapes (no data read)."""
        get, vc, n = _text_fields(self.raw_config), self.raw_config.get("vision_config") or {}, self.naming
        h, heads = get("hidden_size"), get("num_attention_heads")
        kv = (get("num_key_value_heads") or heads) * (h // heads)
        vh = vc.get("hidden_size")
        want = {f"{n.llm}embed_tokens.weight": ((get("vocab_size"), h), "vocab_size, hidden_size"),
                f"{n.llm}layers.0.self_attn.q_proj.weight": ((h, h), "hidden_size"),
                f"{n.llm}layers.0.self_attn.k_proj.weight": ((kv, h), "num_key_value_heads, hidden_size"),
                f"{n.llm}layers.0.mlp.gate_proj.weight": ((get("intermediate_size"), h), "intermediate_size"),
                f"{n.vision}blocks.0.attn.qkv.weight": ((3 * vh if vh else None, vh), "vision_config.hidden_size"),
                f"{n.vision}blocks.0.mlp.gate_proj.weight": ((vc.get("intermediate_size"), vh),
                                                             "vision_config.intermediate_size")}
        for name, (shape, fields) in want.items():
            if name in self.weight_map and self.shape(name) != shape:
                raise CheckpointError(f"{self.path}: config.json ({fields}) gives {name} the shape {shape}, but the "
                                      f"tensor has {self.shape(name)}; config.json and the weights disagree")
        layers = get("num_hidden_layers")
        last = f"{n.llm}layers.{layers - 1}.input_layernorm.weight" if layers else None
        extra = f"{n.llm}layers.{layers}.input_layernorm.weight" if layers else None
        if last and (last not in self.weight_map or extra in self.weight_map):
            have = sum(k.startswith(f"{n.llm}layers.") and k.endswith(".input_layernorm.weight")
                       for k in self.weight_map)
            raise CheckpointError(f"{self.path}: config.json says num_hidden_layers={layers} but the weights hold "
                                  f"{have} decoder layers")

    def _h(self, name: str):
        return self._open(self.weight_map[name])

    def keys(self) -> set[str]:
        """All tensor names."""
        return set(self.weight_map)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape without reading the data."""
        return tuple(self._h(name).get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        """One tensor, read now."""
        return self._h(name).get_tensor(name)


def expected_hf_shapes(cfg: ModelConfig, naming: L.HFNaming) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of this config with its shape (lm_head included only when untied)."""
    v, h, hd = cfg.vision, cfg.hidden_size, cfg.head_dim
    kv = cfg.num_query_groups * hd
    out: dict[str, tuple[int, ...]] = {}
    vp = naming.vision
    out[f"{vp}patch_embed.proj.weight"] = (v.hidden_size, v.in_channels, v.temporal_patch_size,
                                           v.patch_size, v.patch_size)
    vh, vf = v.hidden_size, v.ffn_hidden_size
    for i in range(v.depth):
        b = f"{vp}blocks.{i}."
        out.update({b + "norm1.weight": (vh,), b + "norm2.weight": (vh,), b + "attn.qkv.weight": (3 * vh, vh),
                    b + "attn.qkv.bias": (3 * vh,), b + "attn.proj.weight": (vh, vh), b + "attn.proj.bias": (vh,),
                    b + "mlp.gate_proj.weight": (vf, vh), b + "mlp.gate_proj.bias": (vf,),
                    b + "mlp.up_proj.weight": (vf, vh), b + "mlp.up_proj.bias": (vf,),
                    b + "mlp.down_proj.weight": (vh, vf), b + "mlp.down_proj.bias": (vh,)})
    mw = vh * v.spatial_merge_size ** 2
    out.update({f"{vp}merger.ln_q.weight": (vh,), f"{vp}merger.mlp.0.weight": (mw, mw),
                f"{vp}merger.mlp.0.bias": (mw,), f"{vp}merger.mlp.2.weight": (h, mw),
                f"{vp}merger.mlp.2.bias": (h,)})
    lp = naming.llm
    out[f"{lp}embed_tokens.weight"] = (cfg.vocab_size, h)
    out[f"{lp}norm.weight"] = (h,)
    for i in range(cfg.num_layers):
        b = f"{lp}layers.{i}."
        out.update({b + "input_layernorm.weight": (h,), b + "post_attention_layernorm.weight": (h,),
                    b + "self_attn.q_proj.weight": (h, h), b + "self_attn.q_proj.bias": (h,),
                    b + "self_attn.k_proj.weight": (kv, h), b + "self_attn.k_proj.bias": (kv,),
                    b + "self_attn.v_proj.weight": (kv, h), b + "self_attn.v_proj.bias": (kv,),
                    b + "self_attn.o_proj.weight": (h, h),
                    b + "mlp.gate_proj.weight": (cfg.ffn_hidden_size, h),
                    b + "mlp.up_proj.weight": (cfg.ffn_hidden_size, h),
                    b + "mlp.down_proj.weight": (h, cfg.ffn_hidden_size)})
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    return out


def validate_checkpoint(ckpt: HFCheckpoint, cfg: ModelConfig) -> None:
    """Missing, unexpected or mis-shaped tensors: one error listing them, before any data is read."""
    want = expected_hf_shapes(cfg, ckpt.naming)
    have = ckpt.keys()
    optional = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    missing = sorted(set(want) - have)
    extra = sorted(have - set(want) - optional)
    bad = [f"{k}: checkpoint {ckpt.shape(k)} vs model {want[k]}" for k in sorted(set(want) & have)
           if ckpt.shape(k) != want[k]]
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {', '.join(missing[:8])}")
    if extra:
        problems.append(f"unexpected tensors ({len(extra)}): {', '.join(extra[:8])}")
    if bad:
        problems.append(f"shape mismatches ({len(bad)}): {'; '.join(bad[:8])}")
    if problems:
        raise CheckpointError(f"{ckpt.path} does not match model '{cfg.name}': " + " | ".join(problems))


def load_hf_into_model(model: torch.nn.Module, ckpt: HFCheckpoint, cfg: ModelConfig,
                       tp_rank: int, tp: int, pp_rank: int, pp: int) -> int:
    """Copy this rank's shards into `model` (one stage), tensor by tensor; returns tensors loaded."""
    validate_checkpoint(ckpt, cfg)
    params = dict(model.named_parameters())
    rules = L.stage_rules(L.model_rules(cfg, tp, pp, ckpt.naming), pp_rank, pp)
    names = {L.local_name(r, cfg, pp) for r in rules}
    missing = sorted(set(params) - names)
    if missing:
        raise CheckpointError(f"model parameters with no checkpoint source: {missing[:8]}")
    with torch.no_grad():
        for r in rules:
            name = L.local_name(r, cfg, pp)
            shard = L.to_shard(r, [ckpt.get(n) for n in r.hf], tp_rank, tp)
            p = params[name]
            if tuple(shard.shape) != tuple(p.shape):
                raise CheckpointError(f"{name} (from {', '.join(r.hf)}): shard {tuple(shard.shape)} "
                                      f"vs parameter {tuple(p.shape)} at tp={tp}")
            p.copy_(shard.to(p.dtype))
    return len(rules)


def shard_checkpoint(ckpt: HFCheckpoint, cfg: ModelConfig, tp_rank: int, tp: int, pp_rank: int,
                     pp: int) -> dict[str, torch.Tensor]:
    """One rank's megatron state (local names) straight from the HF files, without a model."""
    validate_checkpoint(ckpt, cfg)
    rules = L.stage_rules(L.model_rules(cfg, tp, pp, ckpt.naming), pp_rank, pp)
    return {L.local_name(r, cfg, pp): L.to_shard(r, [ckpt.get(n) for n in r.hf], tp_rank, tp).clone()
            for r in rules}


def export_hf_tensors(rank_states, cfg: ModelConfig, tp: int, pp: int, naming: L.HFNaming):
    """Yield (hf_name, tensor) one at a time from `rank_states[pp_rank][tp_rank]` (lazy dicts ok)."""
    shapes = expected_hf_shapes(cfg, naming)
    for r in L.model_rules(cfg, tp, pp, naming):
        if not r.export:
            continue
        stage = r.stage if r.stage >= 0 else pp - 1
        name = L.local_name(r, cfg, pp)
        shards = [rank_states[stage][t][name] for t in range(tp)]
        for hf_name, t in zip(r.hf, L.from_shards(r, shards, [shapes[n] for n in r.hf])):
            yield hf_name, t.contiguous()
