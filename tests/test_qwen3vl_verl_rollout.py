"""The verl `rollplex` rollout backend (integrations/verl/rollout.py, held.py) on a Qwen3-VL checkpoint (issue 56),
in-process as tests/test_verl_e2e_rollout.py runs it for Qwen2.5-VL: prompts with a picture and a 2-frame video
(after its timestamp text), so DeepStack and the M-RoPE positions enter every prefix, through the server's processor
path into the rollout on the actor engine's modules; then verl's scoring phases on the rows verl's agent loop
would store (its multi-modal inputs and position ids, which the engine checks against the family's).

fp32, docs/design.md §3 (1e-5, norm-relative): the rollout's log-probs equal the actor's scoring of the same
samples; the actor's old log-probs read from the rollout prefill's K/V and the reference's from the decode
window's equal those computed from scratch. Mutations: held K/V of the other prompt (the same ids, other pixels),
and a rollout whose prefixes drop one DeepStack injection."""
import pytest

from rollplex_megatron.dist import run_local
from tests import verl_qwen3vl_workers as W
from tests.test_qwen3vl import make_tiny_qwen3vl

TOL = 1e-5


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The tiny Qwen3-VL checkpoint with verl's processor files, and `rollout_case` on it (one rank)."""
    path = make_tiny_qwen3vl(tmp_path_factory.mktemp("hf3v_rollout") / "tiny_qwen3vl")
    return run_local(W.rollout_case, 1, W.write_verl_processor(path))[0]


def test_rollout_merges_each_prompt_and_tells_prompts_apart_by_pixels(run):
    # the two prompts have one id sequence (their pictures and videos differ): 6 calls, 2 merged requests
    assert run["same_ids"] and run["stats"] == {"requests": 6, "merged_requests": 2, "batches": 1}, run
    assert all(1 <= n <= 6 for n in run["lens"]) and len(set(run["lens"])) > 1, run["lens"]  # ragged (stops)


def test_rollout_log_probs_equal_the_actors_scoring(run):
    assert run["rollout_vs_actor"] <= TOL, run  # from the held K/V
    assert run["rollout_vs_actor_plain"] <= TOL, run  # every prefix computed


def test_held_prefixes_serve_old_and_reference_log_probs(run):
    for role in ("actor", "ref"):
        assert run[role + "_window"] == {"from_window": 2, "computed": 0}, run
        assert run[role + "_held_vs_plain"] <= TOL, run


def test_held_prefixes_of_the_other_prompt_are_caught(run):
    # mutation: each prompt's held K/V answered with the other's (the same ids: only the vision differs)
    assert run["actor_rotated_vs_plain"] > 100 * TOL and run["ref_rotated_vs_plain"] > 100 * TOL, run


def test_a_rollout_prefix_without_one_deepstack_injection_is_caught(run):
    # mutation: the second rollout's prefill and reference prefix stage drop one DeepStack level; the scoring reads
    # those held K/V (every group from the window), and the intact model's log-probs differ
    assert run["dropped_window"] == [{"from_window": 2, "computed": 0}] * 2, run
    for k in ("dropped_rollout_vs_actor_plain", "dropped_actor_held_vs_plain", "dropped_ref_held_vs_plain"):
        assert run[k] > 100 * TOL, (k, run)
