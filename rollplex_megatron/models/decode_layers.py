"""A decode step's decoder layers with the glue between megatron's GEMMs fused: both families' `forward_decode`.

Legend: B = the step's samples, H = hidden size, Ng = KV groups per TP rank, rep = query heads per group,
D = head dim.

megatron's TransformerLayer runs 18 kernels per layer of a decode step (3B on one H200,
`decode_step_profile_kernels_3b_49dbd3f.json`; the small ones ~2-3 us each in a graph at batch 8): the input
norm, linear_qkv (its GEMM, then its bias as an elementwise add), a copy of the queries
(`get_query_key_value_tensors` reshapes a strided view), the context's RoPE and cache write and its 3 attention
kernels, linear_proj (GEMM and split-K reduce), the bias-dropout-add (an in-place add), the pre-MLP norm,
linear_fc1, silu of the gate half, `up + glu_linear_offset` (an add of 0.0, which copies the strided half), their
product, linear_fc2 and the second in-place add. `decode_layers` runs each layer's own linear modules
(linear_qkv, linear_proj, linear_fc1, linear_fc2: TP all-reduces and the split-GEMM executor of weights/split.py
apply as in the module path) and its core attention, and fuses the rest (`models/triton_layer.py`): each residual
add with the norm after it (the pre-MLP norm, the next layer's input norm, after the last layer the final norm),
the gated activation in one kernel, and the queries read by group from linear_qkv's output (no copy): 13 kernels.
Qwen3's per-head query and key norms read linear_qkv's output in place (`triton_rms_norm_grouped`: one kernel
each, where megatron's `get_query_key_value_tensors` copies the queries and torch's composite RMSNorm runs about
seven kernels per norm; the module path of a decode step runs the same norm kernel, `rollout/triton_norm.py`).
Left as it is: linear_qkv's bias add (inside the module, which a second thread's prefix stage shares).

The GEMMs: the modules' own (cuBLAS), or at steps of at most `SMALL_M` samples Triton kernels
(`models/triton_linear.py`) by `rollout.decode_gemm` (the context's `gemm`): `gated`, linear_fc1 with the gated
activation in one kernel (`small_m_gated`: on an H100 at batch 8 32.7 us a layer against cuBLAS and the
activation's 36.5, `decode_kernel_shapes_h100_d21eb1e.json`); `all`, also linear_qkv, linear_proj and linear_fc2 as
`small_m_linear` on each module's weight, with the module's bias (linear_qkv's bias add with it, in the module's
rounding order) and its TP all-reduce (there cuBLAS was as fast or faster: 6.5 against 7.4 us for linear_qkv, 19.9
against 20.5 for linear_fc2); a module that
is not a plain TP linear (the split-GEMM executor's, sequence parallel, a gathered output) keeps its forward.
That GEMM sums in another order than cuBLAS, so the step equals the modules' within rounding, not bit for bit.

Exactness: every kernel rounds where torch's ops round (the adds: one rounding of the fp32 sum; the norms: the
decode norm kernel's arithmetic; the activation: torch's silu, add and product), so a bf16 step gives the module
path's bits; in fp32 on CPU the interpreter's exp (numpy's) can differ from torch's in the last bit.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from megatron.core.transformer.mlp import MLP

from rollplex_megatron.models.triton_layer import add_rms_norm, silu_mul
from rollplex_megatron.models.triton_linear import GATED_CONFIG, SMALL_M, gemm_config, small_m_gated, small_m_linear
from rollplex_megatron.models.triton_norm import default_eps, triton_rms_norm, triton_rms_norm_grouped


def decode_layers(decoder, hidden_1BH: torch.Tensor, ctx) -> torch.Tensor:
    """megatron's TransformerBlock on a decode step's hidden states [1,B,H] (the embeddings) whose RoPE the
    attention context `ctx` applies, final norm included: [1,B,H]. `unsupported(model)` says where it applies."""
    layers, first = decoder.layers, decoder.layers[0].input_layernorm
    residual, x = hidden_1BH, triton_rms_norm(hidden_1BH, first.weight, default_eps(first.eps))
    for i, layer in enumerate(layers):
        residual, x = _add_norm(_attention(layer.self_attention, x, ctx), residual, layer.pre_mlp_layernorm)
        after = layers[i + 1].input_layernorm if i + 1 < len(layers) else decoder.final_layernorm
        residual, x = _add_norm(_mlp(layer.mlp, x, ctx), residual, after)
    return x


def _add_norm(x_1BH, residual_1BH, norm):
    """megatron's residual add (bias-dropout-add without bias or dropout) and the norm after it: (h, norm(h))."""
    return add_rms_norm(x_1BH, residual_1BH, norm.weight, default_eps(norm.eps))


def _attention(attn, x_1BH, ctx):
    """SelfAttention.forward of a decode step: q, k, v, the context's attention, linear_proj (its all-reduce)."""
    q, k, v = _split_qkv(attn, x_1BH, ctx)
    if _present(attn.q_layernorm):  # Qwen3's per-head norms, read in place from linear_qkv's output
        q = triton_rms_norm_grouped(q, attn.q_layernorm.weight, default_eps(attn.q_layernorm.eps))
    if _present(attn.k_layernorm):
        k = triton_rms_norm(k, attn.k_layernorm.weight, default_eps(attn.k_layernorm.eps))
    out = attn.core_attention(q, k, v, None, packed_seq_params=ctx)
    return _linear(attn.linear_proj, out, ctx)


def _split_qkv(attn, x_1BH, ctx=None):
    """linear_qkv's output as views: queries [1,B,Ng,rep,D] by KV group, keys and values [1,B,Ng,D]
    (megatron's split, without the copy its reshape of the queries to [1,B,Nq,D] makes)."""
    mixed = _linear(attn.linear_qkv, x_1BH, ctx)  # [1, B, Ng * (rep + 2) * D], the bias added as the module does
    ng, d = attn.num_query_groups_per_partition, attn.hidden_size_per_attention_head
    rep = attn.num_attention_heads_per_partition // ng
    g = mixed.view(*mixed.shape[:2], ng, (rep + 2) * d)
    return g[..., :rep * d].unflatten(-1, (rep, d)), g[..., rep * d:(rep + 1) * d], g[..., (rep + 1) * d:]


def _mlp(mlp, x_1BH, ctx=None):
    """megatron's gated MLP: linear_fc1, silu(gate) * (up + glu_linear_offset) in one kernel, linear_fc2; under
    decode_gemm gated or all linear_fc1 and the activation as one kernel (`small_m_gated`, the same bits as
    small_m_linear then silu_mul)."""
    fc1, offset = mlp.linear_fc1, mlp.config.glu_linear_offset
    if _gemm_on(fc1, x_1BH, ctx, ("gated", "all")) and (fc1.bias is None or fc1.skip_bias_add):
        act = small_m_gated(x_1BH, fc1.weight, offset, **GATED_CONFIG)
    else:
        act = silu_mul(_linear(fc1, x_1BH, ctx), offset)
    return _linear(mlp.linear_fc2, act, ctx)


def _gemm_on(module, x, ctx, choices=("all",)) -> bool:
    """Whether `module` runs as a Triton kernel: the context's gemm is one of `choices`, at most SMALL_M rows, no
    gemm_gap."""
    return getattr(ctx, "gemm", "torch") in choices and x.numel() // x.shape[-1] <= SMALL_M and not gemm_gap(module)


def _linear(module, x, ctx):
    """module(x)'s output (its bias added, as the forward adds it where it does not skip it): the module's forward,
    or under the context's `gemm == "all"` and at most SMALL_M rows `small_m_linear` on its weight (see the
    module doc), where `gemm_gap(module)` is empty."""
    if not _gemm_on(module, x, ctx):
        return module(x)[0]
    w = module.weight
    cfg = gemm_config(*w.shape)
    bias = None if module.skip_bias_add else module.bias
    if isinstance(module, ColumnParallelLinear):
        return small_m_linear(x, w, bias, **cfg)
    y = reduce_from_tensor_model_parallel_region(small_m_linear(x, w, **cfg), group=module.tp_group)
    return y if bias is None else y + bias


def gemm_gap(module) -> str:
    """Why `module` runs its own forward under a Triton decode_gemm, or "" where the Triton kernel computes it:
    a column- or row-parallel linear with its own weight, its class's forward (not the split-GEMM executor's or a
    bound rollout model's), no sequence parallelism, no gathered output, an input already split for a row one."""
    if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
        return f"{type(module).__name__} is not a megatron tensor-parallel linear"
    if "forward" in vars(module) or type(module).forward not in (ColumnParallelLinear.forward,
                                                                 RowParallelLinear.forward):
        return "its forward is not megatron's ColumnParallelLinear / RowParallelLinear one (split GEMMs, a subclass)"
    if module.weight is None or module.weight.stride(-1) != 1:
        return "no weight of its own with unit column stride"
    if module.sequence_parallel or getattr(module, "explicit_expert_comm", False):
        return "sequence parallel or expert communication"
    if isinstance(module, ColumnParallelLinear) and module.gather_output:
        return "a gathered output"
    if isinstance(module, RowParallelLinear) and not module.input_is_parallel:
        return "an input it scatters itself"
    return ""


def _present(module) -> bool:
    return module is not None and not isinstance(module, IdentityOp)


def _config_gap(c, tp: int) -> str:
    """The first TransformerConfig setting whose layer computation `decode_layers` does not reproduce, or ""."""
    gaps = {"add_bias_linear": c.add_bias_linear, "gated_linear_unit=False": not c.gated_linear_unit,
            "activation_func other than silu": c.activation_func is not F.silu,
            "bias_activation_fusion": c.bias_activation_fusion, "use_te_activation_func": c.use_te_activation_func,
            "activation_func_clamp_value": c.activation_func_clamp_value is not None,
            "fp32_residual_connection": c.fp32_residual_connection,
            "apply_residual_connection_post_layernorm": c.apply_residual_connection_post_layernorm,
            "hidden_dropout": c.hidden_dropout != 0, "sequence_parallel": c.sequence_parallel,
            "fp8/fp4": bool(c.fp8 or c.fp4), "attention_output_gate": c.attention_output_gate,
            "inference_fuse_tp_communication": getattr(c, "inference_fuse_tp_communication", False),
            "no_rope_freq": bool(c.no_rope_freq), "num_query_groups < tp": c.num_query_groups < tp}
    return next((k for k, bad in gaps.items() if bad), "")


def unsupported(model) -> str:
    """Why `decode_layers` cannot run `model`'s decoder (a StageModel), or "" where it computes what the modules
    do: the config settings it does not reproduce, layers that are not plain attention + gated MLP, norms other
    than torch's RMSNorm with a weight, no final norm on this stage."""
    dec = model.language_model.decoder
    gap = _config_gap(dec.config, dec.config.tensor_model_parallel_size)
    if gap:
        return f"megatron.{gap}"
    norms = [n for layer in dec.layers for n in (layer.input_layernorm, layer.pre_mlp_layernorm)]
    if not dec.layers or not all(isinstance(n, torch.nn.RMSNorm) and n.weight is not None
                                 for n in norms + [dec.final_layernorm]):
        return "a decoder without layers, an RMSNorm without weight or no final norm on this stage"
    if any(type(layer.mlp) is not MLP or _present(layer.cross_attention) for layer in dec.layers):
        return "a layer other than self-attention and a dense MLP"
    qk = [n for layer in dec.layers for n in (layer.self_attention.q_layernorm, layer.self_attention.k_layernorm)
          if _present(n)]
    if not all(isinstance(n, torch.nn.RMSNorm) and n.weight is not None for n in qk):
        return "a per-head query or key norm other than torch's RMSNorm with a weight"
    return ""
