"""The project's core-attention module for megatron layer specs (torch SDPA).

Legend: S = query length, K = key length, B = batch, Nq = query heads per TP rank,
Ng = KV groups per TP rank, D = head dim. Megatron hands post-RoPE `query [S,B,Nq,D]` and
`key/value [K,B,Ng,D]` (GQA not expanded) and expects `[S,B,Nq*D]` back. Megatron's mask
convention is kept: a boolean `attention_mask` is True where attention is *forbidden*.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from rollplex_megatron.attention.context import AttentionContext
from rollplex_megatron.spans import span


def causal_allowed(sq: int, sk: int, device=None) -> torch.Tensor:
    """[S,K] bool, True where query i may see key j; queries are the last `sq` positions of `sk`."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril(diagonal=sk - sq)


def sdpa_attention(
    query_SBND: torch.Tensor,
    key_KBGD: torch.Tensor,
    value_KBGD: torch.Tensor,
    allowed: torch.Tensor | None,
    causal: bool,
    scale: float | None,
) -> torch.Tensor:
    """Attention in megatron layout; `allowed` broadcasts to [B,N,S,K] (True = may attend).

    GQA is handled by SDPA's `enable_gqa`, so repeated K/V are never materialised.
    """
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query_SBND, key_KBGD, value_KBGD))
    sq, sk = q.shape[2], k.shape[2]
    plain_causal = causal and allowed is None and sq == sk  # lets SDPA pick its flash kernel
    if causal and not plain_causal:
        tri = causal_allowed(sq, sk, q.device)
        allowed = tri if allowed is None else (allowed & tri)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed, is_causal=plain_causal, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )
    b, n, s, d = out.shape
    return out.permute(2, 0, 1, 3).reshape(s, b, n * d)


class SDPACoreAttention(MegatronModule):
    """`core_attention` for megatron's SelfAttention (the CoreAttention protocol), via torch SDPA.

    Causal layers (the LLM) use a right-aligned causal mask, so queries shorter than keys (a
    response attending to a prefix, decode with a cache) are handled. Non-causal layers (the
    vision tower) use the block-diagonal mask passed as `attention_mask`.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size > 1:
            raise ValueError("SDPACoreAttention does not support context parallelism (context_parallel_size>1)")
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        """Megatron layout in, `[S,B,Nq*D]` out."""
        if isinstance(packed_seq_params, AttentionContext):
            with span(packed_seq_params.part):
                return packed_seq_params.attend(self.layer_number, query, key, value, self.softmax_scale)
        if packed_seq_params is not None:
            raise NotImplementedError("SDPACoreAttention: packed_seq_params (THD) is not supported")
        if attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention: attention_bias is not supported")
        if self.training and self.dropout_p > 0:
            raise NotImplementedError("SDPACoreAttention: attention dropout is not supported")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        allowed = None if attention_mask is None else ~attention_mask
        causal = mask_type == AttnMaskType.causal
        return sdpa_attention(query, key, value, allowed, causal, self.softmax_scale)
