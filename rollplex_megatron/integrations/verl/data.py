"""verl's reward hook and dataset class for this project's datasets (`make-example`'s format is verl's).

`compute_score` (`reward.custom_reward_function.path=pkg://rollplex_megatron.integrations.verl.data`): verl's
reward-function signature over this project's built-in rewards (`data/rewards.py`), chosen by the row's
`data_source`.

`RollplexRLHFDataset` (`data.custom_cls.path=pkg://rollplex_megatron.integrations.verl.data
data.custom_cls.name=RollplexRLHFDataset`): verl's `RLHFDataset`, whose agent loop reads a row's images with
`qwen_vl_utils.process_vision_info`; qwen_vl_utils imports torchvision at module level, which has no wheel for a
CPU torch. This class reads images by the same rule (qwen-vl-utils 0.0.14 `fetch_image`) with PIL alone.
"""
from __future__ import annotations

import math
import os

from PIL import Image
from verl.utils.dataset.rl_dataset import RLHFDataset

from rollplex_megatron.data.rewards import BUILTINS

# qwen-vl-utils 0.0.14 (vision_process.py): the merge size and the default token limits of an image
MERGE, MIN_TOKENS, MAX_TOKENS, MAX_RATIO = 2, 4, 16384, 200


def compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None, **kwargs) -> dict:
    """verl's reward function: the built-in reward named by `data_source` (its `score` is verl's reward)."""
    fn = BUILTINS.get(data_source)
    if fn is None:
        raise ValueError(f"rollplex reward: data_source {data_source!r} names no built-in reward (one of "
                         f"{', '.join(sorted(BUILTINS))})")
    return fn(solution_str, ground_truth, dict(extra_info or {}))


def resized_size(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(h, w): qwen-vl-utils' `smart_resize` (multiples of `factor`, pixels within the limits, aspect kept)."""
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise ValueError(f"absolute aspect ratio must be smaller than {MAX_RATIO}, got "
                         f"{max(height, width) / min(height, width)}")
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        return math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
    if h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        return math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def fetch_image(item: dict, patch_size: int) -> Image.Image:
    """One message item's image as qwen-vl-utils' `fetch_image` returns it: RGB, resized to the model's grid."""
    image = item["image"] if "image" in item else item["image_url"]
    if isinstance(image, (str, os.PathLike)):
        path = os.fspath(image)
        if path.startswith(("http://", "https://", "data:")):
            raise ValueError(f"RollplexRLHFDataset reads image files and bytes, not {path[:40]}...; store the image")
        image = Image.open(path.removeprefix("file://"))
    if image.mode == "RGBA":  # onto white, as qwen-vl-utils' to_rgb
        rgb = Image.new("RGB", image.size, (255, 255, 255))
        rgb.paste(image, mask=image.split()[3])
        image = rgb
    else:
        image = image.convert("RGB")
    factor = patch_size * MERGE
    if "resized_height" in item and "resized_width" in item:
        h, w = resized_size(item["resized_height"], item["resized_width"], factor, MIN_TOKENS * factor ** 2,
                            MAX_TOKENS * factor ** 2)
    else:
        h, w = resized_size(image.height, image.width, factor, item.get("min_pixels", MIN_TOKENS * factor ** 2),
                            item.get("max_pixels", MAX_TOKENS * factor ** 2))
    return image.resize((w, h))


class RollplexRLHFDataset(RLHFDataset):
    """verl's RLHFDataset whose images are read without qwen_vl_utils (so without torchvision)."""

    @classmethod
    def _process_multi_modal_info(cls, messages: list[dict], image_patch_size, config):
        items = [i for m in messages if isinstance(m.get("content"), list) for i in m["content"]
                 if isinstance(i, dict) and ("image" in i or "image_url" in i or "video" in i
                                             or i.get("type") in ("image", "image_url", "video"))]
        if any("video" in i or i.get("type") == "video" for i in items):
            raise ValueError("RollplexRLHFDataset reads images only; rows with videos need verl's RLHFDataset "
                             "(qwen_vl_utils, torchvision) or the project's own `train`")
        images = [fetch_image(i, image_patch_size) for i in items] or None
        return images, None, cls._extract_audio_info(messages)
