"""Rank functions for the public-API test: a plain megatron-core GPTModel (local spec, RoPE), the
prefix/response path against the full-sequence path (run through `rollplex_megatron.dist.run_local`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

import rollplex_megatron as rpx
from rollplex_megatron.dist import init_parallel
from rollplex_megatron.prefix.batch import split_token_values
from rollplex_megatron.runtime import wrap_ddp
from tests.numerics import rel_err

VOCAB = 256


def build_gpt(tp: int, pp: int, tied: bool, parallel_output: bool = True,
              dtype: torch.dtype = torch.float32, qk_norm: bool = False) -> GPTModel:
    """A small GPT stage built the way a Megatron user builds one, with the prefix-attention spec. `qk_norm`: the
    layer of Qwen3's language model (per-head q/k RMSNorm, no QKV bias) instead of Qwen2.5's (QKV bias)."""
    cfg = TransformerConfig(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                            num_query_groups=2, normalization="RMSNorm", gated_linear_unit=True, qk_layernorm=qk_norm,
                            activation_func=F.silu, add_bias_linear=False, add_qkv_bias=not qk_norm,
                            hidden_dropout=0.0,
                            attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
                            masked_softmax_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
                            persist_layer_norm=False, use_cpu_initialization=not torch.cuda.is_available(),
                            init_method_std=0.3, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            params_dtype=dtype, pipeline_dtype=dtype, calculate_per_token_loss=True)
    spec = rpx.with_prefix_attention(get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_norm))
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=512,
                    pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=tied, position_embedding_type="rope",
                    parallel_output=parallel_output)


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (9, 14, 6)]
    responses = [[torch.randint(0, VOCAB, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g)
                  for _ in range(3)] for _ in prompts]
    adv = [0.5 + torch.randn(3, generator=g) for _ in prompts]
    return rpx.text_groups(prompts, responses, adv)


def _run(ddp, groups, kind: str, offset: int = 0, pack: int = 0):
    ddp.zero_grad_buffer()
    total = sum(r.numel() for grp in groups for r in grp.responses)
    if kind == "prefix":
        mbs = rpx.response_micro_batches(rpx.TEXT_POSITIONS, groups, 2, total, position_offset=offset)
        res = rpx.actor_prefix_step(ddp, groups, mbs, pack_tokens=pack)
    else:
        mbs = rpx.full_micro_batches(rpx.TEXT_POSITIONS, groups, 2, total)
        res = rpx.full_sequence_step(ddp, mbs)
    logp = split_token_values(res, mbs, groups) if ps.is_pipeline_last_stage() else {}
    grads = {n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters()}
    return logp, grads


def prefix_vs_full(tp: int, pp: int, tied: bool, seed: int, qk_norm: bool = False) -> dict:
    """Per rank: largest relative error of log-probs and of each parameter's gradient, prefix path
    vs full sequences; the same for a wrong response position offset (must be large)."""
    init_parallel(tp, pp, seed)
    # float64 weights and activations (megatron's DDP keeps its gradient buffers in fp32): at fp32 this
    # deliberately ill-conditioned model (init std 0.3) put the two paths' rounding at 1.07e-5 of a layer-0
    # gradient on an AMD EPYC, at the bound; in float64 the paths differ by ~1e-6 (the fp32 buffers), a
    # response position off by one by ~1
    torch.set_default_dtype(torch.float64)
    model = rpx.PrefixGPT(build_gpt(tp, pp, tied, dtype=torch.float64, qk_norm=qk_norm))
    ddp = wrap_ddp(model)
    groups = _batch(seed)
    full_lp, full_g = _run(ddp, groups, "full")
    out = {"stock_forward_err": None, "refuses_gathered_logits": not ps.is_pipeline_last_stage()}
    # on every rank: untied, no embedding-group sync
    gathered = build_gpt(tp, pp, False, parallel_output=False, qk_norm=qk_norm)
    try:
        rpx.PrefixGPT(gathered)
    except ValueError as e:
        out["refuses_gathered_logits"] = "parallel_output=True" in str(e)
    for name, offset, pack in (("exact", 0, 0), ("mutant", 1, 0), ("packed", 0, 100)):  # packed: 3 ragged prefixes
        lp, g = _run(ddp, groups, "prefix", offset, pack)
        keys = sorted(full_lp)
        out[name] = {"logp": rel_err(torch.cat([lp[k] for k in keys]), torch.cat([full_lp[k] for k in keys]))
                     if keys else 0.0,
                     "grad": max(rel_err(g[n], full_g[n]) for n in full_g), "grad_norm": float(
                         torch.stack([t.norm() for t in g.values()]).norm())}
    if pp == 1:  # PrefixGPT's RoPE at explicit positions = megatron's own forward on one sequence
        ids = torch.cat([groups[1].prompt.input_ids, groups[1].responses[0]])[None]
        with torch.no_grad():
            stock = model.gpt(input_ids=ids, position_ids=None, attention_mask=None)
            ours = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None])
        out["stock_forward_err"] = rel_err(ours, stock)
    return out
