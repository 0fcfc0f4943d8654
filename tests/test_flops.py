"""Analytic FLOP counts by hand on small shapes."""
import torch

from rollplex_megatron.verify import flops as F
from rollplex_megatron.recipes import load_run_config


def test_llm_terms_by_hand():
    cfg = load_run_config([]).model  # tiny: h=64, kv=32, ffn=128, 4 layers, vocab 320
    per_layer = 2 * 64 * (64 + 64) + 2 * 64 * 64 + 2 * 3 * 64 * 128
    assert F.llm_dense_per_token(cfg) == per_layer * 4
    assert F.llm_attention(cfg, 10) == 4 * 10 * 64 * 4
    assert F.logits(cfg, 3) == 2 * 64 * 320 * 3


def test_llm_dense_terms_count_the_query_width_where_it_is_not_the_hidden_size():
    """Qwen3-VL-4B's shape: 32 heads x 128 = 4096 query width against a 2560 hidden size, 8 K/V heads."""
    cfg = load_run_config(["model=qwen3_vl_4b"]).model
    h, q, kv, f = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_query_groups * cfg.head_dim, \
        cfg.ffn_hidden_size
    assert (h, q) == (2560, 4096), (h, q)
    per_layer = 2 * h * q + 2 * 2 * h * kv + 2 * q * h + 2 * 3 * h * f  # QKV, output projection, gated MLP
    assert F.llm_dense_per_token(cfg) == per_layer * cfg.num_layers


def test_prefix_path_saves_exactly_the_repeated_prefix():
    cfg = load_run_config([]).model
    grids = torch.tensor([[1, 4, 4]])
    one = F.full_sequence_fwd(cfg, 20, grids, [5])
    pre = F.prefix_response_fwd(cfg, 20, grids, [5])
    # G=1: same tokens and pairs; the prefix path skips only the 19 prefix-token logits
    assert abs((one - pre) - F.logits(cfg, 19)) < 1e-6 * one
    four_full = F.full_sequence_fwd(cfg, 20, grids, [5] * 4)
    four_pre = F.prefix_response_fwd(cfg, 20, grids, [5] * 4)
    saved = 3 * (F.llm_dense_per_token(cfg) * 19 + F.llm_attention(cfg, 19 * 20 / 2) + F.vision(cfg, grids)) \
        + 4 * F.logits(cfg, 19)
    assert abs((four_full - four_pre) - saved) < 1e-6 * four_full
