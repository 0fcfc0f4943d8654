"""The SGLang bridge against a stand-in scheduler (SGLang cannot be installed here; `tests/sglang_workers.py`
replays its `event_loop_overlap` call sequence through the plugin's real hooks): prefix jobs run in the
scheduler process on modules that alias the trainer's weights, and the K/V the trainer receives equal the
prefix stages run directly; neither side hangs when the other fails."""
from __future__ import annotations



from rollplex_megatron.dist import run_local
from rollplex_megatron.recipes import load_run_config
from tests import sglang_workers as W

TOL = 1e-5  # DESIGN section 3, fp32 on CPU


def _cfg():
    return load_run_config(["model=tiny"])


def test_bridge_kv_equal_direct_prefix_stages():
    """Two RL steps of reference and actor prefix jobs; the actor's weights change in place between them and
    are not sent again: the scheduler's modules alias the trainer's (K/V of step 2 would differ otherwise)."""
    cfg = _cfg()
    r = run_local(W.trainer_kv, 1, cfg, "", 2, 3, 60.0, 4)[0]
    assert len(r["rel"]) == 2 * 2 * 3 * cfg.model.num_layers * 2  # steps x modules x groups x layers x (k, v)
    assert max(r["rel"]) <= TOL, max(r["rel"])
    assert r["leaf_grad"] == [True, True]  # actor K/V trainable leaves, reference K/V plain
    assert r["states"] == [True, True]  # the recompute plan the prefix backward reads
    assert r["in_window"] > 0 and r["after"] > 0  # some jobs ran between decode steps, the rest at idle
    assert all(s["items_in_window"] + s["items_after"] == 6 for s in r["stats"])
    assert r["scheduler_exit"] == 0 and r["scheduler"]["decoded"] == 8  # SGLang kept serving, then stopped


def test_bridge_kv_mutation_copied_weights_is_caught():
    """Mutation: the scheduler's modules own copies of the weights. Step 1 still matches, step 2 does not."""
    r = run_local(W.trainer_kv, 1, _cfg(), "copy_weights", 2, 2, 60.0, 4)[0]
    half = len(r["rel"]) // 2
    assert max(r["rel"][:half]) <= TOL
    assert max(r["rel"][half:]) > 100 * TOL


def test_scheduler_death_names_step_and_item():
    """The scheduler process dies inside a job: the trainer raises at once, naming the step and the item."""
    r = run_local(W.trainer_failure, 1, _cfg(), "die", 60.0)[0]
    assert r["error"] is not None and "BridgeError" in r["error"], r
    assert "step 0" in r["error"] and "actor_prefix[0]" in r["error"] and "died or shut down" in r["error"], r
    assert r["seconds"] < 50, r  # the closed connection, not the 60 s timeout


def test_scheduler_stuck_times_out_naming_step_and_item():
    """A scheduler that never runs a job: the trainer's wait ends at the timeout, naming the step and item."""
    r = run_local(W.trainer_failure, 1, _cfg(), "stuck", 3.0)[0]
    assert r["error"] is not None and "BridgeTimeout" in r["error"], r
    assert "step 0: item actor_prefix[0]" in r["error"] and "3 s" in r["error"], r


def test_trainer_death_leaves_scheduler_serving():
    """The trainer dies with jobs queued: the scheduler's bridge drops them and SGLang's loop goes on to its
    own end (the stand-in stops once the bridge has closed), instead of hanging on the trainer."""
    r = W.trainer_dies(_cfg())
    assert r["trainer_exit"] == 7
    assert r["scheduler"]["error"] is not None and "closed the bridge" in r["scheduler"]["error"], r
    assert "left_running" not in r["scheduler"], r


def test_job_error_reaches_the_trainer():
    """A job that raises in the scheduler (a token id past the padded vocabulary) fails the step, naming it."""
    r = run_local(W.trainer_bad_job, 1, _cfg())[0]
    assert "step 0: item reference_prefix[0] failed in the SGLang scheduler" in r, r
