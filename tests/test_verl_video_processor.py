"""verl's processor on a CPU torch without torchvision: `RollplexQwen2VLVideoProcessor` (integrations/verl/video.py).

verl's dataset and agent loop take the Qwen2.5-VL processor from `verl.utils.hf_processor` (AutoProcessor); without
torchvision transformers builds none. With the plugin's video processor named in the checkpoint's
video_preprocessor_config.json, verl gets a `Qwen2_5_VLProcessor` whose outputs equal the project's own processor.
"""
import json
import os

import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image
from transformers import Qwen2_5_VLConfig
from transformers.video_utils import VideoMetadata
from verl.utils import hf_processor
from verl.utils.dataset.rl_dataset import get_dataset_class

from rollplex_megatron.checkpoint.convert import hf_config_from_model
from rollplex_megatron.data.example_files import write_tiny_processor
from rollplex_megatron.data.processor import VLProcessor, to_content
from rollplex_megatron.integrations.verl.data import RollplexRLHFDataset
from rollplex_megatron.integrations.verl.rollout import prompt_inputs
from rollplex_megatron.integrations.verl.video import NAME, RollplexQwen2VLVideoProcessor
from rollplex_megatron.recipes import load_run_config

WORDS = ["compare", "the", "first", "image", "what", "moves", "in", "video", "?", "."]


@pytest.fixture(scope="module")
def model():
    """The root recipe's tiny model (vocab 320, vision ids 310-313)."""
    return load_run_config([]).model


@pytest.fixture(scope="module")
def proc_dir(tmp_path_factory, model):
    """A tiny checkpoint's config and processor files; its video config names the plugin's video processor."""
    path = write_tiny_processor(str(tmp_path_factory.mktemp("proc")), WORDS, model)
    Qwen2_5_VLConfig.from_dict(hf_config_from_model(model)).save_pretrained(path)  # verl's hf_processor reads it
    select_video_processor(path)
    return path


def select_video_processor(path: str) -> None:
    """Name `RollplexQwen2VLVideoProcessor` in `path`'s video_preprocessor_config.json."""
    file = os.path.join(path, "video_preprocessor_config.json")
    with open(file) as f:
        cfg = json.load(f)
    cfg["video_processor_type"] = NAME
    with open(file, "w") as f:
        json.dump(cfg, f)


def frames(t, h, w, seed):
    """Random uint8 RGB frames [t,3,h,w]."""
    return torch.randint(0, 256, (t, 3, h, w), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_verl_processor_equals_the_project_processor(proc_dir, model):
    p = hf_processor(proc_dir)  # None when transformers cannot build it (verl warns and goes on)
    assert type(p).__name__ == "Qwen2_5_VLProcessor" and hasattr(p, "get_rope_index")
    assert isinstance(p.video_processor, RollplexQwen2VLVideoProcessor)
    msgs = [{"role": "user", "content": "<image> compare the first image . <video> what moves in video ?"}]
    image = Image.fromarray(frames(1, 37, 91, 1)[0].permute(1, 2, 0).numpy())
    clip = frames(5, 60, 90, 2)  # 5 frames at 2 fps: sampling at 2 fps keeps 4 (temporal 2)
    want = VLProcessor(proc_dir, model).build(msgs, [image], [clip])
    text = p.apply_chat_template(to_content(msgs)[0], add_generation_prompt=True, tokenize=False)
    got = p(text=[text], images=[image], videos=[clip], video_metadata=[VideoMetadata(total_num_frames=5, fps=2.0)],
            do_sample_frames=True, return_tensors="pt")
    assert torch.equal(got["input_ids"][0], want.input_ids)
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        assert torch.equal(got[key], getattr(want, key)), key
    assert got["second_per_grid_ts"].tolist() == pytest.approx(want.second_per_grid_ts.tolist())
    n = p.video_processor.get_num_of_video_patches(4, 60, 90)
    assert n == got["pixel_values_videos"].shape[0]


def test_unsupported_video_settings_are_refused(proc_dir):
    with pytest.raises(ValueError, match="do_normalize"):
        RollplexQwen2VLVideoProcessor(do_normalize=False)
    p = hf_processor(proc_dir)
    with pytest.raises(ValueError, match="no fps"):
        p.video_processor(videos=[frames(4, 28, 28, 3)], do_sample_frames=True)


def test_dataset_reads_images_as_qwen_vl_utils_without_it():
    cfg = OmegaConf.create({"custom_cls": {"path": "pkg://rollplex_megatron.integrations.verl.data",
                                           "name": "RollplexRLHFDataset"}})
    cls = get_dataset_class(cfg)  # verl's own lookup of data.custom_cls
    assert cls is RollplexRLHFDataset
    rgba = Image.new("RGBA", (60, 100), (10, 20, 30, 0))  # transparent: white, as qwen-vl-utils' to_rgb
    msgs = [{"role": "user", "content": [
        {"type": "image", "image": Image.new("RGB", (28, 28), (1, 2, 3))}, {"type": "text", "text": "which ?"},
        {"type": "image", "image": rgba},
        {"type": "image", "image": Image.new("RGB", (3000, 200)), "max_pixels": 112 * 112}]}]
    images, videos, audios = cls._process_multi_modal_info(msgs, image_patch_size=14, config=cfg)
    # hand-computed smart_resize (factor 28, min 4*28*28): 28x28 -> 56x56 (min pixels), 100x60 -> 112x56,
    # 200x3000 over 112*112 pixels -> scaled by 1/sqrt(600000/12544) and floored to multiples of 28: 28x420
    assert [im.size for im in images] == [(56, 56), (56, 112), (420, 28)]
    assert images[1].getpixel((0, 0)) == (255, 255, 255) and videos is None and audios is None
    with pytest.raises(ValueError, match="images only"):
        cls._process_multi_modal_info([{"role": "user", "content": [{"type": "video", "video": "a.mp4"}]}], 14, cfg)


def test_rollout_prompt_inputs_reexpand_the_agent_loops_prompt(model, tmp_path):
    path = write_tiny_processor(str(tmp_path), WORDS, model, newline=True, vision_special=False)
    Qwen2_5_VLConfig.from_dict(hf_config_from_model(model)).save_pretrained(path)
    select_video_processor(path)
    p = hf_processor(path)
    image = Image.fromarray(frames(1, 37, 91, 1)[0].permute(1, 2, 0).numpy())
    text = p.apply_chat_template(to_content([{"role": "user", "content": "<image> what moves ?"}])[0],
                                 add_generation_prompt=True, tokenize=False)
    want = p(text=[text], images=[image], return_tensors="pt")
    ids = want["input_ids"][0].tolist()  # the chat tags are special: decoding drops them, the check must not care
    got = prompt_inputs(p, p.tokenizer, ids, [image], None)
    assert torch.equal(got["pixel_values"], want["pixel_values"])
    assert torch.equal(got["image_grid_thw"], want["image_grid_thw"])
    bigger = image.resize((182, 74))  # 4x the placeholders of the prompt's image
    with pytest.raises(ValueError, match="differs from the agent loop's prompt ids"):
        prompt_inputs(p, p.tokenizer, ids, [bigger], None)
