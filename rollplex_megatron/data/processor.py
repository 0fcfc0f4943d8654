"""Chat messages with images and videos -> a `Prompt`, as Qwen2_5_VLProcessor (or Qwen3VLProcessor) builds it.

Legend: T frames, H x W pixels, p = patch size, m = spatial merge, tp = temporal patch.
A processor directory is what a checkpoint ships next to config.json: tokenizer files and chat
template, preprocessor_config.json (images, through transformers' PIL image processor) and
video_preprocessor_config.json (videos, through `envs.vision.video_patches`, because transformers'
video processor needs torchvision; a family with one placeholder run per temporal patch, Qwen3-VL, through
`data.frame_runs`, which also writes each run's timestamp text). Messages come in verl's RL form: string
contents whose text holds `<image>` / `<video>` placeholders, or content lists as the chat template takes them.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import AutoTokenizer

from rollplex_megatron.config import ModelConfig
from rollplex_megatron.envs.vision import CLIP_MEAN, CLIP_STD, sample_frame_indices, smart_resize, video_patches
from rollplex_megatron.checkpoint.files import atomic_write_text, read_json
from rollplex_megatron.data.frame_runs import FrameRunVideos, expand_video_text
from rollplex_megatron.models.registry import model_spec
from rollplex_megatron.prefix.batch import Prompt

try:  # video files only (pinned in constraints.txt); frame lists, images and the package itself need no PyAV
    import av
except ImportError:
    av = None

PLACEHOLDER = re.compile(r"(<image>|<video>)")  # verl writes these into message text
IM_END = "<|im_end|>"
# The special tokens (token -> ModelConfig field), the video processor's defaults and the image processor class
# come from the model family (models/registry.py: `model_spec(model).processor`).


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")  # any one: AutoTokenizer can load


@dataclass(frozen=True)
class PixelSettings:
    """Resize limits and patch shape read from one processor config file (`file` names it in errors)."""

    file: str  # the config file these came from
    min_pixels: int  # smallest resized frame area
    max_pixels: int  # largest resized frame area
    patch_size: int  # spatial patch in pixels
    temporal_patch_size: int  # frames per temporal patch
    merge_size: int  # spatial merge of the vision merger

    def tokens(self, grid_thw: tuple[int, int, int]) -> int:
        """LLM tokens of one image/video grid: t*h*w // merge**2 (Qwen2_5_VLProcessor.replace_image_token)."""
        return math.prod(grid_thw) // self.merge_size**2

    def grid(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        """The (t, h, w) patch grid of `frames` frames of height x width after smart resize and padding."""
        h, w = smart_resize(height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)
        return -(-frames // self.temporal_patch_size), h // self.patch_size, w // self.patch_size


def read_video_config(path: str) -> tuple[str, dict]:
    """(file, dict) of the video processor config, in transformers' order of precedence.

    processor_config.json's nested "video_processor", then video_preprocessor_config.json, then
    preprocessor_config.json (transformers/video_processing_utils.py, get_video_processor_dict).
    """
    nested = os.path.join(path, "processor_config.json")
    if os.path.isfile(nested):
        cfg = read_json(nested)
        if "video_processor" in cfg:
            return nested, cfg["video_processor"]
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            return file, read_json(file)
    raise FileNotFoundError(f"{path} has no video_preprocessor_config.json or preprocessor_config.json "
                            f"(the Qwen2.5-VL processor configs shipped with the checkpoint)")


def video_settings(file: str, cfg: dict, min_pixels: int | None, max_pixels: int | None,
                   defaults: dict) -> PixelSettings:
    """Video PixelSettings from a config dict: `size` {shortest_edge, longest_edge}, each overridden by the file's
    min_pixels / max_pixels where set (as transformers' Qwen2VLVideoProcessor reads its config), then by the
    arguments (`data.min_pixels` / `data.max_pixels`); `defaults` (the family's) fill what the file leaves out."""
    size = cfg.get("size") or {}
    lo = cfg.get("min_pixels") if cfg.get("min_pixels") is not None else \
        size.get("shortest_edge", defaults["min_pixels"])
    hi = cfg.get("max_pixels") if cfg.get("max_pixels") is not None else \
        size.get("longest_edge", defaults["max_pixels"])
    for field, want in (("image_mean", CLIP_MEAN), ("image_std", CLIP_STD)):
        got = cfg.get(field, want)
        if not np.allclose(got, want, atol=1e-6):
            raise ValueError(f"{file} has {field} {got}, but videos are normalised with CLIP's {list(want)}")
    return PixelSettings(file, min_pixels or lo, max_pixels or hi,
                         *(cfg.get(k, defaults[k]) for k in ("patch_size", "temporal_patch_size", "merge_size")))


def check_settings(s: PixelSettings, model: ModelConfig, min_pixels: int | None = None,
                   max_pixels: int | None = None) -> None:
    """The config file's patch, temporal patch and merge sizes equal the model's vision tower's; the pixel range
    (the file's, or `data.min_pixels` / `data.max_pixels` where given) is not empty."""
    v = model.vision
    for field, got, want, name in (("patch_size", s.patch_size, v.patch_size, "patch_size"),
                                   ("temporal_patch_size", s.temporal_patch_size, v.temporal_patch_size,
                                    "temporal_patch_size"),
                                   ("merge_size", s.merge_size, v.spatial_merge_size, "spatial_merge_size")):
        if got != want:
            raise ValueError(f"{s.file} has {field} {got} but model.vision.{name} is {want}")
    if not 0 < s.min_pixels <= s.max_pixels:
        if not (min_pixels or max_pixels):
            raise ValueError(f"{s.file}: min_pixels ({s.min_pixels}) must be positive and at most max_pixels "
                             f"({s.max_pixels})")
        lo = f"data.min_pixels={min_pixels}" if min_pixels else f"min_pixels {s.min_pixels} (from {s.file})"
        hi = f"data.max_pixels={max_pixels}" if max_pixels else f"max_pixels {s.max_pixels} (from {s.file})"
        raise ValueError(f"{lo} is above {hi}: no image size fits; set data.min_pixels and data.max_pixels so "
                         f"that min <= max")


def check_tokenizer(tokenizer, path: str, model: ModelConfig) -> None:
    """The tokenizer's ids of the vision special tokens equal the model config's."""
    vocab = tokenizer.get_vocab()
    for token, field in model_spec(model).processor.special_tokens.items():
        want = getattr(model, field)
        if token not in vocab:
            raise ValueError(f"tokenizer in {path} has no {token} token but config.json's {field} is {want}")
        if vocab[token] != want:
            raise ValueError(f"tokenizer in {path} maps {token} to {vocab[token]} but config.json's {field} is {want}")


def chat_template(tokenizer, path: str) -> str:
    """The tokenizer's chat template, else the processor's chat_template.json (older Qwen2.5-VL releases)."""
    if tokenizer.chat_template:
        return tokenizer.chat_template
    file = os.path.join(path, "chat_template.json")
    if os.path.isfile(file):
        return read_json(file)["chat_template"]
    raise FileNotFoundError(f"{path} has no chat template (chat_template.jinja, tokenizer_config.json's "
                            f"chat_template, or chat_template.json)")


def to_content(messages: list[dict]) -> tuple[list[dict], int, int]:
    """verl messages -> (chat-template messages with content lists, number of images, number of videos).

    String contents are split at `<image>` / `<video>` (empty pieces dropped, as verl's RLHFDataset
    does); content lists are kept as they are.
    """
    out, n_img, n_vid = [], 0, 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            content = [{"type": "image"} if s == "<image>" else {"type": "video"} if s == "<video>"
                       else {"type": "text", "text": s} for s in PLACEHOLDER.split(content) if s]
        elif not isinstance(content, list):
            raise ValueError(f"a {m.get('role')!r} message's content must be a string or a list, "
                             f"got {type(content).__name__}")
        n_img += sum(c.get("type") == "image" or "image" in c for c in content)
        n_vid += sum(c.get("type") == "video" or "video" in c for c in content)
        out.append({**m, "content": content})
    return out, n_img, n_vid


_NOTED: set[str] = set()  # (file, note) pairs already printed: a row's image is read at the check and every step


def note_once(name: str, text: str) -> None:
    """Print `note: image NAME TEXT` on stderr, once per image and note in this process."""
    if (name, text) not in _NOTED:
        _NOTED.add((name, text))
        print(f"note: image {name} {text}", file=sys.stderr)


def to_8bit(img: Image.Image, name: str) -> Image.Image:
    """A greyscale image wider than 8 bits (PIL modes I;16*, I, F) as mode L, scaled by its bit depth.

    PIL's convert("RGB") clips these at 255, so a 16-bit picture turns white: 16-bit modes (and mode I,
    how 16-bit PNGs and TIFFs also open, with values in 0..65535) scale by 255/65535, floats in [0, 1] by
    255. Values in 0..255 are kept. Any other range has no known depth: refused, naming the file."""
    a = np.asarray(img).astype(np.float64)
    lo, hi = (float(a.min()), float(a.max())) if a.size else (0.0, 0.0)
    depth = "16-bit" if img.mode.startswith("I;16") else "32-bit integer" if img.mode == "I" else "32-bit float"
    if not np.isfinite(a).all() or lo < 0:
        scale = None
    elif img.mode == "F" and hi <= 1:
        scale = 255.0
    elif img.mode.startswith("I;16") or (img.mode == "I" and hi > 255 and hi <= 65535):
        scale = 255 / 65535
    else:
        scale = 1.0 if hi <= 255 else None
    if scale is None:
        raise ValueError(f"image {name} is {depth} greyscale (PIL mode {img.mode}) with values {lo:g}..{hi:g}, "
                         f"which have no known bit depth; save it as an 8-bit or 16-bit image")
    if scale != 1.0:
        note_once(name, f"is {depth} greyscale (PIL mode {img.mode}): scaled to 8 bits (x {scale:.6g})")
    return Image.fromarray(np.clip(np.rint(a * scale), 0, 255).astype(np.uint8), "L")


def to_rgb(img: Image.Image, name: str = "<image>") -> Image.Image:
    """RGB, compositing transparency onto white as transformers' convert_to_rgb does (image_transforms.py);
    greyscale wider than 8 bits scaled by `to_8bit` first (`name`: the file a note or an error names)."""
    if img.mode in ("I", "F") or img.mode.startswith("I;16"):
        img = to_8bit(img, name)
    if img.has_transparency_data:
        rgba = img.convert("RGBA")
        if rgba.getchannel("A").getextrema()[1] == 0:  # what the model sees is a blank white picture
            note_once(name, "is fully transparent: it reads as a blank white picture")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return img.convert("RGB")


def open_image(source, name: str) -> Image.Image:
    """An RGB image from a path or a file-like object (unreadable -> ValueError naming `name`)."""
    try:
        img = Image.open(source)
        img.load()
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise ValueError(f"cannot read image {name}: {e}") from None
    with img:  # read: a refusal of its values names the file itself
        return to_rgb(img, name)


def read_video(path: str, visit) -> float:
    """Decode every frame of a video file, calling `visit(av.VideoFrame)` on each; returns the stream's average fps.

    A missing file is a FileNotFoundError and an unreadable one a ValueError, both naming the path.
    """
    if os.path.isdir(path):
        raise ValueError(f"video {path} is a folder, not a file; name a video file, or list its frames "
                         f"([frame0.png, frame1.png, ...])")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"video file {path} does not exist")
    if av is None:
        raise ValueError(f"reading the video file {path} needs PyAV: pip install av (or give its frames as a list)")
    count = 0
    try:
        with av.open(path) as container:
            if not container.streams.video:
                raise ValueError("it has no video stream")
            stream = container.streams.video[0]
            for frame in container.decode(stream):
                visit(frame)
                count += 1
            rate = stream.average_rate
    except (av.FFmpegError, ValueError, OSError) as e:
        raise ValueError(f"cannot read video {path}: {e}") from None
    if not count or not rate:
        raise ValueError(f"cannot read video {path}: no frames or no frame rate")
    return float(rate)


def decode_video(path: str) -> tuple[torch.Tensor, float]:
    """Every frame of a video file as uint8 RGB [T,3,H,W], with the stream's average fps (PyAV)."""
    frames = []
    fps = read_video(path, lambda f: frames.append(torch.from_numpy(f.to_ndarray(format="rgb24"))))
    return torch.stack(frames).permute(0, 3, 1, 2).contiguous(), fps


def probe_cache_dir() -> Path | None:
    """Where `probe_video` keeps what it measured: $ROLLPLEX_CACHE_DIR/video_probe, else
    $XDG_CACHE_HOME/rollplex/video_probe (~/.cache by default); ROLLPLEX_CACHE_DIR=off keeps nothing."""
    root = os.environ.get("ROLLPLEX_CACHE_DIR")
    if root == "off":
        return None
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rollplex")
    return Path(root) / "video_probe"


def probe_video(path: str) -> tuple[int, int, int, float]:
    """(frames, height, width, fps) of a video file, decoding every frame but keeping none.

    The frame count is exact only by decoding (container metadata can be wrong), and a dataset's start-up
    probes every file in the launcher and again in every rank. So the result is kept on disk under the file's
    resolved path, size and modification time (`probe_cache_dir`): a changed file is decoded again. An
    unwritable cache only costs the decode."""
    st = os.stat(path) if os.path.isfile(path) else None
    where = probe_cache_dir()
    entry = None
    if st is not None and where is not None:
        key = f"{os.path.realpath(path)}\0{st.st_size}\0{st.st_mtime_ns}"
        entry = where / f"{hashlib.sha256(key.encode()).hexdigest()}.json"
        try:
            got = json.loads(entry.read_text(encoding="utf-8"))
            if got.get("key") == key:
                return int(got["frames"]), int(got["height"]), int(got["width"]), float(got["fps"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # absent or unreadable: decode
    shapes = []
    fps = read_video(path, lambda f: shapes.append((f.height, f.width)))
    out = (len(shapes), *shapes[-1], fps)
    if entry is not None:
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(entry, json.dumps({"key": key, "frames": out[0], "height": out[1], "width": out[2],
                                                 "fps": out[3]}))
        except OSError:
            pass
    return out


def expand_pads(ids: torch.Tensor, pad_ids: tuple[int, int], counts: tuple[list[int], list[int]]) -> torch.Tensor:
    """Repeat the k-th image (video) pad token counts[0][k] (counts[1][k]) times, in order."""
    repeats = torch.ones_like(ids)
    for pad, n in zip(pad_ids, counts):
        where = (ids == pad).nonzero().flatten()
        repeats[where] = torch.tensor(n, dtype=ids.dtype)
    return torch.repeat_interleave(ids, repeats)


def generation_eos(path: str) -> list[int]:
    """`eos_token_id` of the checkpoint's generation_config.json (an id or a list; none without the file)."""
    f = os.path.join(path, "generation_config.json")
    if not os.path.isfile(f):
        return []
    with open(f, encoding="utf-8") as fh:
        try:
            eos = json.load(fh).get("eos_token_id")
        except (json.JSONDecodeError, AttributeError) as e:
            raise ValueError(f"{f} is not a JSON object ({e}); fix or remove it") from None
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{f}: eos_token_id {eos!r} is not a token id or a list of them")
    return ids


class VLProcessor:
    """A checkpoint's tokenizer, chat template and processor configs, checked against the model config.

    `min_pixels` / `max_pixels` override both config files' limits (None: each file's own); videos
    are sampled at `video_fps`, between `min_frames` and `max_frames` frames.
    """

    def __init__(self, path: str, model: ModelConfig, *, min_pixels: int | None = None,
                 max_pixels: int | None = None, video_fps: float = 2.0, max_frames: int = 768,
                 min_frames: int = 4):
        if os.path.isfile(path):
            raise ValueError(f"processor directory {path} is a file; name the folder that holds it (the model's "
                             f"tokenizer and preprocessor configs)")
        if not os.path.isdir(path):
            raise FileNotFoundError(f"processor directory {path} does not exist")
        if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
            raise ValueError(f"processor directory {path} has no tokenizer ({' or '.join(TOKENIZER_FILES)}); name a "
                             f"Qwen2.5-VL model folder with its tokenizer and preprocessor files")
        self.path, self.model, self.settings = path, model, model_spec(model).processor
        self.video_fps, self.max_frames, self.min_frames = video_fps, max_frames, min_frames
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.chat_template = chat_template(self.tokenizer, path)
        check_tokenizer(self.tokenizer, path, model)
        self.image_processor = ip = self._image_processor()
        self.image = PixelSettings(os.path.join(path, "preprocessor_config.json"), min_pixels or ip.size.shortest_edge,
                                   max_pixels or ip.size.longest_edge, ip.patch_size, ip.temporal_patch_size,
                                   ip.merge_size)
        # Qwen3-VL: its own video processor's rules and one timestamped placeholder run per temporal patch
        self.frame_runs = self.settings.video_run_per_frame
        self.video = FrameRunVideos(*read_video_config(path), min_pixels, max_pixels, video_fps, min_frames,
                                    max_frames) if self.frame_runs else \
            video_settings(*read_video_config(path), min_pixels, max_pixels, self.settings.video_defaults)
        check_settings(self.image, model, min_pixels, max_pixels)
        check_settings(self.video, model, min_pixels, max_pixels)
        vocab = self.tokenizer.get_vocab()
        # what ends transformers' `generate`: the checkpoint's generation config (Qwen2.5-VL-Instruct lists
        # <|im_end|> and <|endoftext|>), the tokenizer's EOS and the chat turn's end
        stops = [*generation_eos(path), self.tokenizer.eos_token_id, vocab.get(IM_END)]
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in stops if i is not None))

    def _image_processor(self):
        names = ("preprocessor_config.json", "processor_config.json")
        if not any(os.path.isfile(os.path.join(self.path, n)) for n in names):
            raise FileNotFoundError(f"{self.path} has no preprocessor_config.json (the Qwen2.5-VL image "
                                    f"processor config shipped with the checkpoint)")
        return self.settings.image_processor.from_pretrained(self.path)

    def load_image(self, item) -> Image.Image:
        """An RGB PIL image from a path, bytes, {"bytes", "path"} (verl / HF datasets), {"image": x} or a PIL image."""
        if isinstance(item, Image.Image):
            return to_rgb(item)
        if isinstance(item, dict):
            if item.get("bytes") is not None:
                return open_image(io.BytesIO(item["bytes"]), item.get("path") or "<bytes>")
            if item.get("path") is not None:
                return self.load_image(item["path"])
            if "image" in item:
                return self.load_image(item["image"])
            raise ValueError(f"an image item needs 'bytes', 'path' or 'image', got keys {sorted(item)}")
        if isinstance(item, (bytes, bytearray)):
            return open_image(io.BytesIO(item), "<bytes>")
        if isinstance(item, torch.Tensor) and item.dim() == 3 and item.dtype == torch.uint8:
            return Image.fromarray(item.permute(1, 2, 0).contiguous().numpy())  # one [3,H,W] frame
        if isinstance(item, (str, os.PathLike)):
            path = os.fspath(item).removeprefix("file://")
            if os.path.isdir(path):
                raise ValueError(f"image {path} is a folder, not a file; name an image file in it")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"image file {path} does not exist")
            return open_image(path, path)
        raise ValueError(f"unsupported image item of type {type(item).__name__}")

    def load_video(self, item) -> tuple[torch.Tensor, float]:
        """(uint8 frames [T,3,H,W], fps they were taken at) of a frame list, {"video": x, "fps": f} or a file.

        A frame list counts as a clip already sampled at `video_fps`, so `sample` keeps it whole up to
        `max_frames` (floored to a multiple of the temporal patch, as for a file); a file gives every
        decoded frame and its stream's average fps.
        """
        if isinstance(item, dict) and "video" in item:
            frames, fps = self.load_video(item["video"])
            return frames, float(item.get("fps") or fps)
        if isinstance(item, torch.Tensor) and item.dim() == 4 and item.dtype == torch.uint8:
            return item, self.video_fps
        if isinstance(item, (list, tuple)):
            if not item:
                raise ValueError("a video frame list is empty")
            frames = [torch.from_numpy(np.array(self.load_image(f))).permute(2, 0, 1) for f in item]
            sizes = sorted({tuple(f.shape[1:]) for f in frames})
            if len(sizes) > 1:
                raise ValueError(f"a video's frames must share one size, got {sizes}")
            return torch.stack(frames), self.video_fps
        if isinstance(item, (str, os.PathLike)):
            return decode_video(os.fspath(item).removeprefix("file://"))
        raise ValueError(f"unsupported video item of type {type(item).__name__}")

    def video_shape(self, item) -> tuple[int, int, int, float]:
        """(T, H, W, fps) of a video item as `load_video` gives it, keeping no decoded frames of a file."""
        if isinstance(item, dict) and "video" in item and isinstance(item["video"], (str, os.PathLike)):
            t, h, w, fps = self.video_shape(item["video"])
            return t, h, w, float(item.get("fps") or fps)
        if isinstance(item, (str, os.PathLike)):
            return probe_video(os.fspath(item).removeprefix("file://"))
        frames, fps = self.load_video(item)
        return frames.shape[0], frames.shape[2], frames.shape[3], fps

    def sample(self, total_frames: int, fps: float) -> tuple[torch.Tensor, float]:
        """(frame indices, sampled fps) of a clip of `total_frames` at `fps`, sampled at `video_fps`.

        A clip shorter than one temporal patch keeps every frame (transformers would divide by zero); a Qwen3-VL
        clip follows Qwen3VLVideoProcessor.sample_frames (`data.frame_runs`).
        """
        if self.frame_runs:
            picked = self.video.sample(total_frames, fps)
            return picked, len(picked) / total_frames * fps  # VideoMetadata.sampled_fps
        tp = self.video.temporal_patch_size
        if total_frames < tp:
            return torch.arange(total_frames), fps
        return sample_frame_indices(total_frames, fps, self.video_fps, self.min_frames, self.max_frames, tp)

    def _conversation(self, messages: list[dict], n_images: int, n_videos: int) -> list[dict]:
        """Chat-template messages, their `<image>` / `<video>` placeholders checked against the counts given."""
        conv, n_img, n_vid = to_content(messages)
        for kind, placed, given in (("image", n_img, n_images), ("video", n_vid, n_videos)):
            if placed != given:
                raise ValueError(f"the messages have {placed} <{kind}> placeholders but {given} {kind}s were given")
        return conv

    def _template_ids(self, conv: list[dict], n_images: int, runs: list[str]) -> torch.Tensor:
        """Token ids of the chat template's text, one pad token per image and per video run (checked against the
        counts). `runs`: each video's text in place of its pad (a frame-run family), else one entry per video."""
        text = self.tokenizer.apply_chat_template(conv, chat_template=self.chat_template, tokenize=False,
                                                  add_generation_prompt=True)
        pads = {f: t for t, f in self.settings.special_tokens.items()}
        n_videos = len(runs)
        if self.frame_runs:
            video = pads["video_token_id"]
            if text.count(video) != len(runs):
                raise ValueError(f"the chat template in {self.path} rendered {text.count(video)} {video} tokens for "
                                 f"{len(runs)} videos")
            text = expand_video_text(text, video, runs)
            n_videos = sum(r.count(video) for r in runs)
        ids = torch.tensor(self.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
        for kind, field, given in (("image", "image_token_id", n_images), ("video", "video_token_id", n_videos)):
            pad = pads[field]
            rendered = int((ids == getattr(self.model, field)).sum())
            if rendered != given:
                raise ValueError(f"the chat template in {self.path} rendered {rendered} {pad} tokens for "
                                 f"{given} {kind}{' runs' if kind == 'video' and self.frame_runs else 's'}")
        return ids

    def _run_text(self, grid_thw, picked: torch.Tensor, fps: float) -> str:
        """One video's prompt text in a frame-run family (`data.frame_runs`), with this family's token texts."""
        t = {f: tok for tok, f in self.settings.special_tokens.items()}
        names = {"start": t["vision_start_token_id"], "video": t["video_token_id"], "end": t["vision_end_token_id"]}
        return self.video.run_text(tuple(grid_thw), picked, fps, names)

    def _images(self, images: list) -> tuple[torch.Tensor, torch.Tensor]:
        pils = [self.load_image(i) for i in images]
        size = {"shortest_edge": self.image.min_pixels, "longest_edge": self.image.max_pixels}
        out = self.image_processor(images=pils, size=size, return_tensors="pt")
        return out["pixel_values"].float(), out["image_grid_thw"].long()

    def _videos(self, videos: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[str]]:
        """Pixel rows, grids, seconds per grid step, and each video's prompt text (a frame-run family's runs)."""
        rows, grids, seconds, runs = [], [], [], []
        s = self.video
        for item in videos:
            frames, fps = self.load_video(item)
            keep, sampled_fps = self.sample(frames.shape[0], fps)
            if self.frame_runs:
                r, grid = s.patches(frames[keep])
                runs.append(self._run_text(grid, keep, fps))
            else:
                r, grid = video_patches(frames[keep], s.patch_size, s.merge_size, s.temporal_patch_size,
                                        s.min_pixels, s.max_pixels)
            rows.append(r)
            grids.append(grid)
            # Qwen2_5_VLProcessor._process_videos: temporal_patch_size / VideoMetadata.sampled_fps.
            seconds.append(s.temporal_patch_size / sampled_fps)
        return (torch.cat(rows), torch.tensor(grids, dtype=torch.long), torch.tensor(seconds, dtype=torch.float32),
                runs)

    def _video_counts(self, grids: list) -> list[int]:
        """Pad tokens of each video (Qwen2.5-VL), or of each run of each video (a frame-run family)."""
        if self.frame_runs:
            return [n for g in grids for n in self.video.tokens(g)]
        return [self.video.tokens(g) for g in grids]

    def build(self, messages: list[dict], images: list, videos: list) -> Prompt:
        """The prompt's token ids (placeholders expanded, generation prompt appended) and pixel tensors."""
        conv = self._conversation(messages, len(images), len(videos))
        runs = [""] * len(videos)
        if not self.frame_runs:  # the template's pads are checked before any pixel work
            ids = self._template_ids(conv, len(images), runs)
        prompt = Prompt(torch.empty(0, dtype=torch.long))
        if images:
            prompt.pixel_values, prompt.image_grid_thw = self._images(images)
        if videos:
            prompt.pixel_values_videos, prompt.video_grid_thw, prompt.second_per_grid_ts, runs = self._videos(videos)
        if self.frame_runs:  # the runs' timestamps come from the sampled frames
            ids = self._template_ids(conv, len(images), runs)
        counts = ([self.image.tokens(g) for g in (prompt.image_grid_thw.tolist() if images else [])],
                  self._video_counts(prompt.video_grid_thw.tolist() if videos else []))
        prompt.input_ids = expand_pads(ids, (self.model.image_token_id, self.model.video_token_id), counts)
        return prompt

    def prompt_length(self, messages: list[dict], image_sizes: list[tuple[int, int]],
                      video_shapes: list[tuple[int, int, int, float]]) -> int:
        """len(build(...).input_ids) from image (h, w) and video (T, h, w, fps) sizes, without pixel work."""
        conv = self._conversation(messages, len(image_sizes), len(video_shapes))
        tokens = [self.image.tokens(self.image.grid(1, h, w)) for h, w in image_sizes]
        grids, runs = [], []
        for t, h, w, fps in video_shapes:
            keep = self.sample(int(t), float(fps))[0]
            grids.append(self.video.grid(len(keep), h, w))
            runs.append(self._run_text(grids[-1], keep, float(fps)) if self.frame_runs else "")
        ids = self._template_ids(conv, len(image_sizes), runs)
        return ids.numel() + sum(n - 1 for n in tokens + self._video_counts(grids))

    def decode(self, tokens: torch.Tensor) -> str:
        """Text of generated tokens, special tokens dropped."""
        return self.tokenizer.decode(tokens.tolist(), skip_special_tokens=True)
