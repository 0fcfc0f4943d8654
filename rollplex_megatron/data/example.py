"""`make-example DIR`: what a user brings, written offline: a tiny random Qwen2.5-VL (or, with a Qwen3-VL
model config, Qwen3-VL) checkpoint with its processor (tokenizer, chat template, image and video processor
configs) in DIR/model, and a multiple-choice dataset in verl's RL format in DIR/train.parquet and DIR/val.parquet.

Each row shows one PIL-drawn square (half of one merged vision token's side, on an image of one merged vision
token: 14 px on 28x28 for the tiny Qwen2.5-VL preset, 8 px on 16x16 for the tiny Qwen3-VL one) and asks which
colour it is; the options are always
"A red B green C blue D yellow" and the reward is the built-in `multiple_choice` (chance 1/4).
With `videos=True` every third row is a two-frame video instead (frame lists); with `ragged=True` rows vary in
image size and wording, so prompts are ragged (the tests use that form).

The plain example is what this project's own driver (`train`) reads. `verl=True` (`make-example --verl`) writes
the variant verl 0.9.1 takes as it is (docs/guides/verl.md): the tokenizer has a one-token newline (verl's Qwen
token builder) and plain vision placeholders (verl's agent loop decodes a prompt dropping special tokens and the
processor counts them again), the video config names `RollplexQwen2VLVideoProcessor` (no torchvision needed),
and the rows are ragged, as varied images make them; the whole-step test (tests/test_verl_e2e_step.py) runs them.
Batches whose samples have one length train through verl's driver too (this project's verl plugin fixes verl
issue #7899, integrations/verl/positions.py; docs/guides/verl.md, Known gaps).
"""
from __future__ import annotations

import io
from pathlib import Path

import json

import numpy as np
import torch
from PIL import Image
from tokenizers import pre_tokenizers
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

from rollplex_megatron.checkpoint.convert import build_atomically, hf_config_from_model
from rollplex_megatron.config import ModelConfig
from rollplex_megatron.data.example_files import (QWEN2_VIDEO_PROCESSOR, VERL_VIDEO_PROCESSOR, tiny_tokenizer,
                                                   write_tiny_processor)
from rollplex_megatron.models.registry import model_spec

try:  # parquet output; without pyarrow the rows are written as jsonl with image files beside them
    import pyarrow as pa
    import pyarrow.parquet as pq
except ImportError:
    pa = pq = None

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (50, 80, 220), "yellow": (230, 200, 40)}
LETTERS = "ABCD"
QUESTION = "which colour is the square ? A red B green C blue D yellow . answer with the letter ."
LONGER = "look at the picture carefully . " + QUESTION
WORDS = sorted(set((QUESTION + " " + LONGER + " you are a helpful assistant . system user assistant "
                    "look at the picture carefully video").split()) | set(LETTERS))
# Qwen3VLProcessor writes a timestamp text before each video run, e.g. "<0.2 seconds>"
TIMESTAMP_WORDS = ["<", ">", "seconds", *"0123456789"]
# the tiny model preset of each family (`make-example --family`)
TINY_PRESETS = {"qwen2_5_vl": "tiny", "qwen3_vl": "qwen3_vl_tiny"}


def write_model(path: Path, model: ModelConfig, seed: int, verl: bool = False) -> None:
    """A randomly initialised checkpoint of `model`'s shape (its family's transformers class), with its
    processor, in `path` (`verl`: the processor as verl takes it, see the module docstring)."""
    torch.manual_seed(seed)
    cls = model_spec(model).hf.reference_model
    cls(cls.config_class.from_dict(hf_config_from_model(model))).save_pretrained(str(path))
    unit = model.vision.patch_size * model.vision.spatial_merge_size  # one merged vision token's side
    if model_spec(model).processor.video_run_per_frame:
        write_qwen3_processor(path, model, unit * unit, 4 * unit * unit)
        return
    # verl: a one-token newline, plain vision placeholders and the torchvision-free video processor (docstring)
    write_tiny_processor(path, WORDS, model, min_pixels=unit * unit, max_pixels=4 * unit * unit, newline=verl,
                         vision_special=not verl,
                         video_processor_type=VERL_VIDEO_PROCESSOR if verl else QWEN2_VIDEO_PROCESSOR)


def write_qwen3_processor(path: Path, model: ModelConfig, min_pixels: int, max_pixels: int) -> None:
    """What a Qwen3-VL checkpoint ships for Qwen3VLProcessor, at `model`'s scale: the tokenizer (digits one token
    each, as Qwen's own, so timestamps of any length tokenise), the image processor config (mean/std 0.5) and
    Qwen3VLVideoProcessor's config, whose pixel budget bounds a whole clip (here up to 8 frames of max_pixels)."""
    tok = tiny_tokenizer(WORDS + TIMESTAMP_WORDS, model)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [tok.backend_tokenizer.pre_tokenizer, pre_tokenizers.Digits(individual_digits=True)])
    tok.save_pretrained(str(path))
    v, half = model.vision, [0.5] * 3
    shape = dict(patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size, merge_size=v.spatial_merge_size)
    Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels, image_mean=half, image_std=half,
                             **shape).save_pretrained(str(path))
    # cap_pixels_per_frame stated (transformers' current default), so the processor does not warn at every call
    Qwen3VLVideoProcessor(size={"shortest_edge": min_pixels, "longest_edge": 8 * max_pixels},
                          cap_pixels_per_frame=False, **shape).save_pretrained(str(path))


def _png(rgb, size: tuple[int, int], rng: np.random.Generator, side: int) -> bytes:
    """A dark canvas with one coloured square of `side` pixels at a random place, as PNG bytes."""
    h, w = size
    canvas = np.full((h, w, 3), 20, dtype=np.uint8)
    side = min(side, h, w)
    y, x = int(rng.integers(0, h - side + 1)), int(rng.integers(0, w - side + 1))
    canvas[y:y + side, x:x + side] = rgb
    buf = io.BytesIO()
    Image.fromarray(canvas).save(buf, format="PNG")
    return buf.getvalue()


def example_rows(n: int, seed: int, videos: bool = False, ragged: bool = False, image_px: int = 28,
                 square_px: int = 14) -> list[dict]:
    """`n` rows of the colour question in verl's RL format (images as `{"bytes": ...}` dicts of
    `image_px` squares, or 2x2 / 1x3 / 2x1 times `image_px` when `ragged`)."""
    rng = np.random.default_rng(seed)
    rows = []
    for k in range(n):
        colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
        u = image_px  # ragged: 2x2, 1x3 and 2x1 of it
        size = [(2 * u, 2 * u), (u, 3 * u), (2 * u, u)][k % 3] if ragged else (u, u)
        text = LONGER if ragged and k % 2 else QUESTION
        row = {"data_source": "multiple_choice", "ability": "vision",
               "reward_model": {"style": "rule", "ground_truth": LETTERS[list(COLOURS).index(colour)]},
               "extra_info": {"index": k, "colour": colour}, "images": [], "videos": []}
        if videos and k % 3 == 2:
            frame = {"bytes": _png(COLOURS[colour], size, rng, square_px)}
            row["videos"] = [[frame, frame]]
            row["prompt"] = [{"role": "user", "content": "<video> " + text}]
        else:
            row["images"] = [{"bytes": _png(COLOURS[colour], size, rng, square_px)}]
            row["prompt"] = [{"role": "user", "content": "<image> " + text}]
        rows.append(row)
    return rows


def write_rows(path: Path, rows: list[dict]) -> Path:
    """Rows to `path` as parquet (pyarrow infers the nested schema), or, without pyarrow, to
    `path` with suffix .jsonl and the images and frames as PNG files in a folder beside it."""
    if pq is not None:
        pq.write_table(pa.Table.from_pylist(rows), str(path))
        return path
    media = path.with_suffix("")
    media.mkdir()
    for k, r in enumerate(rows):
        r["images"] = [_save(media / f"{k}_{i}.png", im) for i, im in enumerate(r["images"])]
        r["videos"] = [[_save(media / f"{k}_v{v}_{i}.png", f) for i, f in enumerate(fr)]
                       for v, fr in enumerate(r["videos"])]
    out = path.with_suffix(".jsonl")
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def _save(path: Path, image: dict) -> str:
    """The image written to `path`; its name relative to the rows file's folder (rows resolve relative names
    there), so the folder can be moved or renamed."""
    path.write_bytes(image["bytes"])
    return f"{path.parent.name}/{path.name}"


def make_example(out: str | Path, model: ModelConfig, train_rows: int = 512, val_rows: int = 64,
                 seed: int = 0, videos: bool = False, ragged: bool = False, image_px: int | None = None,
                 square_px: int | None = None, verl: bool = False) -> Path:
    """Write DIR/model, DIR/train.parquet and DIR/val.parquet (.jsonl without pyarrow); refuses an existing DIR.
    `verl`: the variant verl 0.9.1's driver takes as it is, its tokenizer, video processor and ragged rows
    (docs/guides/verl.md); without it, the example for `train`."""
    out = Path(out)
    if verl:
        check_verl_example(model, videos)
        # the whole-step test's rows (tests/test_verl_e2e_step.py): images of three sizes, two wordings; rows of
        # one length train too (the plugin fixes verl issue #7899, positions.py), checked in-process
        ragged = True
    # images default to one merged vision token (28 px for Qwen2.5-VL's 14 px patches), the square to half of it
    image_px = image_px or model.vision.patch_size * model.vision.spatial_merge_size
    square_px = square_px or image_px // 2
    if out.exists():
        raise FileExistsError(f"{out} exists; make-example writes a new directory (choose another path)")
    if seed < 0:
        raise ValueError(f"--seed must be >= 0 (numpy takes unsigned seeds), got {seed}")
    def fill(tmp: Path) -> None:  # a failure leaves no half-written DIR
        (tmp / "model").mkdir()
        write_model(tmp / "model", model, seed, verl)
        write_rows(tmp / "train.parquet", example_rows(train_rows, seed + 1, videos, ragged, image_px, square_px))
        write_rows(tmp / "val.parquet", example_rows(val_rows, seed + 2, videos, ragged, image_px, square_px))

    return build_atomically(out, fill)


def check_verl_example(model: ModelConfig, videos: bool) -> None:
    """Refuse a verl example this project has not run through verl: Qwen3-VL, or rows with videos."""
    if model_spec(model).processor.video_run_per_frame:
        raise ValueError(f"make-example --verl: model.family={model.family} has not run through verl's driver here "
                         f"(Qwen2.5-VL has); drop --verl, or use --family qwen2_5_vl")
    if videos:
        raise ValueError("make-example --verl --videos: the verl path here reads image rows only (its dataset class "
                         "RollplexRLHFDataset refuses videos); drop --videos")
