"""Videos of a family that writes one placeholder run per temporal patch (Qwen3-VL), as transformers 5.24's
Qwen3VLProcessor and Qwen3VLVideoProcessor make them: frames sampled, pixels, grids and the prompt text.

Legend: T frames, H x W pixels, p = patch size, m = spatial merge, tp = temporal patch.
What differs from Qwen2-VL's video processor (data/processor.py, envs/vision.py): frames are sampled at
round(linspace) indices, not floored to a multiple of tp (patchify repeats the last frame); the pixel budget
`size` {shortest_edge, longest_edge} bounds the whole sampled clip (T x H x W: `smart_resize` takes the frame
count); the config's image_mean / image_std (0.5 by default) normalise; and the processor writes each temporal
patch as `<t seconds><|vision_start|>` pads `<|vision_end|>` in place of the template's `<|video_pad|>` (the
template's own vision_start / vision_end stay around the runs). transformers' own functions do the sampling, the
resize arithmetic, the patch layout and the timestamps; the resize itself is PIL bicubic (as for Qwen2.5-VL,
because transformers' video resize needs torchvision) and the fused rescale + normalise is torchvision's
`normalize` written in torch.
"""
from __future__ import annotations

import re

import numpy as np
import torch
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize
from transformers.video_utils import VideoMetadata

from rollplex_megatron.envs.vision import resize_frames


class FrameRunVideos:
    """Qwen3VLVideoProcessor read from one config dict (`file` names it in errors), with the run's overrides.

    `min_pixels` / `max_pixels` (data.min_pixels / data.max_pixels) replace the config's `size` entries, as a
    `size` passed to the processor would: for this processor they bound the whole sampled clip. Frames are
    sampled at `fps` (data.video_fps), between `min_frames` and `max_frames`.
    """

    def __init__(self, file: str, cfg: dict, min_pixels: int | None, max_pixels: int | None, fps: float,
                 min_frames: int, max_frames: int):
        self.vp = vp = Qwen3VLVideoProcessor.from_dict(cfg)
        self.file, self.fps = file, fps
        vp.min_frames, vp.max_frames = min_frames, max_frames
        self.min_pixels = min_pixels or vp.size.shortest_edge
        self.max_pixels = max_pixels or vp.size.longest_edge
        self.patch_size, self.temporal_patch_size = vp.patch_size, vp.temporal_patch_size
        self.merge_size = vp.merge_size
        off = [k for k in ("do_resize", "do_rescale", "do_normalize") if getattr(vp, k) is not True]
        if off or int(vp.resample) != 3:
            what = f"{off[0]}=false" if off else f"resample={vp.resample}"
            raise ValueError(f"{file} sets {what}, but videos are resized (bicubic), rescaled and normalised as "
                             f"Qwen3VLVideoProcessor's defaults do; remove it from the file")

    def sample(self, total_frames: int, fps: float) -> torch.Tensor:
        """Indices of the frames kept from a clip of `total_frames` at `fps` (Qwen3VLVideoProcessor.sample_frames)."""
        picked = self.vp.sample_frames(VideoMetadata(total_num_frames=total_frames, fps=fps), fps=self.fps)
        if len(picked) < self.temporal_patch_size:  # transformers' smart_resize raises here
            raise ValueError(f"a video of {total_frames} frames keeps {len(picked)} after sampling, fewer than "
                             f"Qwen3-VL's temporal patch ({self.temporal_patch_size} frames); give it as an image, "
                             f"or raise data.min_frames")
        return torch.from_numpy(np.asarray(picked, dtype=np.int64))

    def size(self, frames: int, height: int, width: int) -> tuple[int, int]:
        """The resized (height, width) of `frames` sampled frames (Qwen3VLVideoProcessor.resize's arithmetic)."""
        factor, budget = self.patch_size * self.merge_size, self.max_pixels
        if self.vp.cap_pixels_per_frame:  # qwen-vl-utils' per-frame cap
            per_frame = max(min(self.vp.max_video_tokens * factor * factor, budget // frames),
                            int(self.min_pixels * 1.05))
            budget = per_frame * frames
        return smart_resize(frames, height, width, temporal_factor=self.temporal_patch_size, factor=factor,
                            min_pixels=self.min_pixels, max_pixels=budget)

    def grid(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        """The (t, h, w) patch grid of `frames` sampled frames of height x width."""
        h, w = self.size(frames, height, width)
        return -(-frames // self.temporal_patch_size), h // self.patch_size, w // self.patch_size

    def tokens(self, grid_thw: tuple[int, int, int]) -> list[int]:
        """LLM tokens of each of a video's runs: t runs of h*w // merge**2."""
        t, h, w = grid_thw
        return [h * w // self.merge_size**2] * t

    def patches(self, frames_TCHW_uint8: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """Sampled uint8 frames [T,3,H,W] -> (pixel rows [t*h*w, 3*tp*p*p], grid (t, h, w))."""
        t, _, height, width = frames_TCHW_uint8.shape
        h, w = self.size(t, height, width)
        x = resize_frames(frames_TCHW_uint8, h, w).to(torch.float32)
        vp = self.vp
        # rescale fused into normalise with the expressions of transformers' _fuse_mean_std_and_rescale_factor
        mean = torch.tensor(vp.image_mean) * (1.0 / vp.rescale_factor)
        std = torch.tensor(vp.image_std) * (1.0 / vp.rescale_factor)
        x = x.sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))
        rows, gt, gh, gw = vp.patchify(x[None], self.patch_size, self.merge_size, self.temporal_patch_size)
        return rows[0], (gt, gh, gw)

    def run_text(self, grid_thw: tuple[int, int, int], picked: torch.Tensor, fps: float, tokens: dict) -> str:
        """A video's prompt text: per run its timestamp, vision start, ONE pad and vision end (Qwen3VLProcessor.
        replace_video_token, with the pads of a run expanded later); `tokens` maps vision_start/video/vision_end."""
        # the method reads no state of its processor: called on the class
        stamps = Qwen3VLProcessor._calculate_timestamps(None, picked.tolist(), fps, self.temporal_patch_size)
        return "".join(f"<{s:.1f} seconds>{tokens['start']}{tokens['video']}{tokens['end']}"
                       for s in stamps[:grid_thw[0]])


def expand_video_text(text: str, pad: str, runs: list[str]) -> str:
    """`text` with its k-th `pad` replaced by runs[k] (the caller checked there are as many pads as runs)."""
    it = iter(runs)
    return re.sub(re.escape(pad), lambda _: next(it), text)
