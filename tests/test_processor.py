"""The VLProcessor and its pure pieces against transformers' Qwen2-VL / Qwen2.5-VL processors (CPU).

transformers' Qwen2VLVideoProcessor imports torchvision, which this environment lacks, so videos are
compared frame by frame with the PIL image processor, and frame sampling against `sample_frames`
taken from transformers' source with `ast` (plus hand-computed cases).
"""
import ast
import dataclasses
import importlib.util
import io
import json
import math
import os
import shutil
import types

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as hf_image
from transformers.video_utils import VideoMetadata

from rollplex_megatron.data import processor
from rollplex_megatron.data.example_files import write_tiny_processor, write_video
from rollplex_megatron.data.processor import VLProcessor
from rollplex_megatron.envs import vision
from rollplex_megatron.envs.vision import sample_frame_indices, smart_resize, video_patches
from rollplex_megatron.recipes import load_run_config

WORDS = ["compare", "the", "first", "and", "second", "image", "what", "moves", "in", "video", "?"]
PIXELS = [(56 * 56, 28 * 28 * 16), (56 * 56, 14 * 14 * 4 * 1280), (28 * 28 * 20, 28 * 28 * 30)]
SIZES = [(37, 91), (100, 60), (224, 224), (13, 300)]


@pytest.fixture(scope="module")
def model():
    """The root recipe's tiny model (vocab 320, vision ids 310-313)."""
    return load_run_config([]).model


@pytest.fixture(scope="module")
def proc_dir(tmp_path_factory, model):
    """A user's processor directory for the tiny model."""
    return write_tiny_processor(str(tmp_path_factory.mktemp("proc")), WORDS, model)


@pytest.fixture(scope="module")
def proc(proc_dir, model):
    """The processor of `proc_dir`."""
    return VLProcessor(proc_dir, model)


def frames(t, h, w, seed):
    """Random uint8 RGB frames [t,3,h,w]."""
    return torch.randint(0, 256, (t, 3, h, w), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def pil(frame):
    """A [3,H,W] uint8 frame as a PIL image."""
    return Image.fromarray(frame.permute(1, 2, 0).numpy())


def test_smart_resize_matches_transformers():
    for h in (1, 13, 27, 28, 29, 55, 100, 333, 1080, 4000):
        for w in (1, 14, 28, 57, 91, 640, 1921, 7000):
            for lo, hi in [*PIXELS, (4 * 28 * 28, 4 * 28 * 28)]:
                if max(h, w) / min(h, w) > 200:
                    with pytest.raises(ValueError, match="aspect ratio"):
                        smart_resize(h, w, 28, lo, hi)
                    continue
                assert smart_resize(h, w, 28, lo, hi) == hf_image.smart_resize(h, w, 28, lo, hi), (h, w, lo, hi)


def _max_diff_to_image_processor():
    """Largest |video_patches - Qwen2VLImageProcessorPil| over frames, clip lengths and pixel limits."""
    worst = 0.0
    for k, (h, w) in enumerate(SIZES):
        frame = frames(1, h, w, seed=k)
        for lo, hi in PIXELS:
            ref = hf_image.Qwen2VLImageProcessorPil(min_pixels=lo, max_pixels=hi)(images=[pil(frame[0])],
                                                                                  return_tensors="np")
            for clip in (frame, frame.expand(2, -1, -1, -1)):
                rows, grid = video_patches(clip, 14, 2, 2, lo, hi)
                assert list(grid) == ref["image_grid_thw"][0].tolist()
                worst = max(worst, float(np.abs(rows.numpy() - ref["pixel_values"]).max()))
    return worst


def test_video_patches_of_one_frame_equal_the_image_processor():
    assert _max_diff_to_image_processor() < 1e-6


def test_video_patches_mutation_bilinear_resize_fails(monkeypatch):
    monkeypatch.setattr(vision, "RESAMPLE", Image.Resampling.BILINEAR)
    assert _max_diff_to_image_processor() > 1e-2


def test_odd_clip_is_padded_with_its_last_frame():
    clip = frames(3, 56, 84, seed=5)
    rows, (t, gh, gw) = video_patches(clip, 14, 2, 2, 56 * 56, 28 * 28 * 16)
    last, _ = video_patches(clip[2:], 14, 2, 2, 56 * 56, 28 * 28 * 16)
    first, _ = video_patches(clip[:2], 14, 2, 2, 56 * 56, 28 * 28 * 16)
    assert t == 2 and torch.equal(rows[gh * gw:], last) and torch.equal(rows[:gh * gw], first)


def transformers_sample_frames():
    """Qwen2VLVideoProcessor.sample_frames, unbound: imported, or compiled from its source without torchvision."""
    name = "transformers.models.qwen2_vl.video_processing_qwen2_vl"
    try:
        return importlib.import_module(name).Qwen2VLVideoProcessor.sample_frames
    except ImportError:  # the module imports torchvision at its top; the method itself needs only math and torch
        pass
    spec = importlib.util.find_spec(name)
    with open(spec.origin) as f:
        tree = ast.parse(f.read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Qwen2VLVideoProcessor")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "sample_frames")
    namespace = {"math": math, "torch": torch, "VideoMetadata": VideoMetadata}
    exec(compile(ast.Module([fn], []), spec.origin, "exec"), namespace)
    return namespace["sample_frames"]


def test_frame_sampling_matches_transformers_sample_frames():
    """Unbound sample_frames with a fake `self` carrying the settings (here compiled by `ast`: no torchvision)."""
    ref_fn, cases = transformers_sample_frames(), 0
    for total in [*range(2, 40), 61, 100, 301, 999, 5001]:
        for fps in (1, 2, 2.5, 7, 23.976, 29.97, 30, 60):
            for target, lo, hi in ((2, 4, 768), (0.5, 4, 768), (3, 4, 16), (4, 1, 5)):
                fake = types.SimpleNamespace(num_frames=None, fps=target, temporal_patch_size=2, min_frames=lo,
                                             max_frames=hi)
                try:
                    ref = ref_fn(fake, VideoMetadata(total_num_frames=total, fps=fps))
                except ZeroDivisionError:  # fewer than 2 frames sampled: ours says so instead
                    with pytest.raises(ValueError, match="fewer than temporal_patch_size"):
                        sample_frame_indices(total, fps, target, lo, hi, 2)
                    continue
                ours, sampled = sample_frame_indices(total, fps, target, lo, hi, 2)
                assert torch.equal(ours, ref.long()), (total, fps, target, lo, hi)
                meta = VideoMetadata(total_num_frames=total, fps=fps, frames_indices=ref.tolist())
                assert sampled == meta.sampled_fps
                cases += 1
    assert cases > 1000


def test_frame_sampling_hand_computed():
    """Cases worked by hand from the rule (count = total/fps*target, clamped, floored to 2; arange indices)."""
    assert sample_frame_indices(10, 30, 2, 4, 768, 2)[0].tolist() == [0, 2, 5, 7]  # 0.67 -> min_frames 4
    idx, fps = sample_frame_indices(300, 30, 2, 4, 768, 2)
    assert idx.tolist() == list(range(0, 300, 15)) and fps == 2.0
    idx, fps = sample_frame_indices(5, 2, 2, 4, 768, 2)  # 5 floored to 4 frames
    assert idx.tolist() == [0, 1, 2, 3] and fps == pytest.approx(1.6)
    assert sample_frame_indices(100, 10, 2, 4, 6, 2)[0].tolist() == [0, 16, 33, 50, 66, 83]  # capped at 6
    with pytest.raises(ValueError, match="fewer than temporal_patch_size"):
        sample_frame_indices(50, 50, 0.1, 1, 768, 2)


def image_bytes(h, w, seed):
    """A PNG of random pixels."""
    buf = io.BytesIO()
    pil(frames(1, h, w, seed)[0]).save(buf, format="PNG")
    return buf.getvalue()


def template_tokens(proc, ids):
    """Tokens of `ids` with each run of pad tokens collapsed to one."""
    toks = proc.tokenizer.convert_ids_to_tokens(ids.tolist())
    return [t for k, t in enumerate(toks) if not (k and t == toks[k - 1] and t.endswith("_pad|>"))]


def check_expansion(proc, prompt):
    """Pad tokens per image/video are grid.prod() // merge**2; pixel rows are grid.prod() each."""
    ids = prompt.input_ids
    img = [int(g.prod()) // 4 for g in prompt.image_grid_thw]
    vid = [int(g.prod()) // 4 for g in prompt.video_grid_thw]
    assert int((ids == 310).sum()) == sum(img) and int((ids == 311).sum()) == sum(vid)
    assert prompt.pixel_values.shape == (sum(4 * n for n in img), 3 * 2 * 14 * 14)
    assert prompt.pixel_values_videos.shape == (sum(4 * n for n in vid), 3 * 2 * 14 * 14)


def test_build_two_images_and_a_frame_list_video(proc):
    msgs = [{"role": "user", "content": "<image><image> compare the first and second image . <video> what moves ?"}]
    images = [pil(frames(1, 37, 91, 1)[0]), {"bytes": image_bytes(100, 60, 2), "path": "b.png"}]
    clip = frames(5, 60, 90, 3)
    p = proc.build(msgs, images, [[pil(f) for f in clip]])
    ref = hf_image.Qwen2VLImageProcessorPil.from_pretrained(proc.path)(images=[proc.load_image(i) for i in images],
                                                                       return_tensors="pt")
    assert torch.equal(p.image_grid_thw, ref["image_grid_thw"]) and torch.equal(p.pixel_values, ref["pixel_values"])
    rows, grid = video_patches(clip[:4], 14, 2, 2, proc.video.min_pixels, proc.video.max_pixels)
    assert torch.equal(p.pixel_values_videos, rows) and p.video_grid_thw.tolist() == [list(grid)]
    # 5 frames at 2 fps keep 4 (floored to temporal 2): sampled fps 4/5*2 = 1.6, 2 / 1.6 seconds per grid.
    assert p.second_per_grid_ts.tolist() == [pytest.approx(1.25)]
    check_expansion(proc, p)
    want = ("<|im_start|>", "system", "You", "are", "a", "helpful", "assistant", ".", "<|im_end|>", "<|im_start|>",
            "user", *["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"] * 2, "compare", "the", "first", "and",
            "second", "image", ".", "<|vision_start|>", "<|video_pad|>", "<|vision_end|>", "what", "moves", "?",
            "<|im_end|>", "<|im_start|>", "assistant")
    assert template_tokens(proc, p.input_ids) == list(want)
    assert proc.decode(p.input_ids) == ("system You are a helpful assistant . user compare the first and second "
                                        "image . what moves ? assistant")
    sizes = [proc.load_image(i).size[::-1] for i in images]
    assert proc.video_shape([pil(f) for f in clip]) == (5, 60, 90, 2.0)
    assert proc.prompt_length(msgs, sizes, [(5, 60, 90, 2.0)]) == p.input_ids.numel()


def test_build_ids_equal_tokenising_the_expanded_chat_text(proc):
    msgs = [{"role": "system", "content": "compare"}, {"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "what moves in the video ?"}, {"type": "video"}]}]
    p = proc.build(msgs, [pil(frames(1, 50, 70, 4)[0])], [frames(4, 28, 56, 5)])
    text = proc.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\ncompare<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|>"
                    "<|vision_end|>what moves in the video ?<|vision_start|><|video_pad|><|vision_end|><|im_end|>\n"
                    "<|im_start|>assistant\n")
    n_img, n_vid = (int(g.prod()) // 4 for g in (p.image_grid_thw[0], p.video_grid_thw[0]))
    expanded = text.replace("<|image_pad|>", "<|image_pad|>" * n_img).replace("<|video_pad|>", "<|video_pad|>" * n_vid)
    assert p.input_ids.tolist() == proc.tokenizer(expanded, add_special_tokens=False)["input_ids"]


def test_build_video_file(proc, tmp_path):
    clip = torch.nn.functional.interpolate(frames(8, 3, 3, 6).float(), size=(64, 96), mode="bilinear")
    path = write_video(str(tmp_path / "x.mp4"), clip.round().to(torch.uint8), fps=4)
    decoded, fps = proc.load_video(path)
    assert decoded.shape == (8, 3, 64, 96) and fps == 4.0
    assert (decoded.float() - clip).abs().mean() < 12  # lossy mpeg4 of smooth frames
    msgs = [{"role": "user", "content": "<video> what moves ?"}]
    p = proc.build(msgs, [], [path])
    assert p.pixel_values is None and p.second_per_grid_ts.tolist() == [1.0]  # 8 frames at 4 fps -> 4 at 2 fps
    rows, grid = video_patches(decoded[[0, 2, 4, 6]], 14, 2, 2, proc.video.min_pixels, proc.video.max_pixels)
    assert torch.equal(p.pixel_values_videos, rows) and p.video_grid_thw.tolist() == [list(grid)]
    assert proc.prompt_length(msgs, [], [(8, 64, 96, fps)]) == p.input_ids.numel()
    assert proc.video_shape(path) == (8, 64, 96, 4.0) and proc.video_shape({"video": path, "fps": 8})[3] == 8.0
    # {"video": path, "fps": f} overrides the stream's rate: 8 frames at 8 fps -> min_frames 4, sampled at 4 fps.
    q = proc.build(msgs, [], [{"video": path, "fps": 8}])
    assert q.second_per_grid_ts.tolist() == [0.5] and torch.equal(q.pixel_values_videos, rows)


def test_video_probe_kept_until_the_file_changes(proc, tmp_path, monkeypatch):
    """A dataset's start-up probes each video file in the launcher and in every rank: the second probe reads the
    cache, a rewritten file is decoded again, and ROLLPLEX_CACHE_DIR=off keeps nothing."""
    monkeypatch.setenv("ROLLPLEX_CACHE_DIR", str(tmp_path / "cache"))
    clip = torch.nn.functional.interpolate(frames(8, 3, 3, 6).float(), size=(64, 96), mode="bilinear")
    path = write_video(str(tmp_path / "x.mp4"), clip.round().to(torch.uint8), fps=4)
    decodes = []
    real = processor.read_video
    monkeypatch.setattr(processor, "read_video", lambda p, visit: decodes.append(p) or real(p, visit))
    assert proc.video_shape(path) == (8, 64, 96, 4.0) and len(decodes) == 1
    assert proc.video_shape(f"file://{path}") == (8, 64, 96, 4.0) and len(decodes) == 1  # read back, not decoded
    assert len(list((tmp_path / "cache" / "video_probe").glob("*.json"))) == 1
    write_video(path, clip[:6].round().to(torch.uint8), fps=4)  # same name, other content
    os.utime(path, ns=(1, 1))  # and a time unlike the first file's, whatever the clock's resolution
    assert proc.video_shape(path) == (6, 64, 96, 4.0) and len(decodes) == 2
    monkeypatch.setenv("ROLLPLEX_CACHE_DIR", "off")
    assert proc.video_shape(path) == (6, 64, 96, 4.0) and len(decodes) == 3


def test_bad_media_name_the_file(proc, tmp_path):
    msgs = [{"role": "user", "content": "<image> what moves ?"}]
    with pytest.raises(FileNotFoundError, match="nope/a.png"):
        proc.build(msgs, [str(tmp_path / "nope/a.png")], [])
    (tmp_path / "bad.png").write_bytes(b"not an image")
    with pytest.raises(ValueError, match="bad.png"):
        proc.build(msgs, [str(tmp_path / "bad.png")], [])
    (tmp_path / "x.mp4").write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ValueError, match="cannot read video .*x.mp4"):
        proc.build([{"role": "user", "content": "<video>"}], [], [str(tmp_path / "x.mp4")])
    with pytest.raises(ValueError, match="cannot read video .*x.mp4"):
        proc.video_shape(str(tmp_path / "x.mp4"))
    with pytest.raises(FileNotFoundError, match="nope.mp4"):
        proc.load_video(str(tmp_path / "nope.mp4"))


def test_placeholder_count_mismatch_states_both_counts(proc):
    img = pil(frames(1, 28, 28, 0)[0])
    with pytest.raises(ValueError, match="1 <image> placeholders but 2 images"):
        proc.build([{"role": "user", "content": "<image> what"}], [img, img], [])
    with pytest.raises(ValueError, match="0 <video> placeholders but 1 videos"):
        proc.prompt_length([{"role": "user", "content": "what"}], [], [(4, 28, 28, 2.0)])


def test_config_mismatches_name_the_file_and_field(proc_dir, model, tmp_path):
    with pytest.raises(ValueError, match=r"maps <\|image_pad\|> to 310 but config.json's image_token_id is 5"):
        VLProcessor(proc_dir, dataclasses.replace(model, image_token_id=5))
    bad = shutil.copytree(proc_dir, tmp_path / "bad")
    cfg = json.loads((bad / "video_preprocessor_config.json").read_text())
    (bad / "video_preprocessor_config.json").write_text(json.dumps({**cfg, "temporal_patch_size": 1}))
    with pytest.raises(ValueError, match="video_preprocessor_config.json has temporal_patch_size 1 but "
                                         "model.vision.temporal_patch_size is 2"):
        VLProcessor(str(bad), model)
    (bad / "preprocessor_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no preprocessor_config.json"):
        VLProcessor(str(bad), model)


def test_pixel_overrides_and_video_config_fallback(proc_dir, model, tmp_path):
    p = VLProcessor(proc_dir, model, min_pixels=28 * 28, max_pixels=28 * 28 * 4)
    assert (p.image.min_pixels, p.image.max_pixels) == (p.video.min_pixels, p.video.max_pixels) == (784, 3136)
    assert p.build([{"role": "user", "content": "<image>"}], [pil(frames(1, 200, 200, 0)[0])], []) \
        .image_grid_thw.tolist() == [[1, 4, 4]]
    # Without video_preprocessor_config.json, videos read preprocessor_config.json, as transformers does.
    old = shutil.copytree(proc_dir, tmp_path / "old")
    (old / "video_preprocessor_config.json").unlink()
    q = VLProcessor(str(old), model)
    assert q.video.file.endswith("preprocessor_config.json") and q.video.max_pixels == q.image.max_pixels


def test_stop_tokens_and_decode_round_trip(proc):
    assert proc.tokenizer.convert_tokens_to_ids("<|im_end|>") in proc.stop_token_ids
    assert len(set(proc.stop_token_ids)) == len(proc.stop_token_ids)
    text = "compare the first and second image in the video ?"
    ids = proc.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert proc.decode(torch.tensor(ids + [proc.stop_token_ids[0]])) == text


def test_tiny_vocabulary_must_fit(model, tmp_path):
    with pytest.raises(ValueError, match="do not fit in model.vocab_size"):
        write_tiny_processor(str(tmp_path), [f"w{k}" for k in range(400)], model)


def test_video_pixel_limits_take_min_max_pixels_over_size_as_transformers_does():
    """transformers' Qwen2VLVideoProcessor.__init__ overrides `size` with a config's min_pixels / max_pixels
    (its "backward compatibility" branch; the class itself needs torchvision, absent here, so the rule is written
    out); `data.min_pixels` / `data.max_pixels` override both."""
    from rollplex_megatron.data.processor import video_settings
    from rollplex_megatron.models.registry import family_spec

    qwen = family_spec("qwen2_5_vl").processor.video_defaults
    size = {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28}
    both = video_settings("f", {"size": size, "min_pixels": 64 * 28 * 28, "max_pixels": 256 * 28 * 28}, None, None,
                          qwen)
    assert (both.min_pixels, both.max_pixels) == (64 * 28 * 28, 256 * 28 * 28)
    only_size = video_settings("f", {"size": size}, None, None, qwen)
    assert (only_size.min_pixels, only_size.max_pixels) == (128 * 28 * 28, 768 * 28 * 28)
    one = video_settings("f", {"size": size, "max_pixels": 100 * 28 * 28}, None, None, qwen)
    assert (one.min_pixels, one.max_pixels) == (128 * 28 * 28, 100 * 28 * 28)
    data = video_settings("f", {"size": size, "max_pixels": 100 * 28 * 28}, 32 * 28 * 28, 50 * 28 * 28, qwen)
    assert (data.min_pixels, data.max_pixels) == (32 * 28 * 28, 50 * 28 * 28)
