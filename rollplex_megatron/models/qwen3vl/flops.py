"""Analytic forward FLOPs of the Qwen3-VL vision tower (patch embed, full-attention blocks, merger and DeepStack
mergers). A multiply-add counts 2 FLOPs; attention counts QK^T and AV over the attended pairs only."""
from __future__ import annotations

import torch

from rollplex_megatron.config import ModelConfig
from rollplex_megatron.models.qwen25vl.positions import vision_cu_seqlens


def vision_flops(cfg: ModelConfig, grids: torch.Tensor) -> float:
    """Forward FLOPs of the vision tower on images/videos `grids` (the learned-position blend is left out)."""
    v = cfg.vision
    n = int(grids.prod(-1).sum())
    if n == 0:  # a text-only prompt
        return 0.0
    vh, vf = v.hidden_size, v.ffn_hidden_size
    patch = 2 * v.in_channels * v.temporal_patch_size * v.patch_size**2 * vh * n
    dense = (2 * vh * 3 * vh + 2 * vh * vh + 2 * 2 * vh * vf) * n * v.depth  # MLP not gated: fc1 and fc2
    attn = 4 * vh * float((vision_cu_seqlens(grids).diff() ** 2).sum()) * v.depth
    m = v.spatial_merge_size**2
    merger = (2 * (m * vh) ** 2 + 2 * m * vh * cfg.hidden_size) * (n // m)
    return patch + dense + attn + merger * (1 + len(v.deepstack_visual_indexes))
