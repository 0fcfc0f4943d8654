"""Analytic forward FLOPs of the Qwen2.5-VL vision tower (patch embed, window/full blocks, merger).

A multiply-add counts 2 FLOPs; attention counts QK^T and AV over the attended pairs only (verify/flops.py).
"""
from __future__ import annotations

import torch

from rollplex_megatron.config import ModelConfig
from rollplex_megatron.models.qwen25vl import positions as P


def vision_flops(cfg: ModelConfig, grids: torch.Tensor) -> float:
    """Forward FLOPs of the vision tower (patch embed, blocks, merger) on images/videos `grids`."""
    v = cfg.vision
    n = int(grids.prod(-1).sum())
    if n == 0:  # a text-only prompt
        return 0.0
    vh, vf = v.hidden_size, v.ffn_hidden_size
    patch = 2 * v.in_channels * v.temporal_patch_size * v.patch_size**2 * vh * n
    dense = (2 * vh * 3 * vh + 2 * vh * vh + 2 * 3 * vh * vf) * n * v.depth
    full_pairs = float((P.vision_cu_seqlens(grids).diff() ** 2).sum())
    _, cu_win = P.vision_window_order(grids, v.spatial_merge_size, v.window_size, v.patch_size)
    win_pairs = float((cu_win.diff() ** 2).sum())
    n_full = len(v.fullatt_block_indexes)
    attn = 4 * vh * (full_pairs * n_full + win_pairs * (v.depth - n_full))
    m = v.spatial_merge_size**2
    merger = (2 * (m * vh) ** 2 + 2 * m * vh * cfg.hidden_size) * (n // m)
    return patch + dense + attn + merger
