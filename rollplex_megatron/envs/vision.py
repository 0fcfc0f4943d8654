"""Frames to Qwen2.5-VL pixel patches, laid out exactly as the Qwen2-VL image/video processor does.

Legend: T frames, C channels, H x W pixels, p = patch size, m = spatial merge, tp = temporal patch.
Output rows are patches in merge-block order ([t, h/m, w/m, m, m]); each row is [C, tp, p, p].
"""
from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image

# OpenAI CLIP statistics, the Qwen2-VL processor's defaults.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# Qwen2VLImageProcessorPil.resample; a module constant so a test can swap it (mutation check).
RESAMPLE = Image.Resampling.BICUBIC


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


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 14 * 14 * 4 * 1280) -> tuple[int, int]:
    """Qwen2-VL's target size: multiples of `factor`, pixel count in [min_pixels, max_pixels], aspect kept."""
    aspect = max(height, width) / min(height, width)
    if aspect > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {aspect}")
    # The float expressions below keep transformers' operation order so that every size rounds alike.
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        scale = math.sqrt((height * width) / max_pixels)
        return (max(factor, math.floor(height / scale / factor) * factor),
                max(factor, math.floor(width / scale / factor) * factor))
    if h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        return math.ceil(height * scale / factor) * factor, math.ceil(width * scale / factor) * factor
    return h, w


def sample_frame_indices(total_frames: int, video_fps: float, target_fps: float = 2.0, min_frames: int = 4,
                         max_frames: int = 768, temporal: int = 2) -> tuple[torch.Tensor, float]:
    """Frames to keep from a `video_fps` clip to sample it at `target_fps` -> (indices [n] long, sampled fps).

    The count is total/video_fps*target_fps clamped to [min_frames, min(max_frames, total)] and floored
    to a multiple of `temporal`, as Qwen2VLVideoProcessor.sample_frames does; the sampled fps is
    VideoMetadata.sampled_fps (kept/total*video_fps), which Qwen2.5-VL turns into second_per_grid_ts.
    """
    cap = math.floor(min(max_frames, total_frames) / temporal) * temporal
    count = min(max(total_frames / video_fps * target_fps, min_frames), cap, total_frames)
    count = math.floor(count / temporal) * temporal
    if count == 0:
        # transformers divides by zero here (video_processing_qwen2_vl.py, sample_frames).
        raise ValueError(f"sampling {total_frames} frames at {video_fps} fps down to {target_fps} fps keeps fewer "
                         f"than temporal_patch_size ({temporal}) frames; raise min_frames or max_frames")
    # float32 arange then truncation, exactly as transformers computes it, so the same frames are picked.
    picked = torch.arange(0, total_frames, total_frames / count, dtype=torch.float32).long()
    return picked, len(picked) / total_frames * video_fps


def resize_frames(frames_TCHW_uint8: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 [T,C,H,W] -> uint8 [T,C,height,width], each frame resized by PIL as Qwen2VLImageProcessorPil does."""
    out = []
    for frame in frames_TCHW_uint8:
        # transformers hands PIL an HWC uint8 image (no rescale, reducing_gap None): image_transforms.resize.
        img = Image.fromarray(frame.permute(1, 2, 0).contiguous().numpy())
        resized = np.asarray(img.resize((width, height), resample=RESAMPLE))
        out.append(torch.from_numpy(resized.copy()).permute(2, 0, 1))
    return torch.stack(out).contiguous()


def video_patches(frames_TCHW_uint8: torch.Tensor, patch: int = 14, merge: int = 2, temporal: int = 2,
                  min_pixels: int = 128 * 28 * 28, max_pixels: int = 768 * 28 * 28):
    """uint8 [T,3,H,W] -> (pixel rows [t*gh*gw, 3*temporal*p*p], grid (t, gh, gw)), as the Qwen2-VL processors do.

    Frames are smart-resized, resized with PIL bicubic, normalised and padded with the last frame to a
    multiple of `temporal` (Qwen2VLVideoProcessor.patchify pads the same way).
    """
    _, _, height, width = frames_TCHW_uint8.shape
    h, w = smart_resize(height, width, patch * merge, min_pixels, max_pixels)
    x = normalize(resize_frames(frames_TCHW_uint8, h, w))
    pad = -x.shape[0] % temporal
    if pad:
        x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
    return patchify(x, patch, merge, temporal)
