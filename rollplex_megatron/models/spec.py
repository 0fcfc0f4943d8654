"""The model seam's contract, in the style of torchtitan's `ModelSpec`: what the package needs from a model family.

A family is one architecture (Qwen2.5-VL); its presets are shapes of it (`model.family` names it). Each family
fills one `ModelSpec` in `models/<family>/spec.py` and is listed in `models/registry.py`; every module outside
`models/` reaches a model through the registry, never through a family's package (tests/test_model_seam.py).
The fields are grouped by the part of the package that calls them; each names its signature in a comment.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from rollplex_megatron.config import ModelConfig


class StageModel(Protocol):
    """One pipeline stage of a family's model (a megatron module), as the trainer, prefix stage and decoder call it.

    Vision features enter the language model in `embed` on the first stage (Qwen2.5-VL: merged vision
    embeddings replace the placeholder tokens); a family that also feeds vision features to later layers
    (Qwen3-VL's DeepStack) carries them from `embed` to its own decoder inside `forward`/`forward_prefix`.
    """

    cfg: ModelConfig
    pre_process: bool  # first pipeline stage: embeddings and the vision tower live here
    post_process: bool  # last pipeline stage: logits
    language_model: torch.nn.Module  # megatron's GPTModel (embedding, decoder, output_layer): kernels patch it
    vision: torch.nn.Module | None  # the vision tower on the first stage, else None

    def embed(self, input_ids, *vision_inputs, check: bool = True) -> torch.Tensor:
        """Token embeddings [S,B,H] with the vision features in place."""

    def forward(self, input_ids=None, position_ids=None, **kwargs) -> torch.Tensor:
        """Logits [B,S,V/TP] on the last stage, else hidden [S,B,H]."""

    def forward_prefix(self, input_ids, position_ids, attention_context, input_tensor=None, **kw) -> torch.Tensor:
        """The prefix stage's decoder layers on this stage (no logits): [S,B,H]."""

    def prefix_stage(self, prompts, ctx, input_tensor=None) -> torch.Tensor:
        """Prompts' prefixes packed one after another through this stage (prefix/execution.py's PrefixModel)."""

    def prefix_inputs(self, prompts, dev) -> dict:
        """`forward_prefix`'s inputs for prompts packed (ids, positions, vision inputs)."""

    def forward_decode(self, input_ids, position_ids, attention_context, fused_layers: bool = False) -> torch.Tensor:
        """One decode step at pp=1 with RoPE left to the decode attention: logits [B,1,V/TP]; `fused_layers`: the
        decoder through `models.decode_layers` (each layer's own GEMMs, the glue between them fused)."""

    def set_input_tensor(self, input_tensor) -> None:
        """Pipeline hook: the activation received from the previous stage."""


@dataclass(frozen=True, kw_only=True, slots=True)
class HFLayout:
    """The family's Hugging Face side: checkpoint reading, import/export and the names the weight sharing uses."""

    model_types: dict[str, str]  # config.json model_type -> the transformers class it names
    reference_model: type  # that transformers class (verify-hf's reference: `.from_pretrained(path)`)

    checkpoint: Callable[..., Any]  # (path) -> lazy checkpoint reader (.model_config(), .naming, .get, .keys)
    config_from_hf: Callable[..., ModelConfig]  # (config.json dict, name) -> ModelConfig
    config_to_hf: Callable[..., dict]  # (cfg) -> a config.json dict (transformers' own config class)

    naming: type  # tensor-name scheme: naming() = the released files', naming(**saved) restores a saved one
    rules: Callable[..., list]  # (cfg, tp, pp, naming) -> [models.hf_rules.Rule], one per megatron parameter
    shapes: Callable[..., dict]  # (cfg, naming) -> {HF name: shape}
    validate: Callable[..., None]  # (checkpoint, cfg): missing, extra or mis-shaped tensors, before any read
    load: Callable[..., int]  # (model, checkpoint, cfg, tp_rank, tp, pp_rank, pp) -> tensors loaded
    shard: Callable[..., dict]  # (checkpoint, cfg, tp_rank, tp, pp_rank, pp) -> one rank's megatron state
    export: Callable[..., Any]  # (rank_states, cfg, tp, pp, naming) -> (HF name, tensor) pairs, lazily


@dataclass(frozen=True, kw_only=True, slots=True)
class Positions:
    """Rotary position ids of the language model, for whole sequences and the prefix/response stages."""

    sequence: Callable[..., tuple]  # (cfg, input_ids [B,S], image_grid_thw, video_grid_thw, second_per_grid_ts)
    #                                 -> (position ids [R,B,S], deltas [B,1]); R rotary axes
    prompt: Callable[..., torch.Tensor]  # (cfg, prefix.batch.Prompt, extra_text=0) -> [R,1,P+extra_text]
    response: Callable[..., torch.Tensor]  # (last prompt position [R,1,1], response length n) -> [R,1,n]


@dataclass(frozen=True, kw_only=True, slots=True)
class Vision:
    """The vision tower and its inputs."""

    tower: type  # the tower module (first stage): (pixel_values, grid_thw) -> merged features [U, H]
    inputs: tuple[str, ...]  # the Prompt / forward keyword names that carry vision inputs
    check_placeholders: Callable[..., None]  # (cfg, input_ids, *inputs): placeholder tokens vs the grids
    flops: Callable[..., float]  # (cfg, grids [n,3]) -> forward FLOPs of the tower (verify/flops.py)


@dataclass(frozen=True, kw_only=True, slots=True)
class Processor:
    """What data/processor.py takes from the family: special tokens, video defaults, the image processor."""

    special_tokens: dict[str, str]  # token text -> the ModelConfig field that holds its id
    video_defaults: dict[str, int]  # the video processor's class defaults, for fields a config file leaves out
    image_processor: type  # transformers image processor class (.from_pretrained(path))
    # a prompt holds a video as one placeholder run (False: Qwen2.5-VL) or one <vision_start> run <vision_end> per
    # temporal grid step, each after its timestamp text (True: Qwen3-VL); the positions read the runs that way
    video_run_per_frame: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class Decode:
    """The decode step's hooks (rollout/embedded.py), beside the model's own `forward_decode`."""

    positions: Callable[..., torch.Tensor]  # (last prompt positions [n,R], step [1]) -> step positions [R,n,1]
    gather_logits: Callable[..., torch.Tensor]  # (vocab-parallel logits [B,S,V/TP], vocab_size) -> [B,S,vocab]


@dataclass(frozen=True, kw_only=True, slots=True)
class Layers:
    """The family's layer make-up beyond ModelConfig's sizes: what memory/tensor_bytes.py counts parameters and saved
    activations from (the learned position table and the DeepStack mergers follow from `model.vision`'s
    num_position_embeddings and deepstack_visual_indexes)."""

    qkv_bias: bool  # the LLM's QKV projection has a bias
    qk_norm: bool  # q and k RMS-normalised per head before RoPE (megatron's qk_layernorm)
    vision_norm: str  # the vision blocks' and mergers' norm: "RMSNorm" (a weight) | "LayerNorm" (weight and bias)
    vision_gated_mlp: bool  # the vision MLP: SwiGLU (fc1 holds both halves) | fc1, GELU, fc2
    vision_patch_bias: bool  # the patch embedding's Conv3d has a bias


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """One model family: how to build it at a TP/PP layout and everything the package reads from it."""

    family: str  # registry key; `model.family` names it
    build: Callable[..., StageModel]  # (cfg, dtype, megatron, meta=False) -> this rank's stage (parallel state set)
    check_megatron: Callable[..., None]  # (cfg, megatron overrides): the `megatron:` subtree, at config load
    hf: HFLayout
    positions: Positions
    vision: Vision
    processor: Processor
    decode: Decode
    layers: Layers
