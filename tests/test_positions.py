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


def test_vision_plan_is_the_fresh_computation_kept_per_grids():
    """The tower's cached plan equals what the functions compute now, for each set of grids; the same grids give
    back the kept tensors (no second planning); other grids or another window size get a plan of their own."""
    P._vision_plan.cache_clear()
    grid = torch.tensor(GRIDS)
    plan = P.vision_plan(grid, 2, 112, 14, 16, 10000.0)
    order_U, cu_window = P.vision_window_order(grid, 2, 112, 14)
    order_N = P.units_to_patches(order_U, 4)
    assert torch.equal(plan.order_N, order_N) and torch.equal(plan.cu_window, cu_window.long())
    assert torch.equal(plan.inverse_U, torch.argsort(order_U))
    assert torch.equal(plan.cu_full, P.vision_cu_seqlens(grid).long())
    assert torch.equal(plan.rotary_N, P.vision_rotary_freqs(P.vision_patch_positions(grid, 2), 16, 10000.0)[order_N])
    again = P.vision_plan(grid.clone(), 2, 112, 14, 16, 10000.0)
    assert all(a is b for a, b in zip(again, plan)) and P._vision_plan.cache_info().hits == 1
    other = P.vision_plan(grid[:2], 2, 112, 14, 16, 10000.0)
    assert other.order_N.numel() < plan.order_N.numel()
    narrow = P.vision_plan(grid, 2, 56, 14, 16, 10000.0)
    assert not torch.equal(narrow.cu_window, plan.cu_window) and P._vision_plan.cache_info().misses == 3
    with torch.inference_mode():  # planned under inference mode, the plan still serves a forward with autograd
        late = P.vision_plan(grid, 2, 112, 28, 16, 10000.0)
    x = torch.randn(late.order_N.numel(), 3, requires_grad=True)
    x[late.order_N].sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def _tower_twice():
    """A tiny vision tower's embeddings from two forwards over the same grids, and the plan cache's hits."""
    from rollplex_megatron.dist import init_parallel
    from rollplex_megatron.models.qwen25vl.model import VisionTower

    init_parallel(1, 1, 0, "gloo")
    cfg = load_run_config(["model=tiny"]).model
    torch.manual_seed(0)
    tower = VisionTower(cfg, torch.float32, 1).eval()
    grid = torch.tensor([[2, 8, 4], [1, 4, 6]])
    v = cfg.vision
    pix = torch.randn(int(grid.prod(-1).sum()), v.in_channels * v.temporal_patch_size * v.patch_size ** 2)
    P._vision_plan.cache_clear()
    with torch.no_grad():
        first = tower(pix, grid)
        second = tower(pix, grid)
    return first, second, P._vision_plan.cache_info().hits


def test_the_vision_tower_gives_the_same_embeddings_from_a_kept_plan():
    """A second forward over the same grids (the plan kept) equals the first (the plan computed), bit for bit:
    nothing the tower does writes into the shared plan. (In a worker: the process group stays out of pytest's.)"""
    from rollplex_megatron.dist import run_local

    first, second, hits = run_local(_tower_twice, 1)[0]
    assert hits >= 1
    assert torch.equal(first, second)
