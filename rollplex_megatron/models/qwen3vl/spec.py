"""Qwen3-VL's entry in the model registry: every field of the seam's contract (models/spec.py)."""
from __future__ import annotations

from transformers import Qwen3VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from rollplex_megatron.models.qwen25vl import model as Q25
from rollplex_megatron.models.qwen25vl import positions as Q25P
from rollplex_megatron.models.qwen3vl import hf as H
from rollplex_megatron.models.qwen3vl import hf_layout as L
from rollplex_megatron.models.qwen3vl import model as M
from rollplex_megatron.models.qwen3vl import positions as P
from rollplex_megatron.models.qwen3vl.flops import vision_flops
from rollplex_megatron.models.spec import Decode, HFLayout, Layers, ModelSpec, Positions, Processor, Vision

SPEC = ModelSpec(
    family="qwen3_vl",
    build=M.build_model,
    check_megatron=M.check_megatron_overrides,
    hf=HFLayout(model_types=H.SUPPORTED_MODEL_TYPES, reference_model=Qwen3VLForConditionalGeneration,
                checkpoint=H.HFCheckpoint, config_from_hf=H.model_config_from_hf, config_to_hf=H.config_to_hf,
                naming=L.HFNaming, rules=L.model_rules, shapes=L.expected_hf_shapes,
                validate=H.validate_checkpoint, load=H.load_hf_into_model, shard=H.shard_checkpoint,
                export=H.export_hf_tensors),
    # text after a prompt counts up on every axis, as in Qwen2.5-VL
    positions=Positions(sequence=P.sequence_positions, prompt=P.prompt_positions, response=Q25P.response_positions),
    vision=Vision(tower=M.VisionTower, inputs=Q25.VISION_KEYS, check_placeholders=Q25.check_placeholders,
                  flops=vision_flops),
    processor=Processor(
        special_tokens={"<|image_pad|>": "image_token_id", "<|video_pad|>": "video_token_id",
                        "<|vision_start|>": "vision_start_token_id", "<|vision_end|>": "vision_end_token_id"},
        # Qwen3VLVideoProcessor's class defaults (size shortest/longest edge in pixels, 32 = patch * merge)
        video_defaults={"min_pixels": 128 * 32 * 32, "max_pixels": 768 * 32 * 32, "patch_size": 16,
                        "temporal_patch_size": 2, "merge_size": 2},
        image_processor=Qwen2VLImageProcessorPil, video_run_per_frame=True),
    decode=Decode(positions=Q25P.decode_positions, gather_logits=Q25.gather_vocab_logits),
    layers=Layers(qkv_bias=False, qk_norm=True, vision_norm="LayerNorm", vision_gated_mlp=False,
                  vision_patch_bias=True),
)
