"""The rollplex verl engine (integrations/verl/engine.py, `VERL_ENGINE_VENDOR=rollplex`) on a Qwen3-VL checkpoint
(issue 56): test_verl_plugin.py's shared-prefix-equals-full-sequences check at TP 1 and 2 (log-probs, entropy,
loss, every gradient and megatron's gradient norm within docs/design.md §3's fp32 1e-5) on verl's batches with
the position ids verl's agent loop computes; the engine's positions equal verl's, the checkpoint's vision tokens
are out of the softmax (log-probs equal the serial path's that bans them); mutations: a prefix stage that drops one
DeepStack injection, and positions one late (refused against verl's)."""
import pytest

from rollplex_megatron.dist import run_local
from tests import verl_qwen3vl_workers as W
from tests.in_turn import case
from tests.test_qwen3vl import TINY_TOKENS, make_tiny_qwen3vl

TOL = 1e-5


@pytest.fixture(scope="module")
def tiny_qwen3vl(tmp_path_factory):
    """The tiny untied Qwen3-VL checkpoint."""
    return make_tiny_qwen3vl(tmp_path_factory.mktemp("hf3v") / "tiny_qwen3vl")


@pytest.fixture(scope="module")
def tp1(tiny_qwen3vl):
    """The TP 1 runs (`verl_qwen3vl_workers.tp1_cases`), in one job."""
    from tests.in_turn import in_turn

    return run_local(in_turn, 1, {"tp1": (W.tp1_cases, (tiny_qwen3vl,))})[0]


@pytest.fixture(scope="module")
def tp2(tiny_qwen3vl):
    """The TP 2 run, in one 2-rank job."""
    return run_local(W.shared_vs_full, 2, tiny_qwen3vl, 2)


@pytest.mark.parametrize("tp", [1, 2])
def test_engine_shared_prefix_equals_full_sequences_on_qwen3vl(request, tp):
    runs = [case(request.getfixturevalue("tp1"), "tp1")["plain"]] if tp == 1 else request.getfixturevalue("tp2")
    assert len(runs) == tp
    for r in runs:
        assert r["engine"] == "RollplexMegatronEngine" and r["family"] == "qwen3_vl"
        assert r["banned"] == [TINY_TOKENS[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                                        "vision_end_token_id")]
        assert r["full_groups"] == 0 and r["grad_norm"] > 0
        assert all(v <= TOL for v in r["rel"].values()), str(r["rel"])


def test_a_prefix_stage_without_one_deepstack_injection_is_caught(tp1):
    r = case(tp1, "tp1")["drop_deepstack"]
    assert r["rel"]["log_probs"] > 100 * TOL and r["rel"]["grad"] > 100 * TOL, r["rel"]


def test_positions_that_differ_from_verls_are_refused(tp1):
    """Shared and full sequences would agree on wrong positions; verl's own position ids catch them."""
    err = case(tp1, "tp1")["late_positions"]["error"]
    assert err and err.startswith("verl batch: sample 0: verl's position_ids differ from model.family=qwen3_vl's "
                                  "positions at token 0"), err
