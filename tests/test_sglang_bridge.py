"""The SGLang bridge against a stand-in scheduler (SGLang cannot be installed here; `tests/sglang_workers.py`
replays its `event_loop_overlap` call sequence through the plugin's real hooks): prefix jobs run in the
scheduler process on modules that alias the trainer's weights, and the K/V the trainer receives equal the
prefix stages run directly; neither side hangs when the other fails."""
from __future__ import annotations



from rollplex_megatron.dist import run_local
from rollplex_megatron.recipes import load_run_config
from tests import sglang_workers as W
from tests.in_turn import case, in_turn

TOL = 1e-5  # docs/design.md §3, fp32 on CPU


def _cfg():
    return load_run_config(["model=tiny"])


def test_bridge_kv_equal_direct_prefix_stages():
    """Three RL steps of reference and actor prefix jobs; the actor's weights change in place between them and
    are not sent again (the scheduler's modules alias the trainer's: K/V of later steps would differ
    otherwise); the reference moves after step 1 and its handles are sent again."""
    cfg = _cfg()
    r = run_local(W.trainer_kv, 1, cfg, "", 3, 3, 60.0, 4)[0]
    assert len(r["rel"]) == 3 * 2 * 3 * cfg.model.num_layers * 2  # steps x modules x groups x layers x (k, v)
    assert max(r["rel"]) <= TOL, max(r["rel"])
    assert r["leaf_grad"] == [True] * 3  # actor K/V trainable leaves, reference K/V plain
    assert r["states"] == [True] * 3  # the recompute plan the prefix backward reads
    assert r["in_window"] > 0 and r["after"] > 0  # some jobs ran between decode steps, the rest at idle
    assert all(s["items_in_window"] + s["items_after"] == 6 for s in r["stats"])
    assert r["scheduler_exit"] == 0 and r["scheduler"]["decoded"] == 12  # SGLang kept serving, then stopped


def test_bridge_kv_mutation_copied_weights_is_caught():
    """Mutation: the scheduler's modules own copies of the weights. Step 1 still matches, step 2 does not."""
    r = run_local(W.trainer_kv, 1, _cfg(), "copy_weights", 2, 2, 60.0, 4)[0]
    half = len(r["rel"]) // 2
    assert max(r["rel"][:half]) <= TOL
    assert max(r["rel"][half:]) > 100 * TOL


def test_bridge_kv_mutation_stale_reference_handles_is_caught():
    """Mutation: the reference's handles are not sent again after it moved; step 3's K/V are wrong."""
    r = run_local(W.trainer_kv, 1, _cfg(), "no_resend", 3, 2, 60.0, 4)[0]
    third = len(r["rel"]) // 3
    assert max(r["rel"][:2 * third]) <= TOL
    assert max(r["rel"][2 * third:]) > 100 * TOL


def test_jobs_wait_for_the_end_of_decoding_before_idle_drain():
    """SGLang is idle between a step's start and its first batch: jobs must not drain there (that is no decode
    window). A scheduler that only idles runs nothing until the trainer's drain, then everything."""
    r = run_local(W.trainer_idle_gate, 1, _cfg())[0]
    assert r["before"] == 0 and r["after"] == r["n"] == 4 and r["in_window"] == 0, r


def test_drain_before_its_step_start_still_drains():
    """The trainer's Drain (from its decode thread) overtakes the step's BeginStep (from its bridge thread) when
    the rollout is short: the scheduler keeps it, and every job runs. Mutation: a scheduler that forgets such a
    drain at the step's start leaves the jobs waiting until the bridge's timeout."""
    runs = run_local(in_turn, 1, {"kept": (W.trainer_early_drain, (_cfg(),)),
                                  "lost": (W.trainer_early_drain, (_cfg(), "drain_lost", 3.0))})[0]
    r, m = case(runs, "kept"), case(runs, "lost")
    assert r == {0: (4, 4, 4), 1: (4, 4, 4)}, r
    assert "BridgeTimeout" in m.get("error", "") and "step 0: item" in m["error"], m


def test_scheduler_death_names_step_and_item():
    """The scheduler process dies inside a job: the trainer raises at once, naming the step and the item."""
    r = run_local(W.trainer_failure, 1, _cfg(), "die", 240.0)[0]
    assert r["error"] is not None and "BridgeError" in r["error"], r
    assert "step 0" in r["error"] and "actor_prefix[0]" in r["error"] and "died or shut down" in r["error"], r
    # the closed connection, not the 240 s timeout (start-up, scheduler spawn included, takes seconds to a minute on
    # a busy machine)
    assert r["seconds"] < 180, r


def test_scheduler_stuck_times_out_naming_step_and_item():
    """A scheduler that hangs inside a job: the trainer's wait ends at the timeout, naming the step and item."""
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


def test_engine_adapter_over_a_standin_engine():
    """SGLangEngine over a stand-in `sglang.Engine` (named as such: SGLang cannot run here): the engine's
    arguments (dummy weights, the alias loader, TP), SGLang's parameters bound to the training shards at load,
    one entry per sample with its own seed and the request's limits, outputs parsed in request order, and
    the window's jobs run in the scheduler with K/V equal to the direct prefix stages."""
    from rollplex_megatron.rollout.sglang.engine import BANNED_BIAS, sample_seed
    from rollplex_megatron.rollout.sglang.weights import LOADER

    cfg = load_run_config(["model=tiny", "rollout.engine=sglang", "rollout.sglang.model_path=stand-in"])
    r = run_local(W.adapter_rollout, 1, cfg)[0]
    kinds = [k for k, _ in r["calls"]]
    assert kinds == ["__init__", "release_memory_occupation", "resume_memory_occupation", "generate",
                     "release_memory_occupation"]  # SGLang's KV cache and graphs held only while it generates
    init, gen = r["calls"][0][1], r["calls"][3][1]
    assert all(c[1]["tags"] == ["kv_cache", "cuda_graph"] for c in r["calls"] if "memory" in c[0])
    assert init["load_format"] == "dummy" and init["custom_weight_loader"] == [LOADER] and init["tp_size"] == 1
    assert init["enable_deterministic_inference"] is True  # SGLang honours sampling_seed only then
    assert r["bound"] == r["n_params"] > 0  # every SGLang parameter is the trainer's memory
    sps = gen["sampling_params"]
    assert len(sps) == sum(n for n, *_ in r["reqs"]) and gen["return_logprob"] is True
    k = 0
    for (n, max_new, seed, stops), res in zip(r["reqs"], r["results"]):
        seeds = [sps[k + j]["sampling_seed"] for j in range(n)]
        assert seeds == [sample_seed(seed, j) for j in range(n)] and len(set(seeds)) == n
        for j in range(n):
            sp = sps[k + j]
            assert sp["max_new_tokens"] == max_new and sp["stop_token_ids"] == list(stops)
            assert sp["temperature"] == 0.7 and sp["top_p"] == 0.9 and sp["top_k"] == 5
            assert all(v == BANNED_BIAS for v in sp["logit_bias"].values()) and len(sp["logit_bias"]) == 4
            want = W.standin_output(sp)
            assert res.tokens[j].tolist() == want["output_ids"]
            assert res.finish_reasons[j] == want["meta_info"]["finish_reason"]["type"]
            assert res.logprobs[j].tolist() == [x for x, _, _ in want["meta_info"]["output_token_logprobs"]]
        k += n
    assert gen["image_data"][0]["format"] == "processor_output" and "pixel_values" in gen["image_data"][0]
    assert max(r["rel"]) <= TOL and len(r["rel"]) > 0
    assert r["finished"] == 6 and r["stats"]["items_in_window"] + r["stats"]["items_after"] == 6


def test_bridge_at_tp2_agrees_on_jobs_and_matches_direct_shards():
    """Training TP 2 and SGLang TP 2 (stand-in schedulers in a gloo world of their own): every rank issues the
    same prefix-stage collectives at the same hook call, and each rank's K/V shard equals the direct one."""
    cfg = load_run_config(["model=tiny", "parallel.tp=2"])
    for r in run_local(W.trainer_kv_tp2, 2, cfg):
        assert r["rel"] and max(r["rel"]) <= TOL, max(r["rel"])
        assert r["hello"][1] == 2 and r["scheduler_exit"] == 0
