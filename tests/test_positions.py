"""Pure position/window functions against transformers' Qwen2.5-VL reference implementations."""
import pytest
import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel
from transformers import vision_utils as hfv

from rollplex_megatron.models.qwen25vl import positions as P
from rollplex_megatron.verify.parity import synthetic_inputs
from rollplex_megatron.recipes import load_run_config
from tests.hf_models import TINY_TEXT, TINY_TOKENS, TINY_VISION

GRIDS = [[1, 4, 6], [2, 8, 4], [3, 6, 10], [1, 2, 2], [4, 12, 8]]


@pytest.mark.parametrize("window", [56, 112])
def test_window_order_matches_transformers(window):
    grid = torch.tensor(GRIDS)
    order, cu = P.vision_window_order(grid, 2, window, 14)
    ref_order, ref_cu = hfv.get_vision_window_index(grid, spatial_merge_size=2, window_size=window, patch_size=14)
    assert torch.equal(order, ref_order)
    assert torch.equal(cu, ref_cu.long())


def test_patch_positions_and_cu_seqlens_match_transformers():
    grid = torch.tensor(GRIDS)
    assert torch.equal(P.vision_patch_positions(grid, 2), hfv.get_vision_position_ids(grid, 2))
    assert torch.equal(P.vision_cu_seqlens(grid), hfv.get_vision_cu_seqlens(grid).long())


def _hf_rope_index(cfg, inputs):
    hf_cfg = Qwen2_5_VLConfig(text_config=TINY_TEXT, vision_config=TINY_VISION, **TINY_TOKENS)
    ids = inputs["input_ids"]
    mm = (ids == cfg.image_token_id).int() + 2 * (ids == cfg.video_token_id).int()
    model = Qwen2_5_VLModel.__new__(Qwen2_5_VLModel)  # get_rope_index only reads the config
    model.config = hf_cfg
    return Qwen2_5_VLModel.get_rope_index(model, ids, mm, inputs["image_grid_thw"],
                                          inputs["video_grid_thw"], inputs["second_per_grid_ts"])


@pytest.mark.parametrize("image,video,secs", [((1, 6, 10), (4, 4, 4), 1.5), ((1, 2, 2), (2, 8, 6), 0.5),
                                               ((1, 12, 4), (6, 2, 2), 3.0)])
def test_mrope_positions_match_transformers(image, video, secs):
    cfg = load_run_config([]).model
    inputs = synthetic_inputs(cfg, seed=3, batch=3, image_thw=image, video_thw=video, text_tokens=11,
                              second_per_grid_t=secs)
    ours, deltas = P.mrope_position_ids(
        inputs["input_ids"], inputs["image_grid_thw"], inputs["video_grid_thw"], inputs["second_per_grid_ts"],
        image_token_id=cfg.image_token_id, video_token_id=cfg.video_token_id, merge=2, tokens_per_second=2)
    ref, ref_deltas = _hf_rope_index(cfg, inputs)
    assert torch.equal(ours, ref)
    assert torch.equal(deltas, ref_deltas.long())
    # Mutation check: a 1D position scheme is not what transformers computes.
    flat = torch.arange(ours.shape[-1]).expand_as(ours)
    assert not torch.equal(flat, ref)


def test_mrope_rejects_wrong_token_count():
    cfg = load_run_config([]).model
    inputs = synthetic_inputs(cfg, seed=0, batch=1, image_thw=(1, 4, 4), video_thw=(2, 2, 2), text_tokens=6)
    with pytest.raises(ValueError, match="sample 0: 4 image tokens"):
        P.mrope_position_ids(inputs["input_ids"], torch.tensor([[1, 4, 6]]), inputs["video_grid_thw"], None,
                             image_token_id=cfg.image_token_id, video_token_id=cfg.video_token_id,
                             merge=2, tokens_per_second=2)


def test_vision_rotary_matches_transformers():
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLVisionRotaryEmbedding
    from transformers import Qwen2_5_VLVisionConfig

    grid = torch.tensor(GRIDS)
    pos = P.vision_patch_positions(grid, 2)
    ours = P.vision_rotary_freqs(pos, 16, 10000.0)[:, 0, 0]
    rot = Qwen2_5_VLVisionRotaryEmbedding(Qwen2_5_VLVisionConfig(hidden_size=32, num_heads=2))
    cos, sin = rot(torch.zeros(1), pos)
    assert torch.allclose(ours.cos(), cos, atol=1e-6) and torch.allclose(ours.sin(), sin, atol=1e-6)
