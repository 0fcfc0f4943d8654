"""The memory planner on Qwen3-VL (issue 56): parameter counts equal the models megatron builds from the presets
(full size, on the meta device, per pipeline stage), and the bytes a bf16 prefix forward saves equal autograd's
saved tensors within 1% (torch and fused norms and RoPE), as tests/test_memory_plan.py and
tests/test_memory_runtime.py check Qwen2.5-VL's."""
import dataclasses

import pytest

from rollplex_megatron.dist import init_parallel, run_local
from rollplex_megatron.memory import tensor_bytes as M
from rollplex_megatron.models import registry
from rollplex_megatron.recipes import load_run_config
from tests.in_turn import case, cases, in_turn
from tests.test_memory_runtime import saved_prefix_bytes

PRESETS = ("qwen3_vl_2b", "qwen3_vl_4b", "qwen3_vl_8b")
ACTIVATION_CASES = {
    "tiny": ["model=qwen3_vl_tiny"],
    "tiny_fused_norm": ["model=qwen3_vl_tiny", "train.norm_kernel=triton"],  # q/k norms fused too
    "tiny_fused_rope": ["model=qwen3_vl_tiny", "train.rope_kernel=triton"],
    # the 2B's widths at two layers and blocks (three DeepStack levels need three layers on the first stage)
    "2b_small": ["model=qwen3_vl_2b", "model.num_layers=3", "model.vision.depth=3",
                 "model.vision.deepstack_visual_indexes=[0,1,2]", "model.vision.fullatt_block_indexes=[0,1,2]"],
}


def _built_params(preset: str, pp: int) -> int:
    """This rank's parameters of `preset` built by the registry at PP `pp`, on the meta device (no memory)."""
    cfg = load_run_config([f"model={preset}", f"parallel.pp={pp}"]).model
    init_parallel(1, pp)
    return sum(p.numel() for p in registry.model_spec(cfg).build(cfg, "bfloat16", meta=True).parameters())


@pytest.fixture(scope="module")
def built():
    """Every preset's stage parameter counts per pipeline depth (one job per depth)."""
    out = {}
    for pp in (1, 2):
        res = run_local(in_turn, pp, {p: (_built_params, (p, pp)) for p in PRESETS}, False)
        out.update({(p, pp): cases(res, p) for p in PRESETS})
    return out


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("pp", [1, 2])
def test_parameter_count_equals_the_built_model(built, preset, pp):
    """Exact at TP=1: the fullest pipeline stage's parameters as megatron builds them (the 8B is 8.77e9 at PP 1)."""
    cfg = load_run_config([f"model={preset}"]).model
    counts = built[preset, pp]
    assert len(counts) == pp and max(counts) == M.params_per_gpu(cfg, 1, pp), (counts, M.params_per_gpu(cfg, 1, pp))


def test_parameter_count_with_qwen25s_layers_misses_the_built_model(built, monkeypatch):
    """Mutation: Qwen3-VL counted with Qwen2.5-VL's layer make-up (QKV bias, no q/k norms, RMSNorm, SwiGLU vision
    MLP) is off by millions."""
    cfg = load_run_config(["model=qwen3_vl_8b"]).model
    spec = dataclasses.replace(registry.model_spec(cfg), layers=registry.FAMILIES["qwen2_5_vl"].layers)
    monkeypatch.setattr(M, "model_spec", lambda c: spec)
    assert abs(M.params_per_gpu(cfg, 1, 1) - built["qwen3_vl_8b", 1][0]) > 1e7


def test_qwen3_layer_bytes_by_hand():
    """The tiny preset (h 64, 4 heads and 2 KV groups of head dim 24, ffn 128; vision 32 wide, 2 heads, ffn 48):
    Qwen2.5-VL's decoder layer plus the q/k norms per head; LayerNorm vision blocks with a GELU MLP."""
    m = load_run_config(["model=qwen3_vl_tiny"]).model
    q, kv = 4 * 24, 2 * 24
    qk = 6 * (8 * 24 + 4)  # torch's composite RMSNorm per q and k head
    assert M.layer_activation_bytes(m, 1, False) == (2 * (8 * 64 + 4) + 4 * 64) + qk + 8 * 24 + 2 * q + 2 * kv \
        + 2 * (q + 2 * kv) + 4 * 4 + 2 * q + 10 * 128
    fused_qk = 2 * q + 4 * 6  # q copied out of the grouped QKV buffer, k a view of it
    assert M.layer_activation_bytes(m, 1, False, "triton") == M.layer_activation_bytes(m, 1, False) \
        - 2 * 6 * 64 - qk + fused_qk
    # LayerNorms (bf16 input, fp32 mean and rstd) whatever the norm kernel; 10 vh of attention; fc1 out, fc2 in
    block = 2 * (2 * 32 + 8) + 4 * 32 + 8 * 16 + 10 * 32 + 4 * 2 + 4 * 48
    assert M.block_activation_bytes(m, 1) == M.block_activation_bytes(m, 1, "triton") == block


def _qwen3_fused_norms(cfg) -> int:
    """FusedRMSNorm modules of a Qwen3-VL build: the LLM's two a layer plus its q/k norms, and the final norm (the
    vision tower's norms are LayerNorms)."""
    return 4 * cfg.model.num_layers + 1


def _saved_bytes(overrides: list[str]) -> tuple[int, int]:
    """tests/test_memory_runtime.py's count on a Qwen3-VL build."""
    return saved_prefix_bytes(overrides, _qwen3_fused_norms)


@pytest.fixture(scope="module")
def activations():
    """(autograd's saved bytes, the planner's) of one bf16 prefix forward per case, in one job."""
    return run_local(in_turn, 1, {k: (_saved_bytes, (o,)) for k, o in ACTIVATION_CASES.items()})[0]


@pytest.mark.parametrize("name", list(ACTIVATION_CASES))
def test_activation_count_matches_autograds_saved_tensors(activations, name):
    measured, predicted = case(activations, name)
    assert abs(measured - predicted) / measured < 0.01, (measured, predicted)


def test_fused_norm_saves_exactly_the_planned_bytes_less(activations):
    """The fused RMSNorm (LLM norms and q/k norms; the vision LayerNorms stay) against torch's, same prompt."""
    (torch_saved, torch_planned), (fused_saved, fused_planned) = (case(activations, k) for k in
                                                                  ("tiny", "tiny_fused_norm"))
    assert torch_saved - fused_saved == torch_planned - fused_planned > 0
