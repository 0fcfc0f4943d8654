"""Tiny random Hugging Face Qwen2.5-VL checkpoints for tests (built with transformers, fp32, CPU)."""
from __future__ import annotations

import torch

TINY_TEXT = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                 rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[2, 3, 3]),
                 max_position_embeddings=4096, bos_token_id=0, eos_token_id=1, pad_token_id=None)
TINY_VISION = dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                   window_size=56, fullatt_block_indexes=[1, 3], tokens_per_second=2)
TINY_TOKENS = dict(image_token_id=310, video_token_id=311, vision_start_token_id=312, vision_end_token_id=313)


def randomise_o1(model, seed: int, is_norm, norm_sd: float = 0.3, bias_sd: float = 0.2, scale: float = 1.5,
                 device: str = "cpu") -> None:
    """Draw `model`'s weights so its logits are O(1) and layout or position mistakes show: norm weights (`is_norm`
    of the parameter name) 1 + N(0, norm_sd), biases N(0, bias_sd), every other tensor N(0, 1) * scale / sqrt(fan-in),
    in parameter order from one generator on `device`."""
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_norm(name):
                p.copy_(1.0 + norm_sd * torch.randn(p.shape, generator=g, device=device))
            elif name.endswith("bias"):
                p.copy_(bias_sd * torch.randn(p.shape, generator=g, device=device))
            else:
                fan_in = p[0].numel() if p.dim() > 1 else p.numel()
                p.copy_(torch.randn(p.shape, generator=g, device=device) * (scale / fan_in**0.5))


def make_tiny_hf(path, seed: int = 0, tie: bool = False, text=None, vision=None) -> str:
    """Save a random tiny Qwen2_5_VLForConditionalGeneration with O(1) logits to `path`.

    Weights are drawn with a larger scale than the default init, and norms/biases are randomised,
    so that layout or position mistakes change the logits far beyond the 1e-4 tolerance.
    """
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    cfg = Qwen2_5_VLConfig(text_config={**TINY_TEXT, **(text or {}), "tie_word_embeddings": tie},
                           vision_config={**TINY_VISION, **(vision or {})}, tie_word_embeddings=tie,
                           **TINY_TOKENS)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(cfg)
    randomise_o1(model, seed, lambda n: n.endswith("norm.weight") or "norm1" in n or "norm2" in n or "ln_q" in n
                 or "layernorm" in n)
    model.save_pretrained(str(path))
    return str(path)
