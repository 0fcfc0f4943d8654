"""Structured configs (kw_only dataclasses registered in Hydra's ConfigStore).

YAML cannot add unknown keys (structured configs are closed). Cross-field checks live in
`__post_init__` and name the setting and the fix; they never write derived values back.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

from hydra.core.config_store import ConfigStore

from rollplex_megatron.schema import Needs, refuse_unused, refuse_unused_at, section, setting

TASK_QUESTIONS = ("motion", "reach")  # the rendered task's questions (envs/motion.py)
TASK_MAX_OBJECTS = 8  # one colour per object

# Megatron-LM pads the vocabulary to a multiple of this times TP (--make-vocab-size-divisible-by).
VOCAB_DIVISIBLE_BY = 128

# workload.micro_batch_tokens and workload.prefix_pack_tokens left to the planner (memory/auto.py auto_size): sized
# for the device's free memory at start-up; without a device (CPU) today's fixed values, 0 (off) for both
AUTO_SIZE = -1


def at_least(section, path: str, names: tuple[str, ...], low: float, strict: bool = False, note: str = "") -> None:
    """A one-line error naming the first of `names` (fields of the config `section` at `path`) below `low` (at or
    below with `strict`), with the value given."""
    for name in names:
        value = getattr(section, name)
        if value < low or (strict and value == low):
            raise ValueError(f"{path}.{name} must be {'>' if strict else '>='} {low}, got {value}{note}")


def check_finite(section, path: str = "") -> None:
    """A one-line error naming the first float setting (of `section` and the config dataclasses in it) that is
    nan or infinite: no setting means either, and each would run to a NaN loss or an endless wait."""
    for f in fields(section):
        value, name = getattr(section, f.name), f"{path}{f.name}"
        if is_dataclass(value):
            check_finite(value, f"{name}.")
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {value}")


# The conditions settings apply with (`applies_with`): a setting set away from its default while its condition is
# false would be ignored, so it is refused (schema.refuse_unused). Stage `section` conditions read the section that
# holds the setting; `run` ones the whole RunConfig; `source` ones are checked by the rendered task's source.
LOGNORMAL = Needs("rollout.length_dist=lognormal", lambda rollout: bool(rollout.length_dist))
# the embedded engine's rollout model bound to the training storage is what `weight_refresh` refreshes
BOUND_ROLLOUT = Needs("a rollout model bound to the training storage (rollout.tp != parallel.tp, or "
                      "rollout.bound_model=true; the embedded engine, no parallel.rollout_ranks)",
                      lambda run: run.weights_phase == "weight_refresh" and run.rollout.engine == "embedded", "run")
SGLANG = Needs("rollout.engine=sglang", lambda run: run.rollout.engine == "sglang", "run")
# mode.window=auto may pick tail or green from its table, so their settings count there too
WINDOW_TAIL = Needs("mode.window=tail", lambda mode: mode.window in ("tail", "auto"))
WINDOW_GREEN = Needs("mode.window=green", lambda mode: mode.window in ("green", "auto"))
DECODE_WINDOW = Needs("mode.name=rollplex (the mode with a decode window)", lambda mode: mode.name == "rollplex")
REFERENCE_ITEMS = Needs("a reference (train.kl_coef > 0, or train.reference=always): there are no reference prefix "
                        "items", lambda run: run.train.uses_reference, "run")
WINDOW_GRAPHS = Needs("mode.window_graphs=true", lambda mode: mode.window_graphs)
# memory.plan=keep releases nothing, so nothing can come back early
RELEASING_PLAN = Needs("memory.plan=phase or auto", lambda memory: memory.plan != "keep")
STREAMED_STEP = Needs("memory.optimizer_step=stream or auto", lambda memory: memory.optimizer_step != "resident")
FREE_MEMORY_BUDGET = Needs("memory.budget_gib=0 and one of memory.plan=auto, a size left at auto (workload."
                           "micro_batch_tokens or prefix_pack_tokens -1, rollout.keep_decode_state null), "
                           "memory.prefetch_ahead=true or workload.prefix_pack_tokens under memory.plan=phase (the "
                           "budget is then the device's free memory less the margin)",
                           lambda run: run.budget_from_free_memory, "run")
DYNAMIC_SAMPLING = Needs("train.dynamic_sampling=true", lambda train: train.dynamic_sampling)
REFERENCE = Needs("a reference (train.kl_coef > 0, or train.reference=always for the logged kl)",
                  lambda train: train.uses_reference)
# the schedule's settings of a part that is off; run-level, as the verl engine builds OptimConfig itself
LR_WARMUP = Needs("optim.lr_warmup_steps > 0", lambda run: run.optim.lr_warmup_steps > 0, "run")
LR_DECAY = Needs("a decaying optim.lr_decay_style (linear, cosine or inverse-square-root)",
                 lambda run: run.optim.lr_decay_style != "constant", "run")
VAL_FILES = Needs("data.val_files (the rows validation answers)", lambda run: bool(run.data.val_files), "run")
# the rendered task scores with its own reward and draws its own prompts (data/rendered.py checks these)
DATASET_REWARD = Needs("data.train_files (the rendered task scores its answers itself, with task.format_reward)",
                       lambda run: run.data.resolved_source != "rendered", "source")
DATASET_ROWS = Needs("data.train_files (the rendered task draws its own prompts, from seed and task.*)",
                     lambda run: run.data.resolved_source != "rendered", "source")


@dataclass(kw_only=True)
class VisionConfig:
    """Qwen2.5-VL vision tower shape."""

    depth: int = setting(32, "number of vision transformer blocks")
    hidden_size: int = setting(1280, "vision width")
    ffn_hidden_size: int = setting(3420, "vision SwiGLU width (padded per TP at build time, exactly)")
    num_heads: int = setting(16, "vision attention heads (MHA)")
    out_hidden_size: int = setting(2048, "merger output width; must equal the LLM hidden size")
    patch_size: int = setting(14, "spatial patch size in pixels")
    temporal_patch_size: int = setting(2, "frames per temporal patch (Conv3d depth)")
    spatial_merge_size: int = setting(2, "merger folds merge x merge patches into one LLM token")
    window_size: int = setting(112, "window attention size in pixels")
    fullatt_block_indexes: list[int] = setting([7, 15, 23, 31], "full-attn blocks")
    tokens_per_second: int = setting(2, "temporal M-RoPE scale for videos")
    in_channels: int = setting(3, "image channels")
    rms_norm_eps: float = setting(1e-6, "RMSNorm epsilon (vision)")
    rope_theta: float = setting(10000.0, "vision 2D rotary base")
    num_position_embeddings: int = setting(0, "learned position table (a square, interpolated per grid; Qwen3-VL); "
                                              "0: none")
    deepstack_visual_indexes: list[int] = setting([], "vision blocks whose features DeepStack adds to the first "
                                                      "LLM layers (Qwen3-VL); []: none")

    def __post_init__(self) -> None:
        at_least(self, "model.vision", ("depth", "hidden_size", "ffn_hidden_size", "num_heads", "patch_size",
                                        "temporal_patch_size", "spatial_merge_size", "window_size", "in_channels"), 1)
        at_least(self, "model.vision", ("rms_norm_eps", "rope_theta"), 0, strict=True)
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.vision.hidden_size ({self.hidden_size}) must be divisible by "
                f"model.vision.num_heads ({self.num_heads})"
            )
        head_dim = self.hidden_size // self.num_heads
        if head_dim % 4:
            raise ValueError(f"vision head_dim ({head_dim}) must be divisible by 4 for 2D rotary")
        bad = [i for i in self.fullatt_block_indexes if not 0 <= i < self.depth]
        if bad:
            raise ValueError(
                f"model.vision.fullatt_block_indexes {bad} out of range for depth {self.depth}"
            )
        bad = [i for i in self.deepstack_visual_indexes if not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"model.vision.deepstack_visual_indexes {bad} out of range for depth {self.depth}")
        side = math.isqrt(self.num_position_embeddings)
        if side * side != self.num_position_embeddings:
            raise ValueError(f"model.vision.num_position_embeddings ({self.num_position_embeddings}) must be a square "
                             f"(the learned table is side x side)")
        unit = self.patch_size * self.spatial_merge_size
        if self.window_size % unit:
            raise ValueError(
                f"model.vision.window_size ({self.window_size}) must be a multiple of "
                f"patch_size*spatial_merge_size ({unit})"
            )


# model fields that one family alone reads (models/<family>/), with that family
FAMILY_ONLY_FIELDS = {"vision.num_position_embeddings": "qwen3_vl", "vision.deepstack_visual_indexes": "qwen3_vl"}


@dataclass(kw_only=True)
class ModelConfig:
    """Qwen2.5-VL shape: LLM fields, special tokens and the vision tower."""

    name: str = setting("qwen2_5_vl_3b", "preset name")
    family: str = setting("qwen2_5_vl", "model family: the registry entry (models/registry.py) that builds, loads "
                                        "and positions this shape")
    vocab_size: int = setting(151936, "true vocabulary (before TP padding)")
    hidden_size: int = setting(2048, "LLM width")
    ffn_hidden_size: int = setting(11008, "LLM SwiGLU width")
    num_layers: int = setting(36, "LLM decoder layers")
    num_attention_heads: int = setting(16, "LLM query heads")
    num_query_groups: int = setting(2, "LLM KV heads (GQA)")
    kv_channels: int = setting(0, "LLM attention head dimension; 0: hidden_size / num_attention_heads (Qwen3-VL "
                                  "sets it apart)")
    rms_norm_eps: float = setting(1e-6, "RMSNorm epsilon (LLM)")
    rope_theta: float = setting(1000000.0, "M-RoPE base")
    mrope_section: list[int] = setting([16, 24, 24], "t/h/w rotary split")
    tie_word_embeddings: bool = setting(True, "output layer shares the embedding")
    max_position_embeddings: int = setting(128000, "longest sequence the presets accept")
    image_token_id: int = setting(151655, "<|image_pad|>")
    video_token_id: int = setting(151656, "<|video_pad|>")
    vision_start_token_id: int = setting(151652, "<|vision_start|>")
    vision_end_token_id: int = setting(151653, "<|vision_end|>")
    freeze_vision: bool = setting(False, "vision tower gets no gradient (shared with the reference)")
    vision: VisionConfig = section(VisionConfig, "vision tower shape")

    def __post_init__(self) -> None:
        at_least(self, "model", ("vocab_size", "hidden_size", "ffn_hidden_size", "num_layers", "num_attention_heads",
                                 "num_query_groups", "max_position_embeddings"), 1)
        at_least(self, "model", ("rms_norm_eps", "rope_theta"), 0, strict=True)
        at_least(self, "model", ("kv_channels",), 0)
        if self.hidden_size % self.num_attention_heads and not self.kv_channels:
            raise ValueError(
                f"model.hidden_size ({self.hidden_size}) must be divisible by "
                f"model.num_attention_heads ({self.num_attention_heads})"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"model.num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"model.num_query_groups ({self.num_query_groups})"
            )
        half = self.head_dim // 2
        if sum(self.mrope_section) != half or len(self.mrope_section) != 3 or min(self.mrope_section) < 0:
            raise ValueError(
                f"model.mrope_section {list(self.mrope_section)} must have 3 entries >= 0 summing to "
                f"head_dim/2 = {half}"
            )
        if self.vision.out_hidden_size != self.hidden_size:
            raise ValueError(
                f"model.vision.out_hidden_size ({self.vision.out_hidden_size}) must equal "
                f"model.hidden_size ({self.hidden_size})"
            )
        ids = [self.image_token_id, self.video_token_id, self.vision_start_token_id,
               self.vision_end_token_id]
        if any(not 0 <= i < self.vocab_size for i in ids):
            raise ValueError(f"special token ids {ids} must lie inside model.vocab_size ({self.vocab_size})")
        if len(set(ids)) < len(ids):  # a token that is two of them would be read as both
            raise ValueError(f"model.image_token_id, video_token_id, vision_start_token_id and vision_end_token_id "
                             f"must differ, got {ids}")
        for field, family in FAMILY_ONLY_FIELDS.items():  # another family's model would ignore them silently
            value = getattr(self.vision, field.removeprefix("vision."))
            if value and self.family != family:
                raise ValueError(f"model.{field}={value} is read only by model.family={family}, and "
                                 f"model.family={self.family} ignores it; drop the setting (or set "
                                 f"model.family={family})")

    @property
    def vision_token_ids(self) -> tuple[int, int, int, int]:
        """The vision special tokens (placeholders, span markers): prompts hold them, the policy never emits them."""
        return (self.image_token_id, self.video_token_id, self.vision_start_token_id, self.vision_end_token_id)

    @property
    def head_dim(self) -> int:
        """LLM attention head dimension (`kv_channels`, or hidden_size / num_attention_heads)."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self, tp: int) -> int:
        """Vocabulary padded to a multiple of 128*TP, as Megatron-LM pads it."""
        mult = VOCAB_DIVISIBLE_BY * tp
        return -(-self.vocab_size // mult) * mult

    def padded_vision_ffn(self, tp: int) -> int:
        """Vision SwiGLU width rounded up to a multiple of TP (zero rows/cols keep it exact)."""
        return -(-self.vision.ffn_hidden_size // tp) * tp


@dataclass(kw_only=True)
class ParallelConfig:
    """Parallel layout: tensor, pipeline and data parallel sizes."""

    tp: int = setting(1, "tensor-parallel size")
    pp: int = setting(1, "pipeline-parallel size")
    dp: int = setting(1, "data-parallel size")
    backend: str = setting("auto", "torch.distributed backend: auto (nccl on GPU, gloo on CPU), gloo, nccl",
                           resumable=True)
    rollout_ranks: int = setting(0, "mode=disaggregated: the last that many ranks decode, with weights of their own")

    def __post_init__(self) -> None:
        for key in ("tp", "pp", "dp"):
            if getattr(self, key) < 1:
                raise ValueError(f"parallel.{key} must be >= 1, got {getattr(self, key)}")
        if self.rollout_ranks < 0:
            raise ValueError(f"parallel.rollout_ranks must be >= 0, got {self.rollout_ranks}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"parallel.backend must be auto, gloo or nccl, got {self.backend!r}")

    @property
    def train_world_size(self) -> int:
        """Training processes: tp * pp * dp."""
        return self.tp * self.pp * self.dp

    @property
    def world_size(self) -> int:
        """Processes needed: tp * pp * dp, plus the rollout's own ranks under mode=disaggregated."""
        return self.train_world_size + self.rollout_ranks


def check_model_parallel(model: ModelConfig, parallel: ParallelConfig,
                         names: tuple[str, str] = ("parallel.tp", "parallel.pp")) -> None:
    """Fail early, naming the setting (`names`: how the caller's user gave TP and PP), when the model does not
    split over this layout."""
    tp, pp = parallel.tp, parallel.pp
    checks = [
        (model.num_attention_heads, "model.num_attention_heads"),
        (model.num_query_groups, "model.num_query_groups"),
        (model.ffn_hidden_size, "model.ffn_hidden_size"),
        (model.vision.num_heads, "model.vision.num_heads"),
        (model.vision.hidden_size * model.vision.spatial_merge_size**2, "vision merger width"),
    ]
    for value, name in checks:
        if value % tp:
            raise ValueError(
                f"{name} ({value}) is not divisible by {names[0]} ({tp}); choose a tensor-parallel "
                f"size that divides it"
            )
    if model.num_layers % pp:
        raise ValueError(
            f"model.num_layers ({model.num_layers}) is not divisible by {names[1]} ({pp}); choose a "
            f"pipeline size that divides it"
        )


def check_rollout_layout(model: ModelConfig, parallel: ParallelConfig, rollout_tp: int, mode: str = "") -> None:
    """`rollout.tp` nests with parallel.tp, divides the world, and the model splits at it; under
    mode=disaggregated it divides `parallel.rollout_ranks` instead (the rollout's own ranks)."""
    r, t = rollout_tp or parallel.tp, parallel.tp
    if (mode == "disaggregated") != (parallel.rollout_ranks > 0):
        raise ValueError(f"mode=disaggregated and parallel.rollout_ranks > 0 go together (the last rollout_ranks "
                         f"ranks decode on weights of their own); got mode={mode}, rollout_ranks="
                         f"{parallel.rollout_ranks}")
    if parallel.rollout_ranks:
        if parallel.rollout_ranks % r:
            raise ValueError(f"rollout.tp={r} does not divide parallel.rollout_ranks={parallel.rollout_ranks}; "
                             f"the rollout ranks form replicas of rollout.tp ranks each")
        if parallel.pp > 1:
            raise ValueError("mode=disaggregated needs parallel.pp=1 (the weights are sent per TP shard)")
    elif r == t:
        return
    if max(r, t) % min(r, t):
        raise ValueError(f"rollout.tp={r} and parallel.tp={t}: one must divide the other (the rollout shards are "
                         f"views of, or are rebuilt from, the training shards)")
    if not parallel.rollout_ranks and parallel.world_size % r:
        raise ValueError(f"rollout.tp={r} does not divide the {parallel.world_size} ranks (parallel.tp*pp*dp); "
                         f"choose a rollout TP that divides it")
    if parallel.pp > 1:
        raise ValueError(f"rollout.tp={r} != parallel.tp={t} needs parallel.pp=1 (a rollout replica holds whole "
                         f"layers; pipeline stages would have to send theirs); set rollout.tp=0 or parallel.pp=1")
    try:
        check_model_parallel(model, ParallelConfig(tp=r))
    except ValueError as e:
        raise ValueError(str(e).replace("parallel.tp", "rollout.tp")) from None


@dataclass(kw_only=True)
class SmokeConfig:
    """Workload of the `smoke` command: forward+backward on synthetic image+video prompts."""

    batch: int = setting(2, "prompts per micro-batch")
    micro_batches: int = setting(1, "micro-batches per step (through megatron's schedule)")
    image_grid: list[int] = setting([1, 8, 12], "image (t, h, w) in patches")
    video_grid: list[int] = setting([4, 8, 8], "video (t, h, w) in patches")
    text_tokens: int = setting(48, "text tokens per prompt besides the vision placeholders")
    steps: int = setting(3, "timed steps")
    warmup: int = setting(1, "untimed steps first")

    def __post_init__(self) -> None:
        for key in ("batch", "micro_batches", "text_tokens", "steps"):
            if getattr(self, key) < 1:
                raise ValueError(f"smoke.{key} must be >= 1, got {getattr(self, key)}")
        at_least(self, "smoke", ("warmup",), 0)
        for key in ("image_grid", "video_grid"):
            if len(getattr(self, key)) != 3 or min(getattr(self, key)) < 1:
                raise ValueError(f"smoke.{key} must be three positive ints (t, h, w), got {getattr(self, key)}")


@dataclass(kw_only=True)
class SGLangConfig:
    """rollout.engine=sglang: what `sglang.Engine` gets, and the bridge's limits (docs/guides/sglang.md)."""

    model_path: str = setting("", 'the HF checkpoint SGLang reads its config and processor from ("" : train.init_hf)')
    mem_fraction_static: float = setting(0.5, "SGLang's mem_fraction_static: the fraction of the whole GPU SGLang's "
                                         "static memory may reach, counting what the trainer already holds when SGLang "
                                         "starts (the memory planner does not plan SGLang's part)")
    window_depth: int = setting(4, "prefix jobs in flight to the scheduler (the bridge's bounded queue)")
    timeout_s: float = setting(600.0, "longest wait for the scheduler during a step (names the step and item)")
    startup_timeout_s: float = setting(1800.0, "longest wait for SGLang's scheduler to connect while it loads")
    engine_args: dict = setting({}, "further sglang.Engine (ServerArgs) keywords")

    def __post_init__(self) -> None:
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"rollout.sglang.mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if self.window_depth < 1:
            raise ValueError(f"rollout.sglang.window_depth must be >= 1, got {self.window_depth}")
        at_least(self, "rollout.sglang", ("timeout_s", "startup_timeout_s"), 0, strict=True)
        # set by the project (TP, seed, dtype, the alias loader, seeds honoured, memory release) or breaking its
        # one-scheduler-per-training-TP-rank layout (data / pipeline parallel, another GPU base, a draft model)
        taken = {"model_path", "tp_size", "load_format", "custom_weight_loader", "random_seed", "dtype",
                 "enable_deterministic_inference", "enable_memory_saver", "mem_fraction_static", "dp_size",
                 "pp_size", "base_gpu_id", "mm_enable_dp_encoder", "speculative_algorithm", "enable_dp_attention"}
        clash = sorted(taken & set(self.engine_args))
        if clash:
            raise ValueError(f"rollout.sglang.engine_args.{clash[0]} is set by the project or breaks the bridge's "
                             f"layout (one SGLang scheduler per training TP rank); use rollout.sglang.model_path, "
                             f"rollout.sglang.mem_fraction_static or the run's own setting instead")


ENGINES = ("embedded", "sglang")


def check_sglang_layout(cfg) -> None:
    """rollout.engine=sglang runs SGLang at the training TP on the same GPUs, one engine per TP group, and
    the decode window's prefix jobs in its scheduler (no graph can cross processes: the recompute plan)."""
    p, r = cfg.parallel, cfg.rollout
    if p.pp > 1 or p.dp > 1 or p.rollout_ranks:
        raise ValueError(f"rollout.engine=sglang supports parallel.pp=1, parallel.dp=1 and no parallel.rollout_ranks "
                         f"(got pp={p.pp}, dp={p.dp}, rollout_ranks={p.rollout_ranks}); one SGLang engine serves one "
                         f"training TP group")
    if r.tp not in (0, p.tp):
        raise ValueError(f"rollout.engine=sglang runs SGLang at tp_size = parallel.tp ({p.tp}), its ranks on the "
                         f"training ranks' GPUs; set rollout.tp=0 (got {r.tp})")
    if r.bound_model:
        raise ValueError("rollout.bound_model applies to the embedded engine; SGLang's parameters are always bound "
                         "to the training storage under rollout.engine=sglang")
    if not r.sglang.model_path and not cfg.train.init_hf:
        raise ValueError("rollout.engine=sglang needs an HF checkpoint for SGLang's model config and processor: "
                         "set rollout.sglang.model_path or train.init_hf")


@dataclass(kw_only=True)
class RolloutConfig:
    """Rollout shape and sampling: GRPO group size, length limits, sampling parameters."""

    group_size: int = setting(4, "G: responses sampled per prompt")
    max_response_len: int = setting(256, "longest response accepted (tokens)")
    max_prompt_len: int = setting(8192, "longest prompt the rollout KV cache accepts (tokens)")
    temperature: float = setting(1.0, "sampling temperature (> 0)")
    top_p: float = setting(1.0, "nucleus sampling mass in (0, 1]")
    top_k: int = setting(0, "keep the k most likely tokens (0: all)")
    cuda_graphs: bool = setting(True, "GPU: replay each decode step as a CUDA graph (per batch-size bucket)",
                                resumable=True)
    keep_decode_state: bool | None = setting(None, "the decode cache, per-slot state and CUDA graphs kept between "
                                             "rollouts (rollout/embedded._DecodeState): a rollout of the same shape "
                                             "refills them and captures nothing; the cache stays allocated in every "
                                             "phase (the memory planner counts it so). true | false | null (the "
                                             "default: auto, kept where the planner finds room for it on the device, "
                                             "memory/auto.py auto_size; off without a device)", resumable=True)
    decode_attention: str = setting("auto", "triton (CUDA, bf16/fp16: split-K/V kernels that read each group's prefix "
                                    "K/V once) | flash (two varlen flash calls and a torch merge) | math (fp32 torch) "
                                    "| auto (triton, else flash, else math: the first that can run)", resumable=True)
    sampling_kernel: str = setting("auto", "the decode step's draw: triton (one fused pass over the logits: hash, "
                                   "Gumbel-max, log-softmax; temperature only) | torch (sampling.py's tensors) | auto "
                                   "(triton on CUDA when top_k=0 and top_p=1). Same tokens either way.", resumable=True)
    layer_kernel: str = setting("auto", "the decode step's decoder layers: modules (megatron's TransformerLayer "
                                "modules) | triton (models/decode_layers.py: each layer's own GEMMs with the glue "
                                "between them fused, 13 kernels a layer for 18; bf16 bit-equal to modules; needs "
                                "decode_attention=triton and pp=1) | auto (triton where it can run, else modules)",
                                resumable=True)
    decode_gemm: str = setting("torch", "the decode step's layer GEMMs on the fused layer path, at steps of at most "
                               "32 samples (the modules above): torch (the linear modules' cuBLAS GEMMs) | gated "
                               "(linear_fc1 and the gated activation as one Triton kernel, models/triton_linear.py "
                               "small_m_gated; the others cuBLAS) | all (also linear_qkv, linear_proj and linear_fc2 "
                               "as small_m_linear). Within rounding of torch's, not bit-equal; needs the fused layer "
                               "path (rollout.layer_kernel)", resumable=True)
    length_dist: str = setting("", '"" (off: the model stops) | lognormal: for benchmarks on random weights, which '
                               "never stop by themselves, each request's maximum length is drawn (mean length_mean, "
                               "log-std length_sigma, capped at the source's maximum) from a seeded stream and stop "
                               "tokens are ignored, so every response has exactly its drawn length")
    length_mean: int = setting(256, "mean of the drawn lengths before the cap", applies_with=LOGNORMAL)
    length_sigma: float = setting(0.8, "log-space standard deviation (0.8: a long tail, p99 about 5x the median)",
                                  applies_with=LOGNORMAL)
    tp: int = setting(0, "The rollout's TP degree (0: parallel.tp). When it differs, the engine decodes on a rollout "
                      "model bound to the training storage (weights/share.py), world / tp replicas, no PP; plan-memory "
                      "and plan-weights read it too.")
    split_gemm: str = setting("local", "rollout.tp != parallel.tp: linears run as GEMMs over views instead of rebuilt "
                              "weights: off | local (locally permuted ones, e.g. the gated fc1 at rollout TP > "
                              "training TP: +2.4% decode step on the H200) | all (gathered ones too, with their remote "
                              "pieces received: +8.0% with every decoder linear split)", applies_with=BOUND_ROLLOUT)
    bound_model: bool = setting(False, "decode on a rollout model of its own bound to the training storage even at "
                                "rollout.tp == parallel.tp (every tensor a view): what the shared path costs where the "
                                "layouts agree")
    engine: str = setting("embedded", "who decodes: embedded (this project's engine, in the trainer's processes) | "
                          "sglang (SGLang's Engine, with the decode window's prefix jobs in its scheduler through the "
                          "bridge; needs SGLang installed and a GPU)")
    sglang: SGLangConfig = section(SGLangConfig, "rollout.engine=sglang: what sglang.Engine gets, and the bridge's "
                                   "limits", applies_with=SGLANG)

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"rollout.engine must be one of {ENGINES}, got {self.engine!r}")
        if self.tp < 0:
            raise ValueError(f"rollout.tp must be >= 0 (0: parallel.tp), got {self.tp}")
        if self.split_gemm not in ("off", "local", "all"):
            raise ValueError(f"rollout.split_gemm must be off, local or all, got {self.split_gemm!r}")
        if self.length_dist not in ("", "lognormal"):
            raise ValueError(f"rollout.length_dist must be '' (off) or lognormal, got {self.length_dist!r}")
        if self.length_mean < 1 or self.length_sigma < 0:
            raise ValueError("rollout.length_mean must be >= 1 and rollout.length_sigma >= 0")
        refuse_unused(self, "rollout")
        if self.group_size < 1:
            raise ValueError(f"rollout.group_size must be >= 1, got {self.group_size}")
        if self.max_response_len < 1:
            raise ValueError(f"rollout.max_response_len must be >= 1, got {self.max_response_len}")
        if self.max_prompt_len < 2:
            raise ValueError(f"rollout.max_prompt_len must be >= 2, got {self.max_prompt_len}")
        check_sampling(self.temperature, self.top_p, self.top_k, "rollout.")
        if self.decode_attention not in ("auto", "triton", "flash", "math"):
            raise ValueError(f"rollout.decode_attention must be auto, triton, flash or math, "
                             f"got {self.decode_attention!r}")
        if self.sampling_kernel not in ("auto", "triton", "torch"):
            raise ValueError(f"rollout.sampling_kernel must be auto, triton or torch, got {self.sampling_kernel!r}")
        if self.layer_kernel not in ("auto", "modules", "triton"):
            raise ValueError(f"rollout.layer_kernel must be auto, modules or triton, got {self.layer_kernel!r}")
        if self.decode_gemm not in ("torch", "gated", "all"):
            raise ValueError(f"rollout.decode_gemm must be torch, gated or all, got {self.decode_gemm!r}")
        if self.decode_gemm != "torch" and self.layer_kernel == "modules":
            raise ValueError(f"rollout.decode_gemm={self.decode_gemm} runs on the fused layer path, which "
                             "rollout.layer_kernel="
                             "modules turns off: set rollout.layer_kernel=auto (or triton), or "
                             "rollout.decode_gemm=torch")
        check_sampling_kernel(self.sampling_kernel, self.top_k, self.top_p, "rollout.top_k/top_p")


@dataclass(kw_only=True)
class MotionTaskConfig:
    """Task shape and difficulty."""

    question: str = setting("motion", "motion (which way did it move?) | reach (which way to go to reach it?)")
    image_size: int = setting(56, "square frame side in pixels (a multiple of the model's model.vision.patch_size x "
                                  "spatial_merge_size: 28 for Qwen2.5-VL, 32 for Qwen3-VL, 16 for qwen3_vl_tiny)")
    frames: int = setting(4, "video frames (even); 1 renders the image variant")
    num_objects: int = setting(3, "target plus distractors (<= 8)")
    object_px: int = setting(8, "square side in pixels")
    step_px: int = setting(4, "target motion per frame in pixels")
    jitter_px: int = setting(0, "random distractor motion per frame (harder when > 0)")
    max_answer_tokens: int = setting(4, "longest response; a response ends at its first direction token")
    format_reward: float = setting(0.0, "added when the response names any direction (0: correctness only)")

    def __post_init__(self) -> None:
        if self.question not in TASK_QUESTIONS:
            raise ValueError(f"task.question must be one of {TASK_QUESTIONS}, got {self.question!r}")
        at_least(self, "task", ("image_size", "frames", "object_px"), 1)
        at_least(self, "task", ("jitter_px", "format_reward"), 0)
        if self.question == "motion" and self.step_px < 1:
            raise ValueError(f"task.step_px must be >= 1 (the target's motion per frame is the answer), got "
                             f"{self.step_px}")
        if self.frames != 1 and self.frames % 2:
            raise ValueError(f"task.frames ({self.frames}) must be 1 (image) or even (temporal patch 2)")
        if not 1 <= self.num_objects <= TASK_MAX_OBJECTS:
            raise ValueError(f"task.num_objects must be in 1..{TASK_MAX_OBJECTS}, got {self.num_objects}")
        if self.max_answer_tokens < 1:
            raise ValueError(f"task.max_answer_tokens must be >= 1, got {self.max_answer_tokens}")
        if self.question == "reach":
            if self.object_px + (self.object_px + 1) // 2 > self.image_size // 2:
                raise ValueError(f"task.question=reach needs task.object_px ({self.object_px}) <= "
                                 f"image_size/3 ({self.image_size // 3}) so targets fit beside the agent")
            return
        travel = self.step_px * max(self.frames - 1, 2)
        if self.object_px + 2 * travel >= self.image_size:
            raise ValueError(f"task.step_px={self.step_px} over {self.frames} frames leaves the "
                             f"{self.image_size}px frame; lower step_px or frames")


def check_sampling(temperature: float, top_p: float, top_k: int, where: str) -> None:
    """Range checks shared by SamplingParams and the rollout config; `where` prefixes the names."""
    if not temperature > 0:
        raise ValueError(f"{where}temperature must be > 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"{where}top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"{where}top_k must be >= 0 (0 keeps all tokens), got {top_k}")


def check_sampling_kernel(kernel: str, top_k: int, top_p: float, where: str) -> None:
    """rollout.sampling_kernel=triton draws with temperature only: a top-k or top-p filter (`where` says whose: the
    config's, or one request's at the engine) is refused, at start-up and per request alike."""
    if kernel == "triton" and (top_k or top_p < 1.0):
        raise ValueError(f"rollout.sampling_kernel=triton draws with temperature only, but {where} sets top_k={top_k}, "
                         f"top_p={top_p}; set top_k=0 and top_p=1.0, or use rollout.sampling_kernel=auto|torch")


ATTENTION_BACKENDS = ("auto", "sdpa", "flex", "split")  # mode.attention_backend, verify's, the verl engine's
LOGPROB_KERNELS = ("auto", "triton", "torch")  # train.logprob_kernel (rl/grpo.logprob_kernel_for)
NORM_KERNELS = ("auto", "triton", "torch")  # train.norm_kernel (models/triton_norm.norm_kernel_for)
ROPE_KERNELS = ("auto", "triton", "torch")  # train.rope_kernel (models/triton_rope.rope_kernel_for)
# the step's timed phases (trainer/metrics.PhaseTimer names; weight_refresh only with a rollout model of its own on the
# training storage, weight_transfer only under mode=disaggregated: `RunConfig.weights_phase`)
STEP_PHASES = ("rollout", "reward", "old_logp", "ref_logp", "update", "optimizer", "weight_refresh", "weight_transfer")


@dataclass(kw_only=True)
class WorkloadConfig:
    """Batch shape of one RL step.

    Training micro-batches pack a rank's responses (per PPO mini-batch) in order, by count
    (`responses_per_micro_batch`) or, with `micro_batch_tokens` > 0, greedily up to that many response
    tokens each, the count then ignored; a response longer than the budget goes alone. The budget counts
    response tokens only, so every mode packs the same responses the same way; serial's full-sequence
    micro-batches also carry each response's prompt, so under a budget one holds up to that many (short)
    responses with their prompts, and the planner counts it so. The loss is normalised by global token
    counts, so the packing does not change the update. DP ranks may get different numbers of micro-batches.
    `micro_batch_tokens` and `prefix_pack_tokens` default to -1 (`AUTO_SIZE`): the planner picks them for the
    device's free memory at start-up (memory/auto.py auto_size); without a device both are 0.
    """

    rollout_batch: int = setting(64, "responses per step over all data-parallel ranks (prompts x group size)")
    responses_per_micro_batch: int = setting(8, "packed responses per training micro-batch (micro_batch_tokens=0)")
    micro_batch_tokens: int = setting(AUTO_SIZE, "> 0: response tokens per training micro-batch (replaces the "
                                      "count); 0 off; -1 (the default) auto: the largest budget the device's free "
                                      "memory holds (serial, whose micro-batches carry their prompts: 0, with the "
                                      "largest count up to responses_per_micro_batch that fits); 0 without a device")
    prefix_pack_tokens: int = setting(AUTO_SIZE, "> 0: prefix stages (rollout prefill, scoring and update prefixes, "
                                      "window items) of consecutive groups run as one forward of up to this many "
                                      "prefix tokens, each group attending to its own prefix; 0: one group each; -1 "
                                      "(the default) auto: the largest pack the device's free memory holds; 0 without "
                                      "a device", resumable=True)

    def __post_init__(self) -> None:
        at_least(self, "workload", ("rollout_batch", "responses_per_micro_batch"), 1)
        if self.micro_batch_tokens < AUTO_SIZE:
            raise ValueError(f"workload.micro_batch_tokens must be >= 0, or -1 for auto, got {self.micro_batch_tokens} "
                             "(0 packs by workload.responses_per_micro_batch)")
        if self.prefix_pack_tokens < AUTO_SIZE:
            raise ValueError(f"workload.prefix_pack_tokens must be >= 0, or -1 for auto, got {self.prefix_pack_tokens} "
                             "(0 runs one group's prefix per forward)")


@dataclass(kw_only=True)
class ModeConfig:
    """How the step executes (docs/design.md §2); every mode computes the same update."""

    name: str = setting("rollplex", "a registered mode (trainer/modes/): serial | prefix_shared | rollplex | "
                                    "disaggregated (rollout on ranks of its own: parallel.rollout_ranks)")
    window: str = setting("auto", "decode-window mechanism (rollout/window/): interleave | after | stream | tail | "
                          "green | auto (the default: the fastest in the measured table, window_policy.json, at the "
                          "wave's batch, `after` unless another beats it; interleave at tp or pp > 1 and on CPU)")
    window_items_per_step: int = setting(1, "queued prefix work items run after each decode step")
    window_tail_fraction: float = setting(0.25, "tail: side work starts when active samples <= this fraction",
                                          applies_with=WINDOW_TAIL)
    window_green_sms: int = setting(32, "green: SMs of the side work's green-context partition",
                                    applies_with=WINDOW_GREEN)
    window_graphs: bool = setting(False, "mode rollplex: run the decode window's reference prefix items as CUDA "
                                  "graphs, one per bucket (prefix length and vision grids of each prompt of the item), "
                                  "captured the first time a bucket is seen and kept while the reference's weights "
                                  "stay at the same addresses (prefix/graphs.py; CUDA, one-rank layout, items run by "
                                  "the trainer's process). The graphs' memory pool stays on the device between steps: "
                                  "the planner counts it in every phase (`reference_prefix_graphs`), each step reports "
                                  "what it holds (`prefix_graph_pool_gib`)",
                                  applies_with=(DECODE_WINDOW, REFERENCE_ITEMS))
    window_graph_buckets: int = setting(4, "mode.window_graphs: buckets captured at most; an item of another bucket "
                                        "runs eagerly (prompts of many lengths would otherwise capture, and hold the "
                                        "K/V outputs of, a graph each)", applies_with=WINDOW_GRAPHS)
    attention_backend: str = setting("auto", "Shared-prefix attention of the scoring and update phases: split (no "
                                     "mask: each response token's group prefix and its own response as two varlen "
                                     "attention calls merged by their log-sum-exp, `attention/split.py`; flash kernels "
                                     "on CUDA), sdpa (an explicit [T, Kp+T] mask), flex, or auto (split where its "
                                     "flash kernels run: CUDA in bf16/fp16; sdpa elsewhere). Flex is not the default: "
                                     "torch 2.11's inductor rejected some training-step shapes (NoValidChoicesError).")

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"mode.attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got "
                             f"{self.attention_backend!r}")
        if not 0 < self.window_tail_fraction <= 1:
            raise ValueError(f"mode.window_tail_fraction must be in (0, 1], got {self.window_tail_fraction}")
        if self.window_green_sms < 1:
            raise ValueError(f"mode.window_green_sms must be >= 1, got {self.window_green_sms}")
        if self.window_items_per_step < 1:
            raise ValueError(f"mode.window_items_per_step must be >= 1, got {self.window_items_per_step}")
        if self.window_graph_buckets < 1:
            raise ValueError(f"mode.window_graph_buckets must be >= 1, got {self.window_graph_buckets}")
        refuse_unused(self, "mode")


@dataclass(kw_only=True)
class MemoryConfig:
    """Memory budgets."""

    kv_cache_gib: float = setting(8.0, "rollout KV cache budget per GPU; more groups than fit wait (queue)")
    budget_gib: float = setting(0.0, "HBM per GPU the run's plan must fit, checked before models are built; 0: none")
    cap_gib: float = setting(0.0, "a hard cap on torch's allocator per GPU (torch.cuda."
                             "set_per_process_memory_fraction), set before any model is built: past it the run stops "
                             "with an out-of-memory error rather than take memory another process on the GPU needs; "
                             "0: none. memory.budget_gib is what the plan must fit; the cap bounds what the allocator "
                             "really reserves (a cap under the plan's peak is refused)")
    plan: str = setting("auto", "Residency plan (memory/manager.py): keep = everything stays on the device (naive "
                        "colocation); phase = main weights and Adam states offloaded outside the optimizer step, "
                        "gradients freed outside the update, the reference offloaded where unused, the actor prefix "
                        "recomputed. auto (the default) = release only what the budget needs (memory/auto.py "
                        "auto_release: a minimal set of RELEASE_ORDER's classes), nothing when everything fits: the "
                        "budget is "
                        "memory.budget_gib, or with 0 the device's free memory at start-up minus "
                        "memory.auto_margin_gib (on CPU, without a budget, auto keeps everything)")
    auto_margin_gib: float = setting(4.0, "memory.plan=auto or auto sizes without a budget: free device memory left "
                                     "unplanned",
                                     applies_with=FREE_MEMORY_BUDGET)
    copy_streams: int = setting(1, "CUDA streams of the residency copies (memory/manager.py): 1 = offloads and "
                                "prefetches in one queue; 2 = one stream per direction, so a prefetch does not wait "
                                "for the offloads issued before it")
    prefetch_ahead: bool = setting(False, "bring a released offload class back one phase early (memory/auto.py "
                                   "ahead_phases): Adam states and master weights during the update, the reference "
                                   "during the phase before its first use, each only where that phase's planned bytes "
                                   "with it stay within memory.budget_gib (0: the device's free memory at start-up "
                                   "minus memory.auto_margin_gib; on CPU without a budget nothing comes early); its "
                                   "copy then runs beside that phase's work", applies_with=RELEASING_PLAN)
    optimizer_step: str = setting("auto", "how the optimizer step reads the fp32 master weights and Adam "
                                  "states the plan releases: resident = brought back to the device for the step; "
                                  "stream = left in pinned host memory and streamed through the step bucket by bucket "
                                  "on the copy streams (memory/stream_optimizer.py), so the optimizer phase holds the "
                                  "bf16 weights, the gradients and memory.optimizer_buckets buckets; the same update, "
                                  "bit for bit. auto (the default) = resident where the run fits the budget with it, "
                                  "else stream (memory/auto.py auto_size; resident without a device)",
                                  resumable=True, applies_with=RELEASING_PLAN)
    optimizer_bucket_mib: float = setting(512.0, "memory.optimizer_step=stream: the streamed bytes (masters and Adam "
                                          "states) of one bucket; a larger parameter is split across buckets",
                                          resumable=True, applies_with=STREAMED_STEP)
    optimizer_buckets: int = setting(2, "memory.optimizer_step=stream: buckets on the device at once (2: one "
                                     "updated while the next is copied in and the last copied out)", resumable=True,
                                     applies_with=STREAMED_STEP)

    def __post_init__(self) -> None:
        if self.plan not in ("keep", "phase", "auto"):
            raise ValueError(f"memory.plan must be keep, phase or auto, got {self.plan!r}")
        if self.copy_streams not in (1, 2):
            raise ValueError(f"memory.copy_streams must be 1 (one copy stream) or 2 (one per direction), "
                             f"got {self.copy_streams!r}")
        if self.auto_margin_gib < 0:
            raise ValueError(f"memory.auto_margin_gib must be >= 0, got {self.auto_margin_gib}")
        if not self.kv_cache_gib > 0:
            raise ValueError(f"memory.kv_cache_gib must be > 0, got {self.kv_cache_gib}")
        if self.budget_gib < 0:
            raise ValueError(f"memory.budget_gib must be >= 0 (0: no budget), got {self.budget_gib}")
        if self.cap_gib < 0:
            raise ValueError(f"memory.cap_gib must be >= 0 (0: no cap), got {self.cap_gib}")
        if self.optimizer_step not in ("resident", "stream", "auto"):
            raise ValueError(f"memory.optimizer_step must be resident, stream or auto, got {self.optimizer_step!r}")
        if not self.optimizer_bucket_mib > 0 or self.optimizer_buckets < 2:
            raise ValueError(f"memory.optimizer_bucket_mib must be > 0 and memory.optimizer_buckets >= 2, got "
                             f"{self.optimizer_bucket_mib} and {self.optimizer_buckets}")
        refuse_unused(self, "memory")


@dataclass(kw_only=True)
class PlanConfig:
    """Workload shape of `plan-memory` beyond workload/rollout: sequence lengths and optimizer layout."""

    prefix_tokens: int = setting(1040, "LLM tokens of one prompt (text + vision tokens)")
    vision_patches: int = setting(4096, "vision-tower patches of one prompt (vision tokens x merge^2)")
    response_tokens: int = setting(256, "tokens of one response")
    distributed_optimizer: bool = setting(False, "shard fp32 main weights and Adam states over DP")
    sequence_parallel: bool = setting(True, "activations split over the TP ranks")
    serial_engine: str = setting("separate", "serial baseline's engine: separate (own weights, K/V per sample) | "
                                 "embedded")
    fused_adam: bool = setting(False, "Adam without a workspace (TE/apex FusedAdam); false: torch Adam (foreach)")

    def __post_init__(self) -> None:
        for key in ("prefix_tokens", "vision_patches", "response_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"plan.{key} must be >= 1, got {getattr(self, key)}")
        if self.serial_engine not in ("separate", "embedded"):
            raise ValueError(f"plan.serial_engine must be separate or embedded, got {self.serial_engine!r}")


LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")  # megatron's OptimizerParamScheduler
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")  # verl's
REFERENCE_CHOICES = ("auto", "always", "never")  # train.reference (not on/off: YAML reads those as booleans)


def flat_settings(d: dict, prefix: str = "", keep_empty: bool = False) -> dict:
    """{dotted setting: value} of a plain (YAML-loaded or to_container) config dict. An empty dict has no key,
    or with `keep_empty` is a setting of its own (`reward.fns: {}`), so a command line that empties a mapping
    is seen to set it."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and (v or not keep_empty):
            out.update(flat_settings(v, f"{prefix}{k}.", keep_empty))
        else:
            out[f"{prefix}{k}"] = v
    return out


@dataclass(kw_only=True)
class OptimConfig:
    """megatron-core optimizer (Adam) settings."""

    lr: float = setting(1e-3, "peak learning rate (after warm-up)")
    weight_decay: float = setting(0.0, "decoupled weight decay (megatron: not on biases and norms)")
    adam_beta1: float = setting(0.9, "Adam beta1")
    adam_beta2: float = setting(0.999, "Adam beta2")
    adam_eps: float = setting(1e-8, "Adam epsilon")
    clip_grad: float = setting(1.0, "global gradient-norm clip (0: off)")
    # megatron-core's OptimizerParamScheduler, stepped once per RL step (the optimizer steps of one step's
    # mini-batches and epochs share its rate, verl's convention) and checkpointed
    lr_warmup_steps: int = setting(0, "linear warm-up from lr_warmup_init to lr over this many RL steps")
    lr_warmup_init: float = setting(0.0, "learning rate at the first step of the warm-up", applies_with=LR_WARMUP)
    lr_decay_style: str = setting("constant", "constant | linear | cosine | inverse-square-root (after warm-up)")
    lr_decay_steps: int = setting(0, "RL steps to decay over (0: train.steps)", applies_with=LR_DECAY)
    min_lr: float = setting(0.0, "learning rate at the end of the decay", applies_with=LR_DECAY)

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr}")
        if self.clip_grad < 0:
            raise ValueError(f"optim.clip_grad must be >= 0, got {self.clip_grad}")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"optim.lr_decay_style must be one of {LR_DECAY_STYLES}, got {self.lr_decay_style!r}")
        at_least(self, "optim", ("lr_warmup_steps", "lr_decay_steps"), 0)
        at_least(self, "optim", ("weight_decay",), 0)
        at_least(self, "optim", ("adam_eps",), 0, strict=True)
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"optim.{name} must be in [0, 1), got {getattr(self, name)}")
        for name in ("min_lr", "lr_warmup_init"):
            if not 0 <= getattr(self, name) <= self.lr:
                raise ValueError(f"optim.{name} must be within [0, optim.lr={self.lr}], got {getattr(self, name)}")


@dataclass(kw_only=True)
class TrainConfig:
    """The GRPO loop: steps, loss, logging and checkpoints."""

    steps: int = setting(60, "RL steps (ppo_epochs x ppo_mini_batches optimizer steps each)", resumable=True)
    ppo_mini_batches: int = setting(1, "optimizer steps per pass over the rollout batch (whole groups each; must "
                                    "divide the prompts per DP rank); only the first reuses the rollout's prefix, "
                                    "later ones recompute theirs")
    ppo_epochs: int = setting(1, "passes over the rollout batch; old log-probs stay the rollout policy's")
    dynamic_sampling: bool = setting(False, "DAPO: drop groups whose rewards are all equal, sample more prompts to "
                                     "refill")
    max_resample_rounds: int = setting(3, "dynamic sampling: extra rollout rounds per step at most (then fill, and log "
                                       "it)", applies_with=DYNAMIC_SAMPLING)
    kl_coef: float = setting(0.0, "coefficient of the KL to the reference in the loss")
    reference: str = setting("auto", "the reference model (the initial policy, frozen) and its scoring phase: auto "
                             "builds it only where the loss reads it (kl_coef > 0; at 0 the step has no reference "
                             "phase, no reference weights and no logged kl, as verl and TRL do); always (the logged kl "
                             "at kl_coef 0; the benchmark suites, whose workload scores it); never (refused with "
                             "kl_coef > 0)")
    kl_estimator: str = setting("low_var_kl", "k1 | k2 | k3 | low_var_kl (k3 clamped as verl clamps it); logged as "
                                "`kl`", applies_with=REFERENCE)
    entropy_coef: float = setting(0.0, "entropy bonus (token mean of the policy entropy) subtracted from the loss")
    logprob_kernel: str = setting("auto", "log-probs and entropy over the vocabulary: torch (fp32 copies of the "
                                  "logits) or triton (one read of the logits, `rl/triton_logprob.py`; CUDA); auto is "
                                  "triton on CUDA, torch elsewhere", resumable=True)
    norm_kernel: str = setting("auto", "the training models' RMSNorms: torch (torch.nn.RMSNorm, the composite beside "
                               "fp32 weights) or triton (one kernel forward, one backward, the same roundings: "
                               "models/triton_norm.py; CUDA); auto is triton on CUDA, torch elsewhere", resumable=True)
    rope_kernel: str = setting("auto", "the training models' RoPE: torch (megatron's unfused rotary in every layer) or "
                               "triton (cos/sin once per forward, one kernel per q and k in the attention context, "
                               "megatron's roundings: models/triton_rope.py); auto is triton on CUDA (its tests pass "
                               "on the H200: benchmarks/results/gpu_rope_norm_tests_f4a7f49.json), torch elsewhere",
                               resumable=True)
    clip_low: float = setting(0.2, "PPO ratio clip below 1")
    clip_high: float = setting(0.2, "PPO ratio clip above 1")
    clip_ratio_c: float = setting(0.0, "dual clip: negative-advantage tokens' loss capped at clip_ratio_c * |A| (0: "
                                  "off; > 1)")
    loss_agg_mode: str = setting("token-mean", "token-mean (every response token weighs the same) | "
                                 "seq-mean-token-mean (every response the same) | seq-mean-token-sum | "
                                 "seq-mean-token-sum-norm (Dr. GRPO: token sums over responses x the generation cap: a "
                                 "dataset's rollout.max_response_len, a rendered task's task.max_answer_tokens)")
    tensorboard: bool = setting(False, "TensorBoard event files (tensorboard/ in the run directory): metrics.jsonl's "
                                "scalars", resumable=True)
    wandb: bool = setting(False, "wandb in offline mode (wandb/ in the run directory; needs the wandb package)",
                          resumable=True)
    normalize_std: bool = setting(True, "divide group-centred rewards by the group std")
    save_every: int = setting(0, "checkpoint every k steps (0: only at the end)", resumable=True)
    save_final: bool = setting(True, "checkpoint after the last step (benchmark runs turn it off)", resumable=True)
    resume: bool = setting(False, "continue from the run directory's latest checkpoint", resumable=True)
    out: str = setting("", "run directory (empty: a new one under run_dir)", resumable=True)
    init_hf: str = setting("", "start actor and reference from this HF checkpoint (its config replaces model)")
    progress: bool = setting(True, "progress bar on rank 0", resumable=True)
    val_every: int = setting(0, "evaluate data.val_files every k steps and after the last (0: never)", resumable=True)
    profile_step: int = setting(0, "profile this step (1-based) with torch.profiler: top kernels per phase in <run "
                                "dir>/profile_step<K>.json (0: off); the profiled step's times include the profiler's "
                                "overhead", resumable=True)
    profile_phases: list[str] = setting([], "the phases profile_step profiles (empty: all of them); at 3B a whole "
                                        "profiled step can outlast the GPU machine's 10-minute call, one phase fits",
                                        resumable=True)

    @property
    def uses_reference(self) -> bool:
        """Whether the run builds the reference and scores it (`reference`: always, or auto with kl_coef > 0)."""
        return self.reference == "always" or (self.reference == "auto" and self.kl_coef > 0)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"train.steps must be >= 1, got {self.steps}")
        if self.logprob_kernel not in LOGPROB_KERNELS:
            raise ValueError(f"train.logprob_kernel must be auto, triton or torch, got {self.logprob_kernel!r}")
        if self.norm_kernel not in NORM_KERNELS:
            raise ValueError(f"train.norm_kernel must be auto, triton or torch, got {self.norm_kernel!r}")
        if self.rope_kernel not in ROPE_KERNELS:
            raise ValueError(f"train.rope_kernel must be auto, triton or torch, got {self.rope_kernel!r}")
        at_least(self, "train", ("kl_coef", "entropy_coef", "clip_low", "clip_high"), 0)
        if self.clip_low >= 1:
            raise ValueError(f"train.clip_low must be < 1 (the ratio's lower bound is 1 - clip_low), got "
                             f"{self.clip_low}")
        if self.reference not in REFERENCE_CHOICES:
            raise ValueError(f"train.reference must be one of {REFERENCE_CHOICES}, got {self.reference!r}")
        if self.reference == "never" and self.kl_coef > 0:
            raise ValueError(f"train.reference=never leaves nothing for train.kl_coef={self.kl_coef} to read; set "
                             f"train.kl_coef=0 or train.reference=auto")
        if self.ppo_mini_batches < 1 or self.ppo_epochs < 1:
            raise ValueError(f"train.ppo_mini_batches ({self.ppo_mini_batches}) and train.ppo_epochs "
                             f"({self.ppo_epochs}) must be >= 1")
        if self.profile_step < 0:
            raise ValueError(f"train.profile_step must be >= 0 (0: off), got {self.profile_step}")
        bad = [p for p in self.profile_phases if p not in STEP_PHASES]
        if bad:
            raise ValueError(f"train.profile_phases: unknown phase(s) {bad}; the phases are {list(STEP_PHASES)}")
        if self.max_resample_rounds < 0:
            raise ValueError(f"train.max_resample_rounds must be >= 0, got {self.max_resample_rounds}")
        refuse_unused(self, "train")
        at_least(self, "train", ("save_every", "val_every"), 0, note=" (0: off)")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"train.loss_agg_mode must be one of {LOSS_AGG_MODES}, got {self.loss_agg_mode!r}")
        if self.clip_ratio_c and self.clip_ratio_c <= 1:
            raise ValueError(f"train.clip_ratio_c must be > 1 (or 0: off), got {self.clip_ratio_c}")
        if self.resume and not self.out:
            raise ValueError("train.resume=true needs train.out=<run directory> to resume from")


@dataclass(kw_only=True)
class EquivalenceConfig:
    """Random batch of `verify-equivalence`: prefix/response execution vs full sequences."""

    groups_per_rank: int = setting(2, "prompts per data-parallel rank")
    min_response_len: int = setting(2, "shortest sampled response")
    max_response_len: int = setting(12, "longest sampled response (<= rollout.max_response_len)")
    responses_per_micro_batch: int = setting(3, "packed responses per micro-batch")
    image_grid: list[int] = setting([1, 4, 6], "image (t, h, w) patches")
    video_grid: list[int] = setting([2, 4, 4], "video (t, h, w) patches")
    text_tokens: int = setting(9, "prompt text tokens besides vision placeholders")
    seed: int = setting(7, "batch seed (fresh random inputs per seed)")
    advantage_mean: float = setting(0.0, "advantages ~ N(mean, 1); a nonzero mean keeps the loss away from 0")
    attention_backend: str = setting("auto", "shared-prefix attention: auto (split where its flash kernels run, else "
                                     "sdpa), sdpa, flex, split")
    repeats: int = setting(1, "run both paths this many times; timings are the median after the first")
    noise_floor: bool = setting(False, "also compare the serial path with itself (1 response per micro-batch)")
    fp32_reference: bool = setting(True, "bf16: also run the serial step in fp32 on the same weights; both paths vs it")

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"verify.attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got "
                             f"{self.attention_backend!r}")
        if self.repeats < 1:
            raise ValueError("verify.repeats must be >= 1")
        if not 1 <= self.min_response_len <= self.max_response_len:
            raise ValueError("verify.min_response_len must be >= 1 and <= verify.max_response_len")
        at_least(self, "verify", ("groups_per_rank", "responses_per_micro_batch", "text_tokens"), 1)
        for key in ("image_grid", "video_grid"):
            if len(getattr(self, key)) != 3 or min(getattr(self, key)) < 1:
                raise ValueError(f"verify.{key} must be three positive ints (t, h, w), got {getattr(self, key)}")


DATA_TRUNCATION = ("error", "left")


@dataclass(kw_only=True)
class DataConfig:
    """Where prompts and rewards come from (data/: the DataSource registry).

    `source=auto` trains on `train_files` when they are given (verl's RL format: parquet or jsonl rows
    with `prompt`, `images`, `videos`, `reward_model`, `data_source`, `extra_info`), else on the
    rendered task of `task`."""

    source: str = setting("auto", "auto | rendered (the embodied tasks of `task`, envs/motion.py) | dataset "
                          "(train_files)")
    train_files: list[str] = setting([], "parquet / jsonl files of training rows")
    val_files: list[str] = setting([], "rows evaluated every train.val_every steps", resumable=True)
    accept_changed_files: bool = setting(False, "resume although train_files changed since the checkpoint "
                                         "(size/rows/hash)", resumable=True)
    processor: str = setting("", "tokenizer + chat template + image/video processor directory (empty: train.init_hf)",
                             applies_with=DATASET_ROWS)
    prompt_key: str = setting("prompt", "column of the chat messages", applies_with=DATASET_ROWS)
    image_key: str = setting("images", "column of the image list", applies_with=DATASET_ROWS)
    video_key: str = setting("videos", "column of the video list", applies_with=DATASET_ROWS)
    min_pixels: int = setting(0, "per image / video frame after resizing (Qwen3-VL videos: per sampled clip, "
                                 "frames x height x width; 0: the processor config's)",
                              applies_with=DATASET_ROWS)
    max_pixels: int = setting(0, "per image / video frame after resizing (Qwen3-VL videos: per sampled clip, "
                                 "frames x height x width; 0: the processor config's)",
                              applies_with=DATASET_ROWS)
    video_fps: float = setting(2.0, "frames sampled per second of a video file (frame lists are taken as sampled at "
                               "this)", applies_with=DATASET_ROWS)
    max_frames: int = setting(768, "most frames sampled from one video", applies_with=DATASET_ROWS)
    min_frames: int = setting(4, "fewest frames sampled from one video file", applies_with=DATASET_ROWS)
    shuffle: bool = setting(True, "a new permutation of the rows every epoch (from data.seed and the epoch)",
                            applies_with=DATASET_ROWS)
    seed: int = setting(1, "the row order's seed (independent of the model's)", applies_with=DATASET_ROWS)
    truncation: str = setting("error", "prompt over rollout.max_prompt_len: error (name the row) | left (drop oldest "
                              "text)", applies_with=DATASET_ROWS)
    prefetch: str = setting("auto", "next step's prompts built in a background thread: auto (on with CUDA) | on | off",
                            resumable=True, applies_with=DATASET_ROWS)

    @property
    def resolved_source(self) -> str:
        """The source the run reads: `source`, where auto is dataset when `train_files` are given, else rendered
        (`data.source_name` checks the name against the registered sources)."""
        if self.source != "auto":
            return self.source
        return "dataset" if self.train_files else "rendered"

    def __post_init__(self) -> None:
        if self.truncation not in DATA_TRUNCATION:
            raise ValueError(f"data.truncation must be one of {DATA_TRUNCATION}, got {self.truncation!r}")
        at_least(self, "data", ("seed",), 0)
        if self.prefetch not in ("auto", "on", "off"):
            raise ValueError(f"data.prefetch must be auto, on or off, got {self.prefetch!r}")
        if min(self.min_pixels, self.max_pixels) < 0 or (self.max_pixels and self.min_pixels > self.max_pixels):
            raise ValueError(f"data.min_pixels ({self.min_pixels}) and data.max_pixels ({self.max_pixels}) must be "
                             f">= 0 (0: the processor's) with min <= max")
        if not self.video_fps > 0 or self.max_frames < 1 or not 1 <= self.min_frames <= self.max_frames:
            raise ValueError("data.video_fps must be > 0 and 1 <= data.min_frames <= data.max_frames")
        for key in ("train_files", "val_files"):
            blank = [i for i, name in enumerate(getattr(self, key)) if not str(name).strip()]
            if blank:
                raise ValueError(f"data.{key}[{blank[0]}] is empty; name a parquet / jsonl file (or drop the entry)")
        if self.val_files and not self.train_files:
            raise ValueError("data.val_files are evaluated next to data.train_files; give data.train_files too")
        if self.source == "rendered" and (self.train_files or self.val_files):
            raise ValueError("data.source=rendered trains on the rendered task; drop data.train_files/val_files "
                             "or set data.source=dataset")


@dataclass(kw_only=True)
class RewardConfig:
    """Reward functions of dataset rows (data/rewards.py), looked up by the row's `data_source`.

    A function is a built-in name (exact_match | multiple_choice | math_boxed | bbox_iou) or
    `package.module:function` with signature (response: str, ground_truth, extra_info: dict) -> float | dict
    (a dict has `score`, optionally `acc` and `answered`). A row whose data_source names a built-in uses it."""

    fn: str = setting("", "applies to every row (overrides fns and the built-in lookup)", applies_with=DATASET_REWARD)
    fns: dict[str, str] = setting({}, "data_source -> function", applies_with=DATASET_REWARD)
    format_reward: float = setting(0.0, "added when a response gives a parsable answer (0: correctness only)",
                                   applies_with=DATASET_REWARD)
    timeout_s: float = setting(60.0, "seconds a user function (package.module:function) may take per response "
                               "before the run stops with an error naming it and the row (0: no limit)",
                               resumable=True, applies_with=DATASET_REWARD)

    def __post_init__(self) -> None:
        if self.format_reward < 0:
            raise ValueError(f"reward.format_reward must be >= 0, got {self.format_reward}")
        if self.fn and self.fns:
            raise ValueError(f"reward.fn={self.fn} applies to every row, so reward.fns ({', '.join(sorted(self.fns))}) "
                             "would never be read; give one of them")


@dataclass(kw_only=True)
class ValConfig:
    """Validation runs on `data.val_files` every `train.val_every` steps."""

    temperature: float = setting(0.0, "0: greedy decoding")
    n: int = setting(1, "responses per validation prompt")
    max_rows: int = setting(0, "evaluate at most this many rows (0: all)")
    before_train: bool = setting(True, "also evaluate the initial policy (as step 0)")

    def __post_init__(self) -> None:
        at_least(self, "val", ("temperature",), 0, note=" (0: greedy)")
        at_least(self, "val", ("n",), 1)
        at_least(self, "val", ("max_rows",), 0, note=" (0: all)")


@dataclass(kw_only=True)
class RunConfig:
    """Top-level config: model, parallel layout, seed and output location."""

    model: ModelConfig = section(ModelConfig, "model shape (recipes/model/*.yaml)")
    parallel: ParallelConfig = section(ParallelConfig, "parallel layout")
    smoke: SmokeConfig = section(SmokeConfig, "`smoke` command workload", resumable=True)
    rollout: RolloutConfig = section(RolloutConfig, "rollout shape")
    verify: EquivalenceConfig = section(EquivalenceConfig, "verify-equivalence batch", resumable=True)
    data: DataConfig = section(DataConfig, "data source of the GRPO loop")
    reward: RewardConfig = section(RewardConfig, "reward functions of dataset rows")
    val: ValConfig = section(ValConfig, "validation runs", resumable=True, applies_with=VAL_FILES)
    task: MotionTaskConfig = section(MotionTaskConfig, "the rendered task (recipes/task/*.yaml)")
    workload: WorkloadConfig = section(WorkloadConfig, "step batch shape")
    mode: ModeConfig = section(ModeConfig, "execution mode (recipes/mode/*.yaml)", resumable=True)
    memory: MemoryConfig = section(MemoryConfig, "memory budgets", resumable=True)
    plan: PlanConfig = section(PlanConfig, "plan-memory workload shape", resumable=True)
    optim: OptimConfig = section(OptimConfig, "optimizer")
    train: TrainConfig = section(TrainConfig, "GRPO loop")
    megatron: dict[str, Any] = setting({}, "megatron-core TransformerConfig fields for the LLM decoder, passed through "
                                       "as given (e.g. `+megatron.recompute_granularity=selective`); fields the "
                                       "project sets from other settings, and uneven pipeline splits, are refused")
    seed: int = setting(1234, "global seed")
    dtype: str = setting("float32", "compute dtype: float32 or bfloat16")
    run_dir: str = setting("runs", "where runs write their outputs", resumable=True)

    def __post_init__(self) -> None:
        check_finite(self)
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0 (numpy and the samplers take unsigned seeds), got {self.seed}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        check_model_parallel(self.model, self.parallel)
        check_rollout_layout(self.model, self.parallel, self.rollout.tp, self.mode.name)
        if self.rollout.bound_model and (self.parallel.pp > 1 or self.parallel.rollout_ranks):
            raise ValueError("rollout.bound_model=true binds a rollout model to the training storage: it needs "
                             "parallel.pp=1 and no parallel.rollout_ranks (disaggregated has weights of its own)")
        refuse_unused_at(self, "run")  # settings of a feature switched off elsewhere in the config
        if self.mode.window_graphs and (self.parallel.tp > 1 or self.parallel.pp > 1):
            raise ValueError(f"mode.window_graphs=true captures the reference's window items on one rank; at "
                             f"parallel.tp={self.parallel.tp} parallel.pp={self.parallel.pp} they hold collectives and "
                             "nothing would be captured: drop the override")
        if self.rollout.engine == "sglang":
            check_sglang_layout(self)
            if self.mode.window_graphs:
                raise ValueError("mode.window_graphs=true: rollout.engine=sglang runs the decode window's items in its "
                                 "scheduler, as jobs, where nothing is captured; drop the override")
        m = self.model.vision.spatial_merge_size
        for key, owner in (("image_grid", self.smoke), ("video_grid", self.smoke),
                           ("image_grid", self.verify), ("video_grid", self.verify)):
            _, h, w = getattr(owner, key)
            if h % m or w % m:
                raise ValueError(f"{'smoke' if owner is self.smoke else 'verify'}.{key} h and w must be multiples of "
                                 f"model.vision.spatial_merge_size ({m}), got {h}x{w}")

    def check_verify(self) -> None:
        """Checks that only `verify-equivalence` needs (its random batch must pass the trainer's limits)."""
        if self.verify.max_response_len > self.rollout.max_response_len:
            raise ValueError(f"verify.max_response_len ({self.verify.max_response_len}) exceeds "
                             f"rollout.max_response_len ({self.rollout.max_response_len})")

    @property
    def param_bytes(self) -> int:
        """Bytes per element of the run's compute dtype (`dtype`: bfloat16 2, float32 4): model weights, K/V and
        activations as the planner and the engine's KV budget count them."""
        return 2 if self.dtype == "bfloat16" else 4

    @property
    def budget_from_free_memory(self) -> bool:
        """Whether the run takes a memory budget from the device's free memory less `memory.auto_margin_gib`
        (`trainer.runtime.auto_budget_gib`): no `memory.budget_gib`, and `memory.plan=auto`,
        `memory.prefetch_ahead`, prefix packs whose recomputed graphs `memory.plan=phase` checks against the
        device, or sizes left to the planner (`auto_sized`). The only reader of the margin, so the setting is refused
        where this is false."""
        m = self.memory
        return m.budget_gib == 0 and (m.plan == "auto" or m.prefetch_ahead or self.auto_sized
                                      or (m.plan == "phase" and self.workload.prefix_pack_tokens > 0))

    @property
    def auto_sized(self) -> bool:
        """Whether a size is left to the planner (memory/auto.py auto_size): `workload.micro_batch_tokens` or
        `workload.prefix_pack_tokens` at -1, `rollout.keep_decode_state` unset, or `memory.optimizer_step=auto`
        under a plan that releases the optimizer's classes."""
        w = self.workload
        return (AUTO_SIZE in (w.micro_batch_tokens, w.prefix_pack_tokens) or self.rollout.keep_decode_state is None
                or (self.memory.optimizer_step == "auto" and self.memory.plan != "keep"))

    @property
    def weights_phase(self) -> str | None:
        """The phase that brings the rollout's weights up to date after the optimizer steps, as
        `trainer.runtime.build_engine` picks the engine: SGLang or rollout replicas on the training storage
        (weight_refresh), the rollout ranks of mode=disaggregated (weight_transfer), or None (the actor's modules)."""
        if self.rollout.engine == "sglang":
            return "weight_refresh"
        if self.parallel.rollout_ranks:
            return "weight_transfer"
        differ = bool(self.rollout.tp) and self.rollout.tp != self.parallel.tp
        return "weight_refresh" if differ or self.rollout.bound_model else None

    def check_training(self) -> None:
        """Checks that only training needs (verify/smoke runs use other batch shapes)."""
        g, n, dp = self.rollout.group_size, self.workload.rollout_batch, self.parallel.dp
        if g < 2:
            raise ValueError(f"rollout.group_size={g}: GRPO's advantage is a response's reward minus its "
                             f"group's mean, so with one response per prompt every advantage and the loss are "
                             f"0 and nothing trains; set rollout.group_size >= 2")
        if n % g:
            raise ValueError(f"rollout.group_size ({g}) must divide workload.rollout_batch ({n})")
        t = self.train
        if t.profile_step > t.steps:
            raise ValueError(f"train.profile_step={t.profile_step} is after the run's last step (train.steps="
                             f"{t.steps}), so nothing would be profiled; choose a step in 1..{t.steps}")
        if t.profile_phases and not t.profile_step:
            raise ValueError("train.profile_phases chooses the phases train.profile_step profiles; set "
                             "train.profile_step=K too")
        for phase in sorted({"weight_refresh", "weight_transfer"} & set(t.profile_phases) - {self.weights_phase}):
            raise ValueError(f"train.profile_phases names {phase}, a phase this run does not have (the rollout's "
                             f"weights phase here: {self.weights_phase or 'none, it decodes on the actor'}); drop it")
        if "ref_logp" in t.profile_phases and not t.uses_reference:
            raise ValueError(f"train.profile_phases names ref_logp, but this run scores no reference (train.reference="
                             f"{t.reference}, train.kl_coef={t.kl_coef:g}); drop it or set train.reference=always")
        decay = self.optim.lr_decay_steps or self.train.steps
        if self.optim.lr_warmup_steps >= decay:
            raise ValueError(f"optim.lr_warmup_steps ({self.optim.lr_warmup_steps}) must be below the decay length "
                             f"({decay}: optim.lr_decay_steps, or train.steps when 0)")
        if self.train.val_every and not self.data.val_files:
            raise ValueError("train.val_every > 0 needs data.val_files=[FILE, ...] to evaluate")
        if self.data.val_files and not self.train.val_every:
            raise ValueError("data.val_files are evaluated every train.val_every steps, which is 0 (never); set "
                             "train.val_every=K, or drop data.val_files (eval --run answers them after training)")
        if (n // g) % dp:
            raise ValueError(f"workload.rollout_batch/rollout.group_size = {n // g} prompts must be divisible "
                             f"by parallel.dp ({dp})")
        m = self.train.ppo_mini_batches
        if (n // g) % dp == 0 and self.prompts_per_rank % m:
            raise ValueError(f"train.ppo_mini_batches ({m}) must divide the {self.prompts_per_rank} prompts per "
                             f"data-parallel rank (workload.rollout_batch / rollout.group_size / parallel.dp): a "
                             f"mini-batch holds whole groups")
        if self.workload.prefix_pack_tokens > 0 and self.train.dynamic_sampling and self.mode.name == "rollplex":
            raise ValueError("workload.prefix_pack_tokens > 0 with train.dynamic_sampling in mode rollplex: a packed "
                             "prefill's graph and K/V would keep the groups dynamic sampling drops in memory; set "
                             "workload.prefix_pack_tokens=0 or train.dynamic_sampling=false")

    @property
    def prompts_per_rank(self) -> int:
        """Prompts (groups) each data-parallel rank samples per step."""
        return self.workload.rollout_batch // self.rollout.group_size // self.parallel.dp


def register_configs() -> None:
    """Register the schemas with Hydra's ConfigStore (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="parallel", name="parallel_schema", node=ParallelConfig)
    cs.store(group="task", name="task_schema", node=MotionTaskConfig)
    cs.store(group="mode", name="mode_schema", node=ModeConfig)
    cs.store(group="workload", name="workload_schema", node=WorkloadConfig)
    cs.store(group="memory", name="memory_schema", node=MemoryConfig)
