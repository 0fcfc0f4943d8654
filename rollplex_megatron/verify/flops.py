"""Analytic FLOPs of the full-sequence and prefix/response executions (matmuls and attention).

A multiply-add counts 2 FLOPs; backward costs twice the forward (weights and inputs). Attention
counts QK^T and AV over the attended (query, key) pairs only. Norms, activations, rotary and the
softmax are left out (small next to the matmuls).
"""
from __future__ import annotations

import torch

from rollplex_megatron.config import ModelConfig
from rollplex_megatron.models.registry import model_spec


def llm_dense_per_token(cfg: ModelConfig) -> float:
    """Forward FLOPs per token of all decoder layers' matmuls (no attention scores, no logits)."""
    # the query width is heads x head_dim, which need not be the hidden size (Qwen3-VL-4B: 4096 against 2560)
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_query_groups * cfg.head_dim
    per_layer = 2 * h * (q + 2 * kv) + 2 * q * h + 2 * 3 * h * cfg.ffn_hidden_size
    return per_layer * cfg.num_layers


def llm_attention(cfg: ModelConfig, pairs: float) -> float:
    """Forward FLOPs of QK^T and AV for `pairs` attended pairs in every layer."""
    return 4 * pairs * cfg.num_attention_heads * cfg.head_dim * cfg.num_layers


def logits(cfg: ModelConfig, tokens: int) -> float:
    """Forward FLOPs of the output layer on `tokens` tokens."""
    return 2 * cfg.hidden_size * cfg.vocab_size * tokens


def vision(cfg: ModelConfig, grids: torch.Tensor) -> float:
    """Forward FLOPs of the vision tower (patch embed, blocks, merger) on images/videos `grids` (its family's count)."""
    return model_spec(cfg).vision.flops(cfg, grids)


def _causal_pairs(n: int) -> float:
    return n * (n + 1) / 2


def full_sequence_fwd(cfg: ModelConfig, prompt_len: int, grids: torch.Tensor, resp_lens: list[int]) -> float:
    """Forward FLOPs of one group on the full-sequence path: every response with its whole prompt."""
    total = 0.0
    for r in resp_lens:
        seq = prompt_len + r - 1
        total += (llm_dense_per_token(cfg) * seq + llm_attention(cfg, _causal_pairs(seq))
                  + logits(cfg, seq) + vision(cfg, grids))
    return total


def prefix_fwd(cfg: ModelConfig, prompt_len: int, grids: torch.Tensor) -> float:
    """Forward FLOPs of one group's prefix stage: the vision tower and the LLM over prompt[:-1]."""
    pre = prompt_len - 1
    return llm_dense_per_token(cfg) * pre + llm_attention(cfg, _causal_pairs(pre)) + vision(cfg, grids)


def response_fwd(cfg: ModelConfig, prompt_len: int, resp_lens: list[int]) -> float:
    """Forward FLOPs of one group's response stage over its stored prefix (logits included)."""
    pre = prompt_len - 1
    return sum(llm_dense_per_token(cfg) * r + llm_attention(cfg, r * pre + _causal_pairs(r)) + logits(cfg, r)
               for r in resp_lens)


def prefix_response_fwd(cfg: ModelConfig, prompt_len: int, grids: torch.Tensor, resp_lens: list[int]) -> float:
    """Forward FLOPs of one group on the prefix/response path: prefix once, responses on top."""
    return prefix_fwd(cfg, prompt_len, grids) + response_fwd(cfg, prompt_len, resp_lens)


def batch_fwd_flops(cfg: ModelConfig, groups) -> dict:
    """Forward FLOPs of a batch of groups by part: whole sequences ("full"), the prefix stages
    ("prefix") and the response stages ("response"); the trainer records them every step."""
    out = {"full": 0.0, "prefix": 0.0, "response": 0.0}
    for g in groups:
        grids = [t for t in (g.prompt.image_grid_thw, g.prompt.video_grid_thw) if t is not None]
        grids = torch.cat(grids) if grids else torch.zeros(0, 3, dtype=torch.long)
        n, lens = g.prompt.input_ids.numel(), [int(r.numel()) for r in g.responses]
        out["full"] += full_sequence_fwd(cfg, n, grids, lens)
        out["prefix"] += prefix_fwd(cfg, n, grids)
        out["response"] += response_fwd(cfg, n, lens)
    return out


def group_flops(cfg: ModelConfig, groups) -> dict:
    """Forward+backward FLOPs of both paths over `groups` (prefix.batch.Group list)."""
    f = batch_fwd_flops(cfg, groups)
    full, pref = 3 * f["full"], 3 * (f["prefix"] + f["response"])
    return {"full_fwd_bwd_flops": full, "prefix_fwd_bwd_flops": pref, "flop_ratio_full_over_prefix": full / pref}
