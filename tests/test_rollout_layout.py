"""The rollout at its own TP inside the step (rollout.tp != parallel.tp), on weights shared with training.

Every comparison runs both sides at the same layouts with fresh weights from the tiny checkpoint; fp32 on
CPU, docs/design.md §3's tolerances.
"""
import shutil

import pytest

from rollplex_megatron.dist import run_local
from rollplex_megatron.recipes import load_run_config
from tests import layout_workers as LW
from tests import trainer_workers as W
from tests.test_trainer import TOL, _cfg, _param_err, _records_close

LOGP_TOL = 1e-5  # docs/design.md §3 (fp32): per-token log-probs, norm-relative


def _layout_cfg(tiny_hf, *extra):
    return _cfg("serial", "workload.rollout_batch=16", *extra, hf=tiny_hf)


@pytest.mark.parametrize("world,layout", [(1, ["rollout.bound_model=true"]),
                                          (2, ["parallel.tp=2", "rollout.tp=1"]),
                                          (2, ["parallel.tp=2", "rollout.tp=1", "rollout.split_gemm=all"]),
                                          (2, ["parallel.dp=2", "rollout.tp=2"]),
                                          (2, ["parallel.dp=2", "rollout.tp=2", "rollout.split_gemm=off"]),
                                          (4, ["parallel.tp=2", "parallel.dp=2", "rollout.tp=1"])],
                         ids=["tp1-bound", "tp2-to-1", "tp2-to-1-split-all", "tp1-to-2", "tp1-to-2-split-off",
                              "tp2-to-1-dp2"])
def test_rollout_on_shared_weights_equals_a_full_copy(tiny_hf, world, layout):
    """Tokens equal and log-probs within docs/design.md §3 before each of 3 steps (so after optimizer steps:
    refresh exercised); view-class tensors own no storage; the planner's rollout bytes are what it owns."""
    res = run_local(LW.shared_vs_full_copy, world, _layout_cfg(tiny_hf, *layout), 3)
    for r in res:
        for k, st in enumerate(r["steps"]):
            assert st["same_tokens"], (r["rank"], k)
            assert st["logp_rel"] <= LOGP_TOL, (r["rank"], k, st["logp_rel"])
        assert all(r["views"].values()), [n for n, ok in r["views"].items() if not ok]
        assert r["own_bytes"] == r["allocated"]
    assert res[0]["steps"][1]["tokens"] != res[0]["steps"][0]["tokens"]  # new prompts, new weights
    assert max(r["allocated"] for r in res) == res[0]["planned"]
    if "rollout.split_gemm=all" in layout:  # gathered linears: local views plus the received pieces only
        assert res[0]["allocated"] < res[0]["planned_off"]
    if "rollout.bound_model=true" in layout:  # equal layouts: every tensor a view, nothing owned
        assert all(r["allocated"] == 0 and r["view_classes"] == len(r["views"]) > 0 for r in res)
    elif "rollout.tp=2" in layout:
        assert res[0]["view_classes"] > 0 and res[0]["replicas"] == 1  # rollout TP > training TP: views
    else:
        assert res[0]["replicas"] == world  # one replica per rank, every tensor rebuilt over TP


def test_skipping_the_refresh_is_detected(tiny_hf):
    """Mutation: without refresh() after the optimizer step, the rebuilt tensors keep the old weights (the
    fc1 permutation at rollout TP 2 > training TP 1), and the rollout leaves the full copy's."""
    res = run_local(LW.shared_vs_full_copy, 2, _layout_cfg(tiny_hf, "parallel.dp=2", "rollout.tp=2"), 2,
                    "skip_refresh")
    first, second = res[0]["steps"]
    assert first["same_tokens"] and first["logp_rel"] <= LOGP_TOL  # before any optimizer step: equal
    assert not second["same_tokens"] or second["logp_rel"] > 100 * LOGP_TOL


UNEVEN = ["rollout.max_response_len=40"]


@pytest.fixture(scope="module")
def uneven_serial(tiny_hf):
    return run_local(LW.uneven_steps, 2, _cfg("serial", "parallel.tp=2", "rollout.tp=1", *UNEVEN, hf=tiny_hf),
                     3, 3, 30)


def test_rollplex_at_another_rollout_tp_matches_serial_with_uneven_replicas(tiny_hf, uneven_serial):
    """Training TP=2, two rollout replicas at TP=1 whose responses are 3 and 30 tokens: the actor and
    reference prefix stages (training TP, collectives over both replicas) are decode-window items; the
    short replica serves the rest after it finishes. Same rollouts and records as serial over 3 steps."""
    run = run_local(LW.uneven_steps, 2, _cfg("rollplex", "parallel.tp=2", "rollout.tp=1", *UNEVEN, hf=tiny_hf),
                    3, 3, 30)
    lengths = sorted({n for g in run[0]["lengths"] for n in g})
    assert lengths == [3, 30]  # replicas 10x apart
    assert run[0]["tokens"] == uneven_serial[0]["tokens"] == run[1]["tokens"]
    _records_close(run[0]["records"], uneven_serial[0]["records"])
    assert uneven_serial[0]["records"][-1]["kl"] > 0.01  # the updates moved the policy
    win = run[0]["records"][0]["rollout"]
    assert win["items_in_window"] > 0 and win["items_in_window"] + win["items_after"] == 2 * 8  # actor + reference
    cfg = _cfg("rollplex", "parallel.tp=2", "rollout.tp=1", *UNEVEN, hf=tiny_hf)
    assert cfg.weights_phase == "weight_refresh" and run[0]["records"][-1]["phase_times"]["weight_refresh"] > 0


def test_packed_window_items_at_another_rollout_tp_match_serial(tiny_hf, uneven_serial):
    """The same, with every group's prefix in one pack (`workload.prefix_pack_tokens`): the window runs one actor
    item and one reference item a step (each a single forward at the training layout, its collectives over both
    replicas in the same order), and the run equals serial."""
    run = run_local(LW.uneven_steps, 2, _cfg("rollplex", "parallel.tp=2", "rollout.tp=1", *UNEVEN,
                                             "workload.prefix_pack_tokens=100000", hf=tiny_hf), 3, 3, 30)
    assert run[0]["tokens"] == uneven_serial[0]["tokens"] == run[1]["tokens"]
    _records_close(run[0]["records"], uneven_serial[0]["records"])
    for rec in run[0]["records"]:
        win = rec["rollout"]
        assert win["items_in_window"] + win["items_after"] == 2, win


def test_rollplex_at_another_rollout_tp_detects_a_dropped_prefix_backward(tiny_hf, uneven_serial):
    run = run_local(LW.uneven_steps, 2, _cfg("rollplex", "parallel.tp=2", "rollout.tp=1", *UNEVEN, hf=tiny_hf),
                    2, 3, 30, "skip_prefix_backward")
    gn, ref = run[0]["records"][0]["grad_norm"], uneven_serial[0]["records"][0]["grad_norm"]
    assert abs(gn - ref) > 10 * TOL * ref


@pytest.mark.parametrize("over,msg", [(["parallel.tp=2", "rollout.tp=3"], "one must divide the other"),
                                      (["parallel.tp=2", "parallel.pp=2", "rollout.tp=1"], "needs parallel.pp=1"),
                                      (["rollout.tp=4", "parallel.dp=2"], "does not divide the 2 ranks"),
                                      (["rollout.tp=-1"], "rollout.tp must be >= 0"),
                                      (["mode.name=disaggregated"], "go together"),
                                      (["parallel.rollout_ranks=1"], "go together"),
                                      (["mode.name=disaggregated", "parallel.rollout_ranks=3", "rollout.tp=2"],
                                       "does not divide parallel.rollout_ranks"),
                                      (["mode.name=disaggregated", "parallel.rollout_ranks=3", "parallel.tp=2",
                                        "rollout.tp=3"], "one must divide the other"),
                                      (["parallel.pp=2", "rollout.bound_model=true"], "bound_model")])
def test_bad_rollout_layout_fails_with_the_setting(over, msg):
    with pytest.raises(ValueError, match=msg):
        load_run_config(["model=tiny"] + over)


DISAGG = ["mode.name=disaggregated"]


@pytest.mark.parametrize("world,layout,ref_world,ref_layout",
                         [(2, ["parallel.rollout_ranks=1"], 1, []),
                          (4, ["parallel.tp=2", "parallel.rollout_ranks=2", "rollout.tp=2"], 2, ["parallel.tp=2"]),
                          (4, ["parallel.dp=2", "parallel.rollout_ranks=2", "rollout.tp=1"], 2, ["parallel.dp=2"])],
                         ids=["1+1", "2+2-tp2", "2+2-dp2"])
def test_disaggregated_matches_serial_colocation(request, tiny_hf, world, layout, ref_world, ref_layout):
    """Rollout on ranks of its own with weights of its own, sent after every step: the same rollouts
    and records as serial colocation at the same training layout over 3 steps (so the rollout of step k
    used the weights after optimizer step k-1), and the same trained weights where they are whole. One
    training rank: the colocated run is conftest's serial_run (this config)."""
    ref = [request.getfixturevalue("serial_run")] if (ref_world, ref_layout) == (1, []) else run_local(
        W.run_steps, ref_world, _cfg("serial", *ref_layout, hf=tiny_hf), 3)
    run = run_local(LW.disaggregated_steps, world, _cfg("serial", *layout, *DISAGG, hf=tiny_hf), 3)
    train, served = run[:ref_world], run[ref_world:]
    for a, b in zip(train, ref):
        assert a["tokens"] == b["tokens"]
        _records_close(a["records"], b["records"])
    assert all(s["rollout"]["weight_loads"] == 1 + 3 and s["rollout"]["rollouts"] == 3 for s in served)
    assert train[0]["records"][-1]["phase_times"]["weight_transfer"] > 0
    assert _cfg("serial", *layout, *DISAGG, hf=tiny_hf).weights_phase == "weight_transfer"  # what profiling checks
    if train[0]["last"] is not None:
        err, name = _param_err(train[0], ref[0])
        assert err <= TOL, (name, err)


def test_disaggregated_without_the_transfer_is_detected(tiny_hf, serial_run):
    """Mutation: the rollout ranks keep the initial weights; from step 2 on the rollouts leave serial's
    (conftest's serial_run: the colocated run of this config)."""
    ref = serial_run
    run = run_local(LW.disaggregated_steps, 2, _cfg("serial", "parallel.rollout_ranks=1", *DISAGG, hf=tiny_hf), 3,
                    "skip_transfer")[0]
    assert run["tokens"][0] == ref["tokens"][0]
    assert run["tokens"][1:] != ref["tokens"][1:]


@pytest.mark.parametrize("t,r,world", [(4, 8, 32), (8, 4, 32), (2, 4, 8), (2, 1, 8), (1, 2, 4)])
def test_aligned_mapping_nests_at_any_world_size(t, r, world):
    """On every rank the rollout shard lies inside the training shard (r > t) or contains it (r < t), also
    when the world holds many blocks of max(t, r) ranks (megatron's order strings stride over the world)."""
    from rollplex_megatron.dist import aligned_coordinates
    from rollplex_megatron.weights.plan import rank_pairs

    pairs = rank_pairs(t, r, world)
    assert all((rr // (r // t) == tr) if r >= t else (tr // (t // r) == rr) for tr, rr in pairs)
    block = max(t, r)
    for d in (t, r):  # each side: every TP group holds TP ranks 0..d-1 in rank order, replicas cover the world
        coords = [aligned_coordinates(g, d, block) for g in range(world)]
        groups = {}
        for g, (tp, dp) in enumerate(coords):
            groups.setdefault(dp, []).append((g, tp))
        assert len(groups) == world // d
        assert all([tp for _, tp in sorted(m)] == list(range(d)) for m in groups.values())
        assert all(max(g for g, _ in m) // block == min(g for g, _ in m) // block for m in groups.values())


def test_planner_counts_the_shared_rollout_bytes_at_scale():
    """32B, train TP=4 -> rollout TP=8 on 32 GPUs: with the fc1 split over views the rollout model owns
    what the 8-GPU plan says (plan-weights: 5.9% of a copy), not a second copy."""
    from rollplex_megatron.memory.planner import shared_rollout_bytes
    from rollplex_megatron.weights.plan import plan_weights

    base = ["model=qwen2_5_vl_32b", "dtype=bfloat16", "parallel.tp=4", "rollout.tp=8"]
    at32 = shared_rollout_bytes(load_run_config(base + ["parallel.dp=8"]))
    at8 = shared_rollout_bytes(load_run_config(base + ["parallel.dp=2"]))
    s = plan_weights(load_run_config(base + ["parallel.dp=2"]).model, 4, 8).summary()
    assert at32 == at8 == s["allocated_bytes_split_gemm"] < 0.1 * s["full_copy_bytes"]
    off = shared_rollout_bytes(load_run_config(base + ["parallel.dp=8", "rollout.split_gemm=off"]))
    assert off == s["allocated_bytes"] > at32


def test_resume_at_another_rollout_tp_equals_an_uninterrupted_run(tiny_hf, tmp_path):
    """2 steps + checkpoint + fresh processes + 1 step = 3 steps, at training TP=2 -> rollout TP=1: after
    the checkpoint is loaded the rollout model's rebuilt tensors are brought to the loaded weights.
    Mutation: without that (and every later) sync, the resumed step's rollout leaves the uninterrupted one."""
    cfg = _layout_cfg(tiny_hf, "parallel.tp=2", "rollout.tp=1")
    full = run_local(LW.train_run, 2, cfg, str(tmp_path / "full"), 3, False)[0]
    run_local(LW.train_run, 2, cfg, str(tmp_path / "part"), 2, False)
    shutil.copytree(tmp_path / "part", tmp_path / "mutant")
    resumed = run_local(LW.train_run, 2, cfg, str(tmp_path / "part"), 3, True)[0]
    assert [r["step"] for r in resumed] == [3]
    _records_close(resumed, full[2:])
    assert resumed[0]["response_tokens"] == full[2]["response_tokens"]
    stale = run_local(LW.train_run, 2, cfg, str(tmp_path / "mutant"), 3, True, "skip_sync")[0]
    assert any(abs(stale[0][k] - full[2][k]) > 10 * TOL * abs(full[2][k]) for k in ("loss", "grad_norm"))
