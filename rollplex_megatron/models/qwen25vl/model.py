"""Qwen2.5-VL on megatron-core: vision tower + merger, and the M-RoPE LLM (GPTModel).

Built from megatron-core parts: TransformerConfig, the local (non-TE) layer spec with the project's
SDPA core attention, TransformerBlock, GPTModel and tensor-parallel linears. The vision tower sits
on the first pipeline stage; the LLM is split over pipeline stages by GPTModel.
Legend: S = text sequence, B = batch, H = LLM width, N = vision patches, U = merge units.
"""
from __future__ import annotations

import copy
import dataclasses
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.enums import ModelType
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

from rollplex_megatron.attention import SDPACoreAttention
from rollplex_megatron.attention.prefix import PrefixContext, SegmentContext
from rollplex_megatron.config import ModelConfig
from rollplex_megatron.models.decode_layers import decode_layers
from rollplex_megatron.models.qwen25vl import positions as P
from rollplex_megatron.models.triton_rope import rope_tables
from rollplex_megatron.runtime import device, host_constant

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _common_tc(dtype: torch.dtype, tp: int, meta: bool = False) -> dict:
    """TransformerConfig fields shared by the LLM and the vision tower (no fused CUDA kernels).
    `meta`: parameters are created without a device (on the meta device under `build_model(meta=True)`)
    and not initialised."""
    return dict(
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_qkv_bias=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=meta or not torch.cuda.is_available(),
        perform_initialization=not meta,
        tensor_model_parallel_size=tp,
        sequence_parallel=False,
    )


def _llm_fields(cfg: ModelConfig, dtype: torch.dtype, tp: int, pp: int, meta: bool = False) -> dict:
    """The TransformerConfig fields this project sets for the LLM decoder (from its own settings)."""
    return dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.head_dim,
        layernorm_epsilon=cfg.rms_norm_eps,
        add_bias_linear=False,
        mrope_section=list(cfg.mrope_section),
        pipeline_model_parallel_size=pp,
        # Losses arrive pre-normalised by the global token count: the schedule must not divide by
        # tokens or micro-batches, and DDP must sum (not average) over data-parallel ranks.
        calculate_per_token_loss=True,
        **_common_tc(dtype, tp, meta),
    )


# TransformerConfig fields that give pipeline stages unequal layer counts (megatron's uneven split)
UNEVEN_SPLIT_SETTINGS = ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
                         "pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
                         "account_for_loss_in_pipeline_split")


def check_megatron_overrides(cfg: ModelConfig, overrides: dict, llm_fields=None) -> None:
    """`megatron.*` names TransformerConfig fields that no other setting owns (bad input fails here); `llm_fields`:
    the family's own TransformerConfig fields (default this family's)."""
    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"megatron.{unknown[0]} is not a field of megatron-core's TransformerConfig; the "
                         f"`megatron:` subtree passes TransformerConfig fields through to the LLM decoder")
    owned = sorted(set(overrides) & set((llm_fields or _llm_fields)(cfg, torch.float32, 1, 1)))
    if owned:
        raise ValueError(f"megatron.{owned[0]} is set by this project from its own settings (model.*, parallel.*, "
                         f"dtype, the loss contract); change those instead")
    uneven = [k for k in UNEVEN_SPLIT_SETTINGS if overrides.get(k) not in (None, False)]
    if uneven:
        raise ValueError(f"megatron.{uneven[0]} splits the decoder's layers unevenly over pipeline stages, which the "
                         f"weight layout, the memory planner and the KV budget do not follow (each stage holds "
                         f"model.num_layers / parallel.pp layers); drop it")


def llm_transformer_config(cfg: ModelConfig, dtype: torch.dtype, tp: int, pp: int,
                           overrides: dict | None = None, meta: bool = False) -> TransformerConfig:
    """TransformerConfig of the LLM decoder (GQA, QKV bias, no other biases, M-RoPE), plus the
    `megatron:` pass-through fields."""
    check_megatron_overrides(cfg, overrides or {})
    return TransformerConfig(**_llm_fields(cfg, dtype, tp, pp, meta), **(overrides or {}))


def vision_transformer_config(cfg: ModelConfig, dtype: torch.dtype, tp: int, meta: bool = False) -> TransformerConfig:
    """TransformerConfig of the vision blocks (MHA, biases everywhere, never pipelined)."""
    v = cfg.vision
    return TransformerConfig(
        num_layers=v.depth,
        hidden_size=v.hidden_size,
        ffn_hidden_size=cfg.padded_vision_ffn(tp),
        num_attention_heads=v.num_heads,
        num_query_groups=v.num_heads,
        kv_channels=v.hidden_size // v.num_heads,
        layernorm_epsilon=v.rms_norm_eps,
        add_bias_linear=True,
        pipeline_model_parallel_size=1,
        **_common_tc(dtype, tp, meta),
    )


def layer_spec(causal: bool):
    """Megatron's local layer spec with the project's SDPA core attention."""
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization="RMSNorm"))
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    spec.submodules.self_attention.params = {
        "attn_mask_type": AttnMaskType.causal if causal else AttnMaskType.no_mask
    }
    return spec


class VisionBlocks(TransformerBlock):
    """TransformerBlock whose layers alternate window and full attention masks."""

    def __init__(self, config: TransformerConfig, spec, fullatt_block_indexes: list[int]):
        super().__init__(config=config, spec=spec, post_layer_norm=False, pre_process=True,
                         post_process=False)
        self.fullatt = set(fullatt_block_indexes)

    def forward(self, hidden_NBH, full_ctx, window_ctx, rotary_NB1D):  # noqa: D102
        for idx, layer in enumerate(self.layers):
            ctx = full_ctx if idx in self.fullatt else window_ctx
            hidden_NBH, _ = layer(hidden_states=hidden_NBH, attention_mask=None,
                                  rotary_pos_emb=rotary_NB1D, packed_seq_params=ctx)
        return hidden_NBH


class PatchMerger(MegatronModule):
    """RMSNorm, fold merge**2 patches, then Linear-GELU-Linear (column then row parallel)."""

    def __init__(self, config: TransformerConfig, context_dim: int, out_dim: int, merge: int, eps: float):
        super().__init__(config=config)
        self.width = context_dim * merge * merge
        self.ln_q = torch.nn.RMSNorm(context_dim, eps=eps, dtype=config.params_dtype)
        init = config.init_method
        self.fc1 = tensor_parallel.ColumnParallelLinear(
            self.width, self.width, config=config, init_method=init, bias=True, gather_output=False)
        self.fc2 = tensor_parallel.RowParallelLinear(
            self.width, out_dim, config=config, init_method=init, bias=True,
            input_is_parallel=True, skip_bias_add=False)

    def forward(self, x_NC: torch.Tensor) -> torch.Tensor:  # noqa: D102
        x = self.ln_q(x_NC).view(-1, 1, self.width)  # [U, 1, width]
        x, _ = self.fc1(x)
        x, _ = self.fc2(F.gelu(x))
        return x[:, 0]


class VisionTower(MegatronModule):
    """Qwen2.5-VL vision encoder: Conv3d patches, 2D RoPE, window/full attention, 2x2 merger."""

    rope_kernel = "torch"  # train.rope_kernel: triton = the contexts rotate q and k (models/triton_rope.py)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, tp: int, meta: bool = False):
        tc = vision_transformer_config(cfg, dtype, tp, meta)
        super().__init__(config=tc)
        v = cfg.vision
        self.v = v
        k = (v.temporal_patch_size, v.patch_size, v.patch_size)
        self.patch_embed = torch.nn.Conv3d(v.in_channels, v.hidden_size, kernel_size=k, stride=k,
                                           bias=False, dtype=dtype)
        self.blocks = VisionBlocks(tc, layer_spec(causal=False), list(v.fullatt_block_indexes))
        self.merger = PatchMerger(tc, v.hidden_size, v.out_hidden_size, v.spatial_merge_size,
                                  v.rms_norm_eps)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C*T*p*p] -> merged embeddings [U, H] in the processor's token order."""
        v = self.v
        grid_thw = grid_thw.cpu().long()
        n_expected = int(grid_thw.prod(-1).sum())
        if pixel_values.shape[0] != n_expected:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches, grid_thw needs {n_expected}")
        x = pixel_values.to(self.patch_embed.weight.dtype).view(
            -1, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
        x = self.patch_embed(x).view(-1, v.hidden_size)
        # index tensors are planned on the host from the (host) grid, once per distinct grids (`P.vision_plan`), and
        # copied to the device; nothing here reads the device back, so the tower can be issued ahead of its kernels
        plan = P.vision_plan(grid_thw, v.spatial_merge_size, v.window_size, v.patch_size, v.hidden_size // v.num_heads,
                             v.rope_theta)
        # Windows never cross frames and keep frame order, so per-frame full attention is also
        # attention within contiguous segments in window order; no [N, N] mask is built.
        full = SegmentContext(cu=plan.cu_full, device=x.device)
        window = SegmentContext(cu=plan.cu_window, device=x.device)
        rot = host_constant(plan.rotary_N, x.device)
        if self.rope_kernel == "triton":  # one cos/sin table for all blocks, applied by the contexts' kernel
            full.rotary = window.rotary = rope_tables(rot, x.dtype)
            rot = None
        x = self.blocks(x[host_constant(plan.order_N, x.device)][:, None], full, window, rot)
        merged = self.merger(x[:, 0])
        return merged[host_constant(plan.inverse_U, merged.device)]


class Qwen25VLModel(MegatronModule):
    """Qwen2.5-VL as one megatron module per pipeline stage.

    First stage: vision tower and token embedding; vision embeddings replace the image/video
    placeholder tokens. Last stage: output logits, with the padded vocabulary masked out.
    `rope_kernel` (train.rope_kernel, `use_rope_kernel`): "triton" gives a forward with an attention context
    (a PrefixContext) no rotary embedding in the layers and the context the forward's cos/sin tables (its attention
    rotates q and k with one kernel each, megatron's roundings); "torch" is megatron's own rotary.
    """

    rope_kernel = "torch"

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                 pre_process: bool = True, post_process: bool = True, megatron: dict | None = None,
                 meta: bool = False):
        tp = ps.get_tensor_model_parallel_world_size()
        pp = ps.get_pipeline_model_parallel_world_size()
        tc = llm_transformer_config(cfg, dtype, tp, pp, megatron, meta)
        super().__init__(config=tc)
        self.cfg, self.pre_process, self.post_process = cfg, pre_process, post_process
        self.model_type = ModelType.encoder_or_decoder  # read by megatron's schedules
        self.padded_vocab = cfg.padded_vocab_size(tp)
        self.vision = VisionTower(cfg, dtype, tp, meta) if pre_process else None
        self.language_model = GPTModel(
            config=tc, transformer_layer_spec=layer_spec(causal=True),
            vocab_size=self.padded_vocab, max_sequence_length=cfg.max_position_embeddings,
            pre_process=pre_process, post_process=post_process,
            share_embeddings_and_output_weights=cfg.tie_word_embeddings,
            position_embedding_type="mrope", rotary_base=int(cfg.rope_theta))
        if cfg.freeze_vision and self.vision is not None:
            self.vision.requires_grad_(False)

    @property
    def share_embeddings_and_output_weights(self) -> bool:
        """Read by megatron's finalize_model_grads (tied-embedding gradient sync over PP)."""
        return self.language_model.share_embeddings_and_output_weights

    def shared_embedding_or_output_weight(self):
        """The tied weight on this stage (embedding on the first, output copy on the last)."""
        return self.language_model.shared_embedding_or_output_weight()

    def set_input_tensor(self, input_tensor) -> None:
        """Pipeline hook: the activation received from the previous stage."""
        self.language_model.set_input_tensor(input_tensor)

    def embed(self, input_ids, pixel_values=None, image_grid_thw=None,
              pixel_values_videos=None, video_grid_thw=None, check: bool = True) -> torch.Tensor:
        """Token embeddings [S,B,H] with image and video placeholders replaced by vision features.

        `check`: compare placeholder tokens with the vision inputs here (`check_placeholders`; a
        host read of `input_ids`). Callers that checked the host copy already pass False, so the
        forward issues without waiting on the device. Skipped while a CUDA graph is captured (decode,
        after an eager warm-up that checked)."""
        if check and not _capturing():
            check_placeholders(self.cfg, input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw)
        emb_BSH = self.language_model.embedding(input_ids=input_ids, position_ids=None).transpose(0, 1)
        for pix, grid, tok in ((pixel_values, image_grid_thw, self.cfg.image_token_id),
                               (pixel_values_videos, video_grid_thw, self.cfg.video_token_id)):
            if pix is None:
                continue
            feats = self.vision(pix, grid).to(emb_BSH.dtype)
            mask_BS = input_ids == tok
            emb_BSH = emb_BSH.masked_scatter(mask_BS[..., None].expand_as(emb_BSH), feats)
        return emb_BSH.transpose(0, 1).contiguous()

    def mask_padded_vocab(self, logits_BSV: torch.Tensor) -> torch.Tensor:
        """Set this TP rank's padded-vocabulary columns to the dtype minimum (never sampled)."""
        local = logits_BSV.shape[-1]
        start = ps.get_tensor_model_parallel_rank() * local
        n_real = max(0, min(local, self.cfg.vocab_size - start))
        if n_real == local:
            return logits_BSV
        col = torch.arange(local, device=logits_BSV.device) >= n_real
        return logits_BSV.masked_fill(col, torch.finfo(logits_BSV.dtype).min)

    def forward(self, input_ids=None, position_ids=None, pixel_values=None, image_grid_thw=None,
                pixel_values_videos=None, video_grid_thw=None, decoder_input=None, attention_context=None,
                check: bool = True):
        """Per-stage forward: vocab-parallel logits [B,S,V/TP] on the last stage, else hidden [S,B,H].

        `attention_context` (a PrefixContext) reaches the core attention of every layer through
        megatron's `packed_seq_params` argument. `check`: see `embed`.
        """
        if self.pre_process and decoder_input is None:
            decoder_input = self.embed(input_ids, pixel_values, image_grid_thw,
                                       pixel_values_videos, video_grid_thw, check)
        if self._context_rope(attention_context):  # GPTModel.forward's steps, RoPE left to the context
            hidden = self._layers(decoder_input, position_ids, attention_context)
            return self._logits(hidden) if self.post_process else hidden
        out = self.language_model(input_ids=None, position_ids=position_ids, attention_mask=None,
                                  decoder_input=decoder_input, packed_seq_params=attention_context)
        return self.mask_padded_vocab(out) if self.post_process else out

    def forward_decode(self, input_ids, position_ids, attention_context, fused_layers: bool = False) -> torch.Tensor:
        """One decode step at pp=1 with RoPE left to the decode attention: logits [B,1,V/TP].

        The computation of `forward` on GPTModel's own modules (embedding, decoder, output layer),
        except that the decoder gets no rotary embedding and the step's rotary angles go to the context
        (`attention_context.rope`, [B, D]), whose attention applies them to the queries and keys as it
        writes the cache (one fused kernel instead of megatron's per-layer cos/sin and rotate-half; the same
        roundings, with CUDA's cos/sin, which differ from torch's in the last bits for large angles).
        `fused_layers`: the decoder's layers through `models.decode_layers` (the same modules' GEMMs, the glue
        between them fused; where `decode_layers.unsupported` is empty)."""
        lm = self.language_model
        hidden = self.embed(input_ids, None, None, None, None, check=False)
        attention_context.rope = lm.rotary_pos_emb(position_ids, lm.mrope_section)[0, :, 0]
        return self._logits(_decoder(lm.decoder, hidden, attention_context, fused_layers))

    def _logits(self, hidden_SBH):
        """GPTModel's output layer (tied weight or its own) on the last stage: masked logits [B,S,V/TP]."""
        lm = self.language_model
        weight = lm.shared_embedding_or_output_weight() if lm.share_embeddings_and_output_weights else None
        logits, _ = lm.output_layer(hidden_SBH, weight=weight)
        return self.mask_padded_vocab(logits.transpose(0, 1).contiguous())

    def prefix_stage(self, prompts, ctx, input_tensor=None) -> torch.Tensor:
        """The prefixes (prompt[:-1], vision included) of a list of prompts packed one after another, on this
        stage: [sum(P-1),1,H] (the PrefixModel contract of prefix/execution.py)."""
        return _placeholder_check_then_prefix(self, prompts, ctx, input_tensor)

    def prefix_inputs(self, prompts, dev) -> dict:
        """`forward_prefix`'s inputs for prompts packed (module function `prefix_inputs`)."""
        return prefix_inputs(self, prompts, dev)

    def forward_prefix(self, input_ids, position_ids, attention_context, input_tensor=None,
                       pixel_values=None, image_grid_thw=None, pixel_values_videos=None,
                       video_grid_thw=None, check: bool = True) -> torch.Tensor:
        """Prefix stage on this pipeline stage: decoder layers only (no logits); returns [S,B,H].

        First stage: embeddings (vision included). Later stages: `input_tensor` from the previous one.
        """
        lm = self.language_model
        if self.pre_process:
            hidden = self.embed(input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw, check)
        else:
            lm.decoder.set_input_tensor(input_tensor)
            hidden = None
        return self._layers(hidden, position_ids, attention_context)

    def _context_rope(self, attention_context) -> bool:
        """Whether this forward's RoPE runs in the attention context (train.rope_kernel=triton): the training
        and prefill contexts; a decode step's context rotates by its own angles (`forward_decode`)."""
        return self.rope_kernel == "triton" and isinstance(attention_context, PrefixContext)

    def _layers(self, hidden, position_ids, attention_context):
        """The decoder's layers on this stage, with megatron's rotary or the context's (`_context_rope`)."""
        lm = self.language_model
        rope = lm.rotary_pos_emb(position_ids, lm.mrope_section)
        if self._context_rope(attention_context):
            attention_context.rotary = rope_tables(rope, self.config.params_dtype)
            rope = None
        return lm.decoder(hidden_states=hidden, attention_mask=None, rotary_pos_emb=rope,
                          packed_seq_params=attention_context)


VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


def _decoder(decoder, hidden_1BH, ctx, fused_layers: bool) -> torch.Tensor:
    """A decode step's decoder (RoPE in the context `ctx`): megatron's TransformerBlock, or with `fused_layers`
    the same layers' modules with the glue fused (`decode_layers`); final norm included."""
    if fused_layers:
        return decode_layers(decoder, hidden_1BH, ctx)
    return decoder(hidden_states=hidden_1BH, attention_mask=None, rotary_pos_emb=None, packed_seq_params=ctx)


def _placeholder_check_then_prefix(m, prompts, ctx, input_tensor):
    """The prefix stage of one or several prompts, packed (Qwen25VLModel.prefix_stage's body): the placeholder
    check on the host prompts, then `forward_prefix` on `prefix_inputs`."""
    if m.pre_process:
        for p in prompts:
            check_placeholders(m.cfg, p.input_ids[None, :-1], **{k: getattr(p, k) for k in VISION_KEYS})
    return m.forward_prefix(attention_context=ctx, input_tensor=input_tensor, check=False,
                            **prefix_inputs(m, prompts, device()))


def prefix_inputs(m, prompts, dev) -> dict:
    """`forward_prefix`'s inputs for one or several prompts packed: ids and M-RoPE positions of each
    prompt[:-1] in order, its images and videos concatenated in the same order (the embedding fills placeholders
    in token order), positions restarting at each prompt. Ids, positions and pixels on the device; grids stay on
    the host (the vision tower plans its windows there), so the stage issues without reading the device back,
    and a CUDA graph of it (`prefix/graphs.py`) replays on new inputs copied into these tensors. `dev` None:
    ids and positions on the host, pixels where the prompts hold them (what a replay copies in)."""
    vis = {}
    for k in VISION_KEYS:
        ts = [getattr(p, k) for p in prompts if getattr(p, k) is not None]
        t = None if not ts else ts[0] if len(ts) == 1 else torch.cat(ts)
        vis[k] = t.to(dev) if t is not None and dev is not None and k.startswith("pixel") else t
    ids = torch.cat([p.input_ids[:-1] for p in prompts])[None]
    pos = torch.cat([P.prompt_positions(m.cfg, p)[:, :, :-1] for p in prompts], dim=-1)
    if dev is None:
        return {"input_ids": ids, "position_ids": pos, **vis}
    return {"input_ids": ids.to(dev), "position_ids": pos.to(dev), **vis}


def check_placeholders(cfg: ModelConfig, input_ids, pixel_values, image_grid_thw, pixel_values_videos,
                       video_grid_thw) -> None:
    """Image/video placeholder tokens in `input_ids` against the vision inputs (their grids give the
    merged embedding count); raises ValueError naming the mismatch. Reads `input_ids` on the host."""
    merge2 = cfg.vision.spatial_merge_size ** 2
    for pix, grid, tok, what in ((pixel_values, image_grid_thw, cfg.image_token_id, "image"),
                                 (pixel_values_videos, video_grid_thw, cfg.video_token_id, "video")):
        n = int((input_ids == tok).sum())
        if pix is None:
            if n:
                raise ValueError(f"input_ids hold {what} tokens but no {what} pixels were given")
            continue
        expect = int(grid.long().prod(-1).sum()) // merge2
        if n != expect:
            raise ValueError(f"{n} {what} tokens but the {what} grids give {expect} embeddings")


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def build_model(cfg: ModelConfig, dtype: str | torch.dtype = "float32", megatron: dict | None = None,
                meta: bool = False) -> Qwen25VLModel:
    """Build this rank's stage of the model (megatron parallel state must be initialised);
    `megatron`: TransformerConfig fields passed through to the LLM decoder (`megatron:` subtree).
    `meta`: parameters on the meta device, allocating nothing, for a model whose weights are bound to
    other storage afterwards (the rollout model on the training weights, weights/share.py); the small
    non-parameter tensors (rotary frequencies) are on the compute device."""
    dt = _DTYPES[dtype] if isinstance(dtype, str) else dtype
    with torch.device("meta") if meta else nullcontext():
        model = Qwen25VLModel(cfg, dt, pre_process=ps.is_pipeline_first_stage(),
                              post_process=ps.is_pipeline_last_stage(), megatron=megatron, meta=meta)
    if meta:
        _materialise_non_parameters(model)
    elif torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def _materialise_non_parameters(model: torch.nn.Module) -> None:
    """Move a meta-built model's buffers and tensor attributes to the compute device (rotary inverse
    frequencies are plain attributes built on the host by cpu initialisation); a meta buffer is an error."""
    dev = device()
    for mod in model.modules():
        for name, buf in list(mod.named_buffers(recurse=False)):
            if buf.is_meta:
                raise RuntimeError(f"buffer {name} of {type(mod).__name__} was created on the meta device; it "
                                   f"needs a value before the model runs")
            mod._buffers[name] = buf.to(dev)
        for name, val in list(vars(mod).items()):
            if isinstance(val, torch.Tensor) and not isinstance(val, torch.nn.Parameter):
                if val.is_meta:
                    raise RuntimeError(f"tensor {name} of {type(mod).__name__} was created on the meta device")
                setattr(mod, name, val.to(dev))


def gather_vocab_logits(logits_BSV: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """All-gather vocab-parallel logits over TP and drop the padding: [B,S,vocab_size]."""
    full = tensor_parallel.gather_from_tensor_model_parallel_region(logits_BSV)
    return full[..., :vocab_size]
