"""`train.reference`: a run builds the reference and scores it only where the loss reads it (`auto`: kl_coef > 0),
or always, or never. Without it the step has no reference phase, window items or weights, and trains exactly as
the run that scores the reference at kl_coef 0; the modes still agree with serial (docs/design.md §3)."""
import pytest
import torch

from rollplex_megatron.dist import run_local
from rollplex_megatron.memory.planner import releasable, runtime_plan, summarize, workload_shape
from rollplex_megatron.recipes import load_run_config
from tests import trainer_workers as W
from tests.in_turn import case, in_turn
from tests.test_trainer import TOL, _cfg, _param_err, _records_close

NO_KL = "train.kl_coef=0"


@pytest.mark.parametrize("over,msg", [(["train.reference=never", "train.kl_coef=0.1"],
                                       "train.reference=never leaves nothing for train.kl_coef=0.1"),
                                      (["train.reference=on"], "train.reference must be one of"),
                                      (["train.reference=true"], "train.reference must be one of")])
def test_bad_reference_settings_are_refused(over, msg):
    with pytest.raises(ValueError, match=msg):
        load_run_config(over)


@pytest.mark.parametrize("reference,kl,uses", [("auto", 0.0, False), ("auto", 0.1, True), ("always", 0.0, True),
                                               ("always", 0.1, True), ("never", 0.0, False)])
def test_which_runs_build_the_reference(reference, kl, uses):
    cfg = load_run_config([f"train.reference={reference}", f"train.kl_coef={kl}"])
    assert cfg.train.uses_reference is uses


@pytest.fixture(scope="module")
def kl0_runs(tiny_hf):
    """serial and rollplex at kl_coef 0, without the reference (auto) and scoring it (always), two steps each."""
    calls = {(mode, ref): (W.run_steps, (_cfg(mode, NO_KL, f"train.reference={ref}", hf=tiny_hf), 2))
             for mode in ("serial", "rollplex") for ref in ("auto", "always")}
    return run_local(in_turn, 1, calls)[0]


@pytest.mark.parametrize("mode", ["serial", "rollplex"])
def test_a_run_without_the_reference_trains_as_the_one_that_scores_it(kl0_runs, mode):
    """At kl_coef 0 the reference reaches only the logged kl: the run without it has no reference phase, window
    item, weights or kl record, and its rollouts, losses and weights equal those of the run that scores it bit for
    bit (the actor runs the same kernels in the same order)."""
    bare, scored = case(kl0_runs, (mode, "auto")), case(kl0_runs, (mode, "always"))
    assert not bare["has_reference"] and scored["has_reference"]
    for rec in bare["records"]:
        assert "ref_logp" not in rec["phase_times"] and "kl" not in rec and "kl_k1" not in rec
        assert "reference_weights" not in rec["memory_released"]
    for rec in scored["records"]:
        assert "ref_logp" in rec["phase_times"] and "kl" in rec
        assert "reference_weights" in rec["memory_released"]  # BASE's plan (phase) releases it
    if mode == "rollplex":  # the reference prefixes are the window's items (the prefill is the actor's prefix)
        assert all(r["rollout"]["items_in_window"] + r["rollout"]["items_after"] == 0 for r in bare["records"])
        assert all(r["rollout"]["items_in_window"] + r["rollout"]["items_after"] > 0 for r in scored["records"])
    assert bare["tokens"] == scored["tokens"]
    for a, b in zip(bare["records"], scored["records"]):
        assert (a["loss"], a["grad_norm"], a["entropy"]) == (b["loss"], b["grad_norm"], b["entropy"])
    assert all(torch.equal(bare["last"][n], scored["last"][n]) for n in scored["last"])
    assert any(not torch.equal(bare["first"][n], bare["last"][n]) for n in bare["first"])  # it trained


def test_rollplex_without_the_reference_matches_serial(kl0_runs):
    serial, run = case(kl0_runs, ("serial", "auto")), case(kl0_runs, ("rollplex", "auto"))
    assert run["tokens"] == serial["tokens"]
    _records_close(run["records"], serial["records"], keys=("loss", "entropy", "grad_norm", "reward_mean"))
    err, name = _param_err(run, serial)
    assert err <= TOL, (name, err)


def test_a_kl_term_builds_the_reference(rollplex_run):
    """auto with kl_coef > 0 (the trainer tests' BASE): the reference is built, scored and logged; a run that left it
    out would put no KL in the loss, in every mode alike, which the comparisons between modes cannot see."""
    assert rollplex_run["has_reference"]
    assert all("ref_logp" in r["phase_times"] and r["kl"] >= 0 for r in rollplex_run["records"])
    assert rollplex_run["records"][-1]["kl"] > 0.01


@pytest.mark.parametrize("mode", ["serial", "prefix_shared", "rollplex"])
def test_the_planner_counts_no_reference_where_the_run_has_none(mode):
    """The 3B video_long plan: without the reference no reference class and no reference phase; every phase that
    held the reference holds exactly its weights (and, in rollplex, its prefix K/V) less; nothing can release it."""
    over = ["+bench=video_long", f"mode.name={mode}", "memory.plan=phase"]  # runtime_plan reads a named plan
    scored, bare = (load_run_config(over + [f"train.reference={r}"]) for r in ("always", "auto"))
    shape = workload_shape(scored)
    a, b = (summarize(runtime_plan(c, shape), mode) for c in (scored, bare))
    assert not any(n.startswith("reference_") for n in b["classes"]) and "ref_logp" not in b["phase_gib"]
    assert "reference_weights" in a["classes"] and "ref_logp" in a["phase_gib"]
    for ph, gib in b["phase_gib"].items():
        ref = sum(v for n, v in a["by_phase_gib"][ph].items() if n.startswith("reference_"))
        assert gib == pytest.approx(a["phase_gib"][ph] - ref, abs=1e-9), ph
    if mode == "rollplex":
        assert {"reference_weights", "reference_prefix_kv"} <= set(a["by_phase_gib"]["rollout"])
    assert "reference_weights" not in releasable(bare) and "reference_weights" in releasable(scored)
