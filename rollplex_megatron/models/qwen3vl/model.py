"""Qwen3-VL (dense) on megatron-core: vision tower with learned positions and DeepStack mergers, the Qwen3 LLM.

Built from the same megatron-core parts as Qwen2.5-VL (models/qwen25vl/model.py), whose stage class this one
extends. What differs: the vision blocks use LayerNorm and a GELU(tanh) MLP, attend in full within each frame, and
add a learned position table interpolated per grid; the merger normalises with LayerNorm; DeepStack: the blocks
named by `vision.deepstack_visual_indexes` each go through a merger of their own, and their features are added to
the hidden states at the visual tokens after the first len(indexes) LLM layers; the LLM has per-head q/k RMSNorm
(megatron's `qk_layernorm`), no QKV bias, its own head dim and interleaved M-RoPE (models/qwen3vl/positions.py).
Legend: S = text sequence, B = batch, H = LLM width, N = vision patches, U = merge units, L = DeepStack levels.
"""
from __future__ import annotations

import copy
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig

from rollplex_megatron.attention import SDPACoreAttention
from rollplex_megatron.attention.prefix import SegmentContext
from rollplex_megatron.config import ModelConfig
from rollplex_megatron.models.qwen25vl import model as Q25
from rollplex_megatron.models.qwen25vl.model import VISION_KEYS, check_placeholders
from rollplex_megatron.models.qwen3vl import positions as P
from rollplex_megatron.models.triton_rope import rope_tables
from rollplex_megatron.runtime import device, host_constant


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """HF's `gelu_pytorch_tanh`, the vision MLP's activation."""
    return F.gelu(x, approximate="tanh")


def _llm_fields(cfg: ModelConfig, dtype: torch.dtype, tp: int, pp: int, meta: bool = False) -> dict:
    """Qwen2.5-VL's LLM fields with Qwen3's attention: q/k RMSNorm per head, no QKV bias, its own head dim."""
    return {**Q25._llm_fields(cfg, dtype, tp, pp, meta), "kv_channels": cfg.head_dim, "qk_layernorm": True,
            "add_qkv_bias": False}


def check_megatron_overrides(cfg: ModelConfig, overrides: dict) -> None:
    """`megatron.*` names TransformerConfig fields that no other setting owns, and the shape has what this family
    needs (bad input fails here, at config load)."""
    if cfg.vision.num_position_embeddings < 1:
        raise ValueError(f"model.vision.num_position_embeddings must be >= 1 for model.family={cfg.family} (Qwen3-VL's "
                         f"learned position table; 2304 in the released checkpoints)")
    Q25.check_megatron_overrides(cfg, overrides, _llm_fields)


def first_stage_layers(tc: TransformerConfig) -> int:
    """LLM layers megatron builds on the first pipeline stage (its `get_num_layers_to_build` at rank 0, uneven
    splits included)."""
    layout = tc.pipeline_model_parallel_layout
    if layout is not None:  # megatron's helper reads a layout at the current rank, whatever pp_rank says
        return layout.get_num_layers_to_build(pp_rank=0)
    return get_num_layers_to_build(tc, pp_rank=0)


def check_deepstack_stage(cfg: ModelConfig, tc: TransformerConfig) -> None:
    """DeepStack's levels must lie on the first stage (it holds the vision tower): refused by setting otherwise."""
    first, levels = first_stage_layers(tc), len(cfg.vision.deepstack_visual_indexes)
    if levels <= first:
        return
    split = [f"megatron.{k}={getattr(tc, k)}" for k in Q25.UNEVEN_SPLIT_SETTINGS if getattr(tc, k) not in (None, False)]
    fix = f"give the first stage at least {levels} through those settings, or drop them" if split else \
        "lower parallel.pp"
    raise ValueError(f"parallel.pp={tc.pipeline_model_parallel_size}{' with ' + ', '.join(split) if split else ''} "
                     f"leaves {first} LLM layers on the first pipeline stage but DeepStack feeds {levels} "
                     f"(model.vision.deepstack_visual_indexes, all on the first stage); {fix}")


def vision_transformer_config(cfg: ModelConfig, dtype: torch.dtype, tp: int, meta: bool = False) -> TransformerConfig:
    """TransformerConfig of the vision blocks: MHA, biases everywhere, LayerNorm, GELU(tanh) MLP, never pipelined."""
    v = cfg.vision
    fields = {**Q25._common_tc(dtype, tp, meta), "normalization": "LayerNorm", "gated_linear_unit": False,
              "activation_func": gelu_tanh}
    return TransformerConfig(num_layers=v.depth, hidden_size=v.hidden_size, ffn_hidden_size=cfg.padded_vision_ffn(tp),
                             num_attention_heads=v.num_heads, num_query_groups=v.num_heads,
                             kv_channels=v.hidden_size // v.num_heads, layernorm_epsilon=v.rms_norm_eps,
                             add_bias_linear=True, pipeline_model_parallel_size=1, **fields)


def layer_spec(causal: bool, normalization: str, qk_layernorm: bool):
    """Megatron's local layer spec with the project's SDPA core attention."""
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization=normalization, qk_layernorm=qk_layernorm))
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    spec.submodules.self_attention.params = {"attn_mask_type": AttnMaskType.causal if causal else AttnMaskType.no_mask}
    return spec


class PatchMerger(MegatronModule):
    """LayerNorm (before the fold, or after it: `postshuffle`, DeepStack's), fold merge**2 patches, then
    Linear-GELU-Linear (column then row parallel)."""

    def __init__(self, config: TransformerConfig, context_dim: int, out_dim: int, merge: int, postshuffle: bool):
        super().__init__(config=config)
        self.width, self.postshuffle = context_dim * merge * merge, postshuffle
        self.norm = torch.nn.LayerNorm(self.width if postshuffle else context_dim, eps=1e-6,
                                       dtype=config.params_dtype)  # HF hard-codes this eps
        self.fc1 = tensor_parallel.ColumnParallelLinear(self.width, self.width, config=config,
                                                        init_method=config.init_method, bias=True, gather_output=False)
        self.fc2 = tensor_parallel.RowParallelLinear(self.width, out_dim, config=config, init_method=config.init_method,
                                                     bias=True, input_is_parallel=True, skip_bias_add=False)

    def forward(self, x_NC: torch.Tensor) -> torch.Tensor:  # noqa: D102
        x = self.norm(x_NC.reshape(-1, self.width)) if self.postshuffle else self.norm(x_NC)
        x, _ = self.fc1(x.reshape(-1, 1, self.width))  # [U, 1, width]
        x, _ = self.fc2(F.gelu(x))
        return x[:, 0]


class VisionTower(MegatronModule):
    """Qwen3-VL vision encoder: Conv3d patches + interpolated learned positions, 2D RoPE, full attention within
    each frame, the merger, and one DeepStack merger per tapped block."""

    rope_kernel = "torch"  # train.rope_kernel: triton = the context rotates q and k (models/triton_rope.py)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, tp: int, meta: bool = False):
        tc = vision_transformer_config(cfg, dtype, tp, meta)
        super().__init__(config=tc)
        v = self.v = cfg.vision
        k = (v.temporal_patch_size, v.patch_size, v.patch_size)
        self.patch_embed = torch.nn.Conv3d(v.in_channels, v.hidden_size, kernel_size=k, stride=k, bias=True,
                                           dtype=dtype)
        self.pos_embed = torch.nn.Embedding(v.num_position_embeddings, v.hidden_size, dtype=dtype)
        self.blocks = TransformerBlock(config=tc, spec=layer_spec(False, "LayerNorm", False), post_layer_norm=False,
                                       pre_process=True, post_process=False)
        for m in self.blocks.modules():
            # megatron's local spec builds torch's LayerNorm with fp32 weights; CUDA's layer_norm takes no weights of
            # another dtype than its input (CPU's does), so they are held in the tower's dtype, as HF holds them
            if isinstance(m, torch.nn.LayerNorm):
                m.to(dtype)
        merger = lambda post: PatchMerger(tc, v.hidden_size, v.out_hidden_size, v.spatial_merge_size, post)  # noqa
        self.merger = merger(False)
        self.deepstack_mergers = torch.nn.ModuleList(merger(True) for _ in v.deepstack_visual_indexes)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C*T*p*p] -> merged embeddings [U, H] in the processor's token order."""
        return self.features(pixel_values, grid_thw)[0]

    def features(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Merged embeddings [U, H] and the DeepStack features [U, H] of each tapped block, in tap order."""
        v = self.v
        grid_thw = grid_thw.cpu().long()
        n_expected = int(grid_thw.prod(-1).sum())
        if pixel_values.shape[0] != n_expected:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches, grid_thw needs {n_expected}")
        x = pixel_values.to(self.patch_embed.weight.dtype).view(
            -1, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
        x = self.patch_embed(x).view(-1, v.hidden_size)
        plan = P.vision_plan(grid_thw, v.spatial_merge_size, v.hidden_size // v.num_heads, v.rope_theta,
                             int(v.num_position_embeddings ** 0.5))
        dev = x.device
        blend = self.pos_embed(host_constant(plan.interp_index_N4, dev)) * host_constant(plan.interp_weight_N4,
                                                                                        dev)[..., None].to(x.dtype)
        x = x + blend.sum(1)
        ctx = SegmentContext(cu=plan.cu_frames, device=dev)  # no [N, N] mask: attention within frames
        rot = host_constant(plan.rotary_N, dev)
        if self.rope_kernel == "triton":
            ctx.rotary, rot = rope_tables(rot, x.dtype), None
        taps, x = {}, x[:, None]
        for idx, layer in enumerate(self.blocks.layers):
            x, _ = layer(hidden_states=x, attention_mask=None, rotary_pos_emb=rot, packed_seq_params=ctx)
            if idx in v.deepstack_visual_indexes:
                taps[idx] = x[:, 0]
        deep = [m(taps[i]) for m, i in zip(self.deepstack_mergers, v.deepstack_visual_indexes)]
        return self.merger(x[:, 0]), deep


class Qwen3VLModel(Q25.Qwen25VLModel):
    """Qwen3-VL as one megatron module per pipeline stage (Qwen2.5-VL's stage, with its own tower, LLM layers,
    rotary and DeepStack). DeepStack's levels must lie on the first stage, which holds the vision tower."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, pre_process: bool = True,
                 post_process: bool = True, megatron: dict | None = None, meta: bool = False):
        tp = ps.get_tensor_model_parallel_world_size()
        pp = ps.get_pipeline_model_parallel_world_size()
        check_megatron_overrides(cfg, megatron or {})
        tc = TransformerConfig(**_llm_fields(cfg, dtype, tp, pp, meta), **(megatron or {}))
        check_deepstack_stage(cfg, tc)
        MegatronModule.__init__(self, config=tc)  # Qwen2.5-VL's __init__ builds its own tower and GPT
        self.cfg, self.pre_process, self.post_process = cfg, pre_process, post_process
        self.model_type = ModelType.encoder_or_decoder  # read by megatron's schedules
        self.padded_vocab = cfg.padded_vocab_size(tp)
        self.vision = VisionTower(cfg, dtype, tp, meta) if pre_process else None
        self._rope_tables: dict = {}  # {device: the LLM rotary's inverse frequencies and axes there} (`rotary`)
        # RoPE is ours (interleaved M-RoPE, `rotary`), so GPTModel builds none
        self.language_model = GPTModel(
            config=tc, transformer_layer_spec=layer_spec(True, "RMSNorm", True), vocab_size=self.padded_vocab,
            max_sequence_length=cfg.max_position_embeddings, pre_process=pre_process, post_process=post_process,
            share_embeddings_and_output_weights=cfg.tie_word_embeddings, position_embedding_type="none")
        if cfg.freeze_vision and self.vision is not None:
            self.vision.requires_grad_(False)

    def rotary(self, position_ids_3BS: torch.Tensor) -> torch.Tensor:
        """Interleaved M-RoPE angles [S,B,1,D] of position ids [3,B,S]."""
        dev = position_ids_3BS.device
        tables = self._rope_tables.get(dev)
        if tables is None:
            inv = P.llm_inv_freq(self.cfg.head_dim, self.cfg.rope_theta)
            tables = (host_constant(inv, dev), host_constant(P.mrope_axes(inv.numel(), list(self.cfg.mrope_section)),
                                                             dev))
            if not (dev.type == "cuda" and torch.cuda.is_current_stream_capturing()):
                # kept per device: a decode step's CUDA graph (captured after the step's eager run) copies nothing
                # from the host; a copy recorded inside a capture is not kept (it is filled only by replays)
                self._rope_tables[dev] = tables
        return P.mrope_interleaved_freqs(position_ids_3BS, *tables)

    def embed(self, input_ids, pixel_values=None, image_grid_thw=None, pixel_values_videos=None, video_grid_thw=None,
              check: bool = True) -> torch.Tensor:
        """Token embeddings [S,B,H] with image and video placeholders replaced by vision features."""
        return self.embed_deepstack(input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw,
                                    check)[0]

    def embed_deepstack(self, input_ids, pixel_values=None, image_grid_thw=None, pixel_values_videos=None,
                        video_grid_thw=None, check: bool = True) -> tuple[torch.Tensor, list | None]:
        """`embed`, and per DeepStack level the addend [S,B,H] of the layer that level follows: the level's features
        at the visual tokens, zeros elsewhere (None without vision inputs). `check`: see Qwen2.5-VL's `embed`."""
        if check and not Q25._capturing():
            check_placeholders(self.cfg, input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw)
        emb_BSH = self.language_model.embedding(input_ids=input_ids, position_ids=None).transpose(0, 1)
        deep = None
        for pix, grid, tok in ((pixel_values, image_grid_thw, self.cfg.image_token_id),
                               (pixel_values_videos, video_grid_thw, self.cfg.video_token_id)):
            if pix is None:
                continue
            feats, levels = self.vision.features(pix, grid)
            mask_BSH = (input_ids == tok)[..., None].expand_as(emb_BSH)
            emb_BSH = emb_BSH.masked_scatter(mask_BSH, feats.to(emb_BSH.dtype))
            added = [torch.zeros_like(emb_BSH).masked_scatter(mask_BSH, f.to(emb_BSH.dtype)) for f in levels]
            deep = added if deep is None else [a + b for a, b in zip(deep, added)]
        deep = None if deep is None else [d.transpose(0, 1).contiguous() for d in deep]
        return emb_BSH.transpose(0, 1).contiguous(), deep

    def forward(self, input_ids=None, position_ids=None, pixel_values=None, image_grid_thw=None,
                pixel_values_videos=None, video_grid_thw=None, decoder_input=None, attention_context=None,
                check: bool = True):
        """Per-stage forward: vocab-parallel logits [B,S,V/TP] on the last stage, else hidden [S,B,H]."""
        deep = None
        if self.pre_process and decoder_input is None:
            decoder_input, deep = self.embed_deepstack(input_ids, pixel_values, image_grid_thw, pixel_values_videos,
                                                       video_grid_thw, check)
        hidden = self._layers(decoder_input, position_ids, attention_context, deep)
        return self._logits(hidden) if self.post_process else hidden

    def forward_prefix(self, input_ids, position_ids, attention_context, input_tensor=None, pixel_values=None,
                       image_grid_thw=None, pixel_values_videos=None, video_grid_thw=None,
                       check: bool = True) -> torch.Tensor:
        """Prefix stage on this pipeline stage: decoder layers only (no logits), DeepStack included; [S,B,H]."""
        hidden, deep = None, None
        if self.pre_process:
            hidden, deep = self.embed_deepstack(input_ids, pixel_values, image_grid_thw, pixel_values_videos,
                                                video_grid_thw, check)
        else:
            self.language_model.decoder.set_input_tensor(input_tensor)
        return self._layers(hidden, position_ids, attention_context, deep)

    def forward_decode(self, input_ids, position_ids, attention_context, fused_layers: bool = False) -> torch.Tensor:
        """One decode step at pp=1 with RoPE left to the decode attention: logits [B,1,V/TP] (text only: no
        DeepStack). `fused_layers`: see Qwen2.5-VL's (the q/k norms stay megatron's)."""
        hidden = self.embed(input_ids, check=False)
        attention_context.rope = self.rotary(position_ids)[0, :, 0]
        return self._logits(Q25._decoder(self.language_model.decoder, hidden, attention_context, fused_layers))

    def prefix_stage(self, prompts, ctx, input_tensor=None) -> torch.Tensor:
        """The prefixes (prompt[:-1], vision included) of prompts packed one after another, on this stage."""
        if self.pre_process:
            for p in prompts:
                check_placeholders(self.cfg, p.input_ids[None, :-1], **{k: getattr(p, k) for k in VISION_KEYS})
        return self.forward_prefix(attention_context=ctx, input_tensor=input_tensor, check=False,
                                   **self.prefix_inputs(prompts, device()))

    def prefix_inputs(self, prompts, dev) -> dict:
        """`forward_prefix`'s inputs for prompts packed (Qwen2.5-VL's layout, with this family's positions)."""
        vis = {}
        for k in VISION_KEYS:
            ts = [getattr(p, k) for p in prompts if getattr(p, k) is not None]
            t = None if not ts else ts[0] if len(ts) == 1 else torch.cat(ts)
            vis[k] = t.to(dev) if t is not None and dev is not None and k.startswith("pixel") else t
        ids = torch.cat([p.input_ids[:-1] for p in prompts])[None]
        pos = torch.cat([P.prompt_positions(self.cfg, p)[:, :, :-1] for p in prompts], dim=-1)
        if dev is not None:
            ids, pos = ids.to(dev), pos.to(dev)
        return {"input_ids": ids, "position_ids": pos, **vis}

    def _layers(self, hidden, position_ids, attention_context, deep=None):
        """This stage's decoder layers (megatron's TransformerBlock.forward, unrolled), each DeepStack level added
        after the layer it follows, then the final norm on the last stage. `megatron.recompute_granularity=full`
        checkpoints them in the chunks TransformerBlock._checkpointed_forward uses (`recompute_chunks`)."""
        dec = self.language_model.decoder
        rope = self.rotary(position_ids)
        if self._context_rope(attention_context):
            attention_context.rotary, rope = rope_tables(rope, self.config.params_dtype), None
        if hidden is None:
            hidden = dec.input_tensor

        def chunk(first: int, last: int):
            def run(hidden, rope, *deep):  # the DeepStack addends are arguments: a checkpoint returns their grads
                for layer in dec.layers[first:last]:
                    hidden, _ = layer(hidden_states=hidden, attention_mask=None, rotary_pos_emb=rope,
                                      packed_seq_params=attention_context)
                    level = layer.layer_number - 1  # global, 0-based
                    if level < len(deep):
                        hidden = hidden + deep[level]
                return hidden
            return run

        c = dec.config
        for first, last, saved in recompute_chunks(c, len(dec.layers), dec.training):
            run = chunk(first, last)
            hidden = tensor_parallel.checkpoint(run, c.distribute_saved_activations, hidden, rope, *(deep or ())) \
                if saved else run(hidden, rope, *(deep or ()))
        if dec.final_layernorm is not None:
            hidden = dec.final_layernorm(hidden)
        return hidden


def recompute_chunks(config: TransformerConfig, n_layers: int, training: bool) -> list[tuple[int, int, bool]]:
    """(first, last, checkpointed) layer ranges of one stage, as megatron's TransformerBlock splits them for
    `recompute_granularity=full` in training (transformer_block.py, _checkpointed_forward): `uniform`, chunks of
    recompute_num_layers each checkpointed; `block`, the first recompute_num_layers layers checkpointed one by one.
    Selective recompute happens inside each layer, as in megatron's own loop."""
    k = config.recompute_num_layers
    if config.recompute_granularity != "full" or not training:
        return [(0, n_layers, False)]
    if config.recompute_method == "uniform":
        return [(i, min(i + k, n_layers), True) for i in range(0, n_layers, k)]
    if config.recompute_method == "block":
        return [(i, i + 1, True) for i in range(min(k, n_layers))] + ([(k, n_layers, False)] if k < n_layers else [])
    raise ValueError(f"megatron.recompute_method={config.recompute_method!r} is not uniform or block")


def build_model(cfg: ModelConfig, dtype: str | torch.dtype = "float32", megatron: dict | None = None,
                meta: bool = False) -> Qwen3VLModel:
    """Build this rank's stage of the model (megatron parallel state initialised); see Qwen2.5-VL's `build_model`."""
    dt = Q25._DTYPES[dtype] if isinstance(dtype, str) else dtype
    with torch.device("meta") if meta else nullcontext():
        model = Qwen3VLModel(cfg, dt, pre_process=ps.is_pipeline_first_stage(),
                             post_process=ps.is_pipeline_last_stage(), megatron=megatron, meta=meta)
    if meta:
        Q25._materialise_non_parameters(model)
    elif torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model
