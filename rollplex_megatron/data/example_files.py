"""A user's processor directory written offline: a word-level tokenizer, a chat template and processor configs.

What `write_tiny_processor` writes is what a Qwen2.5-VL checkpoint ships next to config.json
(tokenizer files, chat template, preprocessor_config.json, video_preprocessor_config.json), at the
tiny preset's scale, so `VLProcessor` loads it exactly as it loads a real release.
"""
from __future__ import annotations

import json
import os

import numpy as np
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from rollplex_megatron.config import ModelConfig
from rollplex_megatron.envs.vision import CLIP_MEAN, CLIP_STD

try:  # only `write_video` needs PyAV
    import av
except ImportError:
    av = None

UNK, PAD, IM_START, IM_END = "<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"
DEFAULT_SYSTEM = "You are a helpful assistant."
QWEN2_VIDEO_PROCESSOR = "Qwen2VLVideoProcessor"  # transformers' class, what a Qwen2.5-VL release names
# integrations/verl/video.py's torchvision-free class, named here so that writing its name imports none of verl's
VERL_VIDEO_PROCESSOR = "RollplexQwen2VLVideoProcessor"
# Words the chat template itself writes; the vocabulary always holds them.
TEMPLATE_WORDS = ("system", "user", "assistant", "You", "are", "a", "helpful", ".")

# Our own template, rendering like Qwen2.5-VL's: a default system turn, ChatML turns, one
# <|vision_start|><|..._pad|><|vision_end|> per image/video item. No newline follows a block tag
# because transformers renders with trim_blocks=True, which would eat it.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    f"{IM_START}system\n{DEFAULT_SYSTEM}{IM_END}\n"
    "{% endif %}"
    f"{IM_START}{{{{ message['role'] }}}}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' or 'image' in item %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'video' or 'video' in item %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in item %}{{ item['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    f"{IM_END}\n"
    "{% endfor %}"
    f"{{% if add_generation_prompt %}}{IM_START}assistant\n{{% endif %}}"
)


def vision_tokens(model: ModelConfig) -> dict[str, int]:
    """The Qwen2.5-VL vision special tokens and the ids the model config gives them."""
    return {"<|vision_start|>": model.vision_start_token_id, "<|vision_end|>": model.vision_end_token_id,
            "<|image_pad|>": model.image_token_id, "<|video_pad|>": model.video_token_id}


def tiny_vocab(words: list[str], model: ModelConfig) -> dict[str, int]:
    """Words from id 0 up, the vision tokens at the model's ids, the other specials in the next free ids."""
    fixed = vision_tokens(model)
    taken = set(fixed.values())
    vocab: dict[str, int] = {}
    next_id = 0
    for token in [*dict.fromkeys([*words, *TEMPLATE_WORDS]), PAD, IM_START, IM_END, UNK]:
        if token in vocab or token in fixed:
            continue
        while next_id in taken:
            next_id += 1
        vocab[token] = next_id
        taken.add(next_id)
    vocab.update(fixed)
    if max(vocab.values()) >= model.vocab_size:
        raise ValueError(f"{len(vocab)} tokens (words, template words and specials) do not fit in "
                         f"model.vocab_size ({model.vocab_size}) around the vision token ids {sorted(fixed.values())}")
    return vocab


def tiny_tokenizer(words: list[str], model: ModelConfig, newline: bool = False,
                   vision_special: bool = True) -> PreTrainedTokenizerFast:
    """A word-level fast tokenizer over `words` with the Qwen2.5-VL special tokens at the model's ids.

    `newline` makes "\n" one token, as in Qwen's own tokenizer (verl's Qwen token builder requires it); without
    it the whitespace split drops the chat template's newlines. `vision_special=False` registers the vision
    tokens as plain added tokens, so `decode(skip_special_tokens=True)` keeps them (verl 0.9.1's agent loop
    decodes a prompt so and re-expands it with a processor that, in transformers 5.24, counts the placeholders)."""
    vocab = tiny_vocab([*words, "\n"] if newline else words, model)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    # WordPiece's decoder joins tokens with spaces; no "##" pieces exist, and cleanup stays off so
    # decoding is the plain join.
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    specials = [PAD, IM_START, IM_END, UNK, *(vision_tokens(model) if vision_special else ())]
    tok.add_special_tokens(specials)
    if not vision_special:
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in vision_tokens(model)])
    if newline:  # matched before the whitespace split, which would drop it
        tok.add_tokens([AddedToken("\n", normalized=False)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=PAD, unk_token=UNK,
                                   chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False)


def video_processor_config(model: ModelConfig, min_pixels: int, max_pixels: int,
                           video_processor_type: str = QWEN2_VIDEO_PROCESSOR) -> dict:
    """The fields transformers' Qwen2VLVideoProcessor reads from video_preprocessor_config.json; `AutoProcessor`
    builds the class `video_processor_type` names (verl on CPU: integrations/verl/video.py's, no torchvision)."""
    v = model.vision
    return {
        "video_processor_type": video_processor_type, "processor_class": "Qwen2_5_VLProcessor",
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "patch_size": v.patch_size, "temporal_patch_size": v.temporal_patch_size, "merge_size": v.spatial_merge_size,
        "fps": 2.0, "min_frames": 4, "max_frames": 768, "do_sample_frames": True,
        "image_mean": list(CLIP_MEAN), "image_std": list(CLIP_STD), "resample": 3, "rescale_factor": 1 / 255,
        "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
    }


def write_tiny_processor(path: str, words: list[str], model: ModelConfig, min_pixels: int = 56 * 56,
                         max_pixels: int = 28 * 28 * 64, video_min_pixels: int | None = None,
                         video_max_pixels: int | None = None, newline: bool = False,
                         vision_special: bool = True, video_processor_type: str = QWEN2_VIDEO_PROCESSOR) -> str:
    """Write tokenizer, chat template, preprocessor_config.json and video_preprocessor_config.json to `path`.

    Video pixel limits default to the image ones; `newline`, `vision_special` as in `tiny_tokenizer`,
    `video_processor_type` as in `video_processor_config`. Returns `path`.
    """
    os.makedirs(path, exist_ok=True)
    tiny_tokenizer(words, model, newline, vision_special).save_pretrained(path)
    v = model.vision
    Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels, patch_size=v.patch_size,
                             temporal_patch_size=v.temporal_patch_size,
                             merge_size=v.spatial_merge_size).save_pretrained(path)
    video = video_processor_config(model, video_min_pixels or min_pixels, video_max_pixels or max_pixels,
                                   video_processor_type)
    with open(os.path.join(path, "video_preprocessor_config.json"), "w") as f:
        json.dump(video, f, indent=2)
    return path


def write_video(path: str, frames_TCHW_uint8: torch.Tensor, fps: int = 4, codec: str = "mpeg4") -> str:
    """Encode uint8 RGB frames [T,3,H,W] (even H and W) into a video file with PyAV. Returns `path`."""
    if av is None:
        raise ValueError("write_video needs PyAV: pip install av")
    with av.open(path, mode="w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.height, stream.width = frames_TCHW_uint8.shape[-2:]
        stream.pix_fmt = "yuv420p"
        for frame in frames_TCHW_uint8:
            rgb = np.ascontiguousarray(frame.permute(1, 2, 0).numpy())
            container.mux(stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")))
        container.mux(stream.encode())
    return path

