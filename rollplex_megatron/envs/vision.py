"""Frames to Qwen2.5-VL pixel patches, laid out exactly as the Qwen2-VL image/video processor does.

Legend: T frames, C channels, H x W pixels, p = patch size, m = spatial merge, tp = temporal patch.
Output rows are patches in merge-block order ([t, h/m, w/m, m, m]); each row is [C, tp, p, p].
"""
from __future__ import annotations

import torch

# OpenAI CLIP statistics, the Qwen2-VL processor's defaults.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def normalize(frames_TCHW_uint8: torch.Tensor) -> torch.Tensor:
    """uint8 RGB -> float32 rescaled by 1/255 and normalised with the CLIP mean/std."""
    x = frames_TCHW_uint8.float() / 255.0
    mean = torch.tensor(CLIP_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CLIP_STD).view(1, 3, 1, 1)
    return (x - mean) / std


def patchify(frames_TCHW: torch.Tensor, patch: int = 14, merge: int = 2, temporal: int = 2):
    """[T,C,H,W] float -> (pixel rows [t*gh*gw, C*temporal*p*p], grid (t, gh, gw)).

    One frame (an image) is repeated `temporal` times, as the image processor does; a video needs
    a frame count divisible by `temporal`.
    """
    t_frames, c, h, w = frames_TCHW.shape
    if h % (patch * merge) or w % (patch * merge):
        raise ValueError(f"frame size {h}x{w} must be a multiple of patch*merge = {patch * merge}")
    x = frames_TCHW
    if t_frames == 1:
        x = x.expand(temporal, -1, -1, -1)
    elif t_frames % temporal:
        raise ValueError(f"{t_frames} frames is not a multiple of the temporal patch size {temporal}")
    gt, gh, gw = x.shape[0] // temporal, h // patch, w // patch
    x = x.reshape(gt, temporal, c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # [gt, gh/m, gw/m, m, m, C, tp, p, p]
    return x.reshape(gt * gh * gw, c * temporal * patch * patch).contiguous(), (gt, gh, gw)
