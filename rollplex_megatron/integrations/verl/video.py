"""A Qwen2-VL video processor that needs no torchvision, for `AutoProcessor` where torchvision has no wheel.

transformers' `Qwen2VLVideoProcessor` is built on its torchvision backend, so `AutoProcessor` cannot build a
Qwen2.5-VL processor on a CPU torch without torchvision, and verl (its dataset and agent loop) needs that
processor. `RollplexQwen2VLVideoProcessor` gives the same outputs (frames smart-resized by PIL, CLIP
normalisation, temporal padding and patch order of `envs.vision.video_patches`, the project's video path) and
is registered with `AutoVideoProcessor` by the verl plugin; a checkpoint selects it by naming it as
`video_processor_type` in its video_preprocessor_config.json.
"""
from __future__ import annotations

import numpy as np
import torch
from transformers import PretrainedConfig, processing_utils
from transformers.image_processing_utils import BatchFeature
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, PILImageResampling
# the module's class: `transformers.AutoVideoProcessor` is a stand-in that raises where torchvision is missing
from transformers.models.auto.video_processing_auto import AutoVideoProcessor
from transformers.video_processing_utils import VideoProcessorMixin
from transformers.video_utils import VideoMetadata, make_batched_metadata, make_batched_videos

from rollplex_megatron.data.example_files import VERL_VIDEO_PROCESSOR
from rollplex_megatron.data.processor import decode_video
from rollplex_megatron.envs.vision import CLIP_MEAN, CLIP_STD, sample_frame_indices, smart_resize, video_patches

NAME = VERL_VIDEO_PROCESSOR  # what a checkpoint's video_processor_type names (make-example --verl writes it)


class RollplexVideoConfig(PretrainedConfig):
    """Key of the `AutoVideoProcessor` registration (no model uses it; the class is found by its name)."""

    model_type = "rollplex_video"


class RollplexQwen2VLVideoProcessor(VideoProcessorMixin):
    """Qwen2VLVideoProcessor's `pixel_values_videos` and `video_grid_thw`, computed with PIL and torch."""

    resample = PILImageResampling.BICUBIC
    size = {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}
    image_mean, image_std = OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
    do_resize = do_rescale = do_normalize = do_convert_rgb = True
    patch_size, temporal_patch_size, merge_size = 14, 2, 2
    fps, min_frames, max_frames = 2.0, 4, 768
    do_sample_frames = False
    model_input_names = ["pixel_values_videos", "video_grid_thw"]

    def __init__(self, **kwargs):
        size = dict(kwargs.pop("size", None) or self.size)
        # as Qwen2VLVideoProcessor: min_pixels / max_pixels in a config override `size`
        if kwargs.get("min_pixels") is not None:
            size["shortest_edge"] = kwargs.pop("min_pixels")
        if kwargs.get("max_pixels") is not None:
            size["longest_edge"] = kwargs.pop("max_pixels")
        super().__init__(**kwargs)
        self.size = size
        self._check_fixed()

    def _check_fixed(self) -> None:
        # video_patches always resizes, rescales and normalises with CLIP's mean/std: refuse other settings
        fixed = {"do_resize": True, "do_rescale": True, "do_normalize": True}
        bad = {k: getattr(self, k) for k, v in fixed.items() if getattr(self, k) is not v}
        if not np.allclose(self.image_mean, CLIP_MEAN) or not np.allclose(self.image_std, CLIP_STD):
            bad["image_mean/image_std"] = (self.image_mean, self.image_std)
        if bad:
            raise ValueError(f"{NAME} computes only Qwen2-VL's defaults, but its config sets {bad}; remove those "
                             f"fields from video_preprocessor_config.json or use transformers' Qwen2VLVideoProcessor")

    def preprocess(self, videos, video_metadata=None, do_sample_frames: bool | None = None,
                   return_metadata: bool = False, return_tensors=None, **kwargs) -> BatchFeature:
        """Videos (frame arrays [T,H,W,C] / [T,C,H,W], frame lists or files) -> pixel rows and (t, h, w) grids."""
        fps = kwargs.pop("fps", None) or self.fps
        sample = self.do_sample_frames if do_sample_frames is None else do_sample_frames
        videos, metas = self._frames_and_metadata(videos, video_metadata)
        rows, grids = [], []
        for i, (frames, meta) in enumerate(zip(videos, metas)):
            if sample:
                if meta.fps is None:  # transformers refuses this too (Qwen2VLVideoProcessor.sample_frames)
                    raise ValueError(f"video {i} has no fps to sample frames at {fps} fps; pass video_metadata "
                                     f"with its fps, or do_sample_frames=False")
                picked, _ = sample_frame_indices(len(frames), meta.fps, fps, self.min_frames, self.max_frames,
                                                 self.temporal_patch_size)
                frames, meta.frames_indices = frames[picked], picked
            r, grid = video_patches(frames, self.patch_size, self.merge_size, self.temporal_patch_size,
                                    self.size["shortest_edge"], self.size["longest_edge"])
            rows.append(r)
            grids.append(list(grid))
        out = BatchFeature({"pixel_values_videos": torch.cat(rows), "video_grid_thw": torch.tensor(grids)},
                           tensor_type=return_tensors)
        if return_metadata:
            out["video_metadata"] = metas
        return out

    def _frames_and_metadata(self, videos, video_metadata) -> tuple[list[torch.Tensor], list[VideoMetadata]]:
        # a file is decoded with PyAV (as the project's processor does); arrays become uint8 [T,3,H,W]
        if isinstance(videos, str) or (isinstance(videos, (list, tuple)) and videos
                                       and all(isinstance(v, str) for v in videos)):
            decoded = [decode_video(p) for p in ([videos] if isinstance(videos, str) else videos)]
            frames = [f for f, _ in decoded]
            metas = [VideoMetadata(total_num_frames=len(f), fps=r, height=f.shape[2], width=f.shape[3])
                     for f, r in decoded]
            return frames, metas
        frames = [to_uint8_tchw(v) for v in make_batched_videos(videos)]
        metas = make_batched_metadata(frames, video_metadata=video_metadata)
        return frames, metas

    def get_num_of_video_patches(self, num_frames: int, height: int, width: int, videos_kwargs=None) -> int:
        """Number of pixel rows for a video of this size (Qwen2VLVideoProcessor.get_num_of_video_patches)."""
        factor = self.patch_size * self.merge_size
        h, w = smart_resize(height, width, factor, self.size["shortest_edge"], self.size["longest_edge"])
        t = -(-num_frames // self.temporal_patch_size)
        return t * (h // self.patch_size) * (w // self.patch_size)


def to_uint8_tchw(video) -> torch.Tensor:
    """One video as uint8 [T,3,H,W]: channel-last arrays are moved, float frames (0..255) rounded."""
    x = torch.as_tensor(np.asarray(video)) if not isinstance(video, torch.Tensor) else video
    if x.dim() != 4:
        raise ValueError(f"{NAME} takes a video as a [T,H,W,C] or [T,C,H,W] array, got shape {tuple(x.shape)}")
    if x.shape[1] not in (1, 3) and x.shape[-1] in (1, 3):
        x = x.permute(0, 3, 1, 2)
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    if x.dtype != torch.uint8:
        x = x.float().round().clamp(0, 255).to(torch.uint8)
    return x.contiguous()


def register() -> None:
    """Let `AutoVideoProcessor` (and so `AutoProcessor`) build `RollplexQwen2VLVideoProcessor` by its name."""
    # Without torchvision, transformers leaves `VideoProcessorMixin` out of its namespace, and ProcessorMixin's
    # type check of a `video_processor` (check_argument_for_proper_class) then finds no class and fails for
    # every video processor; exporting the class it defines restores that check, nothing else.
    namespace = processing_utils.transformers_module  # the module object that check reads
    if not hasattr(namespace, "VideoProcessorMixin"):
        namespace.VideoProcessorMixin = VideoProcessorMixin
    classes = {"torchvision": RollplexQwen2VLVideoProcessor}  # the backend AutoProcessor asks for
    AutoVideoProcessor.register(RollplexVideoConfig, video_processor_classes=classes, exist_ok=True)
