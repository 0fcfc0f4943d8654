"""Qwen2.5-VL's entry in the model registry: every field of the seam's contract (models/spec.py)."""
from __future__ import annotations

from transformers import Qwen2_5_VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from rollplex_megatron.models.qwen25vl import hf as H
from rollplex_megatron.models.qwen25vl import hf_layout as L
from rollplex_megatron.models.qwen25vl import model as M
from rollplex_megatron.models.qwen25vl import positions as P
from rollplex_megatron.models.qwen25vl.flops import vision_flops
from rollplex_megatron.models.spec import Decode, HFLayout, Layers, ModelSpec, Positions, Processor, Vision

SPEC = ModelSpec(
    family="qwen2_5_vl",
    build=M.build_model,
    check_megatron=M.check_megatron_overrides,
    hf=HFLayout(model_types=H.SUPPORTED_MODEL_TYPES, reference_model=Qwen2_5_VLForConditionalGeneration,
                checkpoint=H.HFCheckpoint, config_from_hf=H.model_config_from_hf, config_to_hf=H.config_to_hf,
                naming=L.HFNaming, rules=L.model_rules, shapes=H.expected_hf_shapes,
                validate=H.validate_checkpoint, load=H.load_hf_into_model, shard=H.shard_checkpoint,
                export=H.export_hf_tensors),
    positions=Positions(sequence=P.sequence_positions, prompt=P.prompt_positions, response=P.response_positions),
    vision=Vision(tower=M.VisionTower, inputs=M.VISION_KEYS, check_placeholders=M.check_placeholders,
                  flops=vision_flops),
    processor=Processor(
        special_tokens={"<|image_pad|>": "image_token_id", "<|video_pad|>": "video_token_id",
                        "<|vision_start|>": "vision_start_token_id", "<|vision_end|>": "vision_end_token_id"},
        # Qwen2VLVideoProcessor's class defaults
        video_defaults={"min_pixels": 128 * 28 * 28, "max_pixels": 768 * 28 * 28, "patch_size": 14,
                        "temporal_patch_size": 2, "merge_size": 2},
        image_processor=Qwen2VLImageProcessorPil),
    decode=Decode(positions=P.decode_positions, gather_logits=M.gather_vocab_logits),
    layers=Layers(qkv_bias=True, qk_norm=False, vision_norm="RMSNorm", vision_gated_mlp=True,
                  vision_patch_bias=False),
)
