"""megatron optimizer steps and atomic training checkpoints (tiny model, fp32, CPU, gloo).

Resume: 3 uninterrupted steps equal 2 steps + checkpoint + fresh processes + 1 step, bit for bit
(weights, Adam moments and the RNG that draws each step's batch all round-trip); mutants that skip
the optimizer state or the RNG states are caught. Atomicity: crashes mid-file and just before the
directory rename leave the previous checkpoint published. TP=2 vs TP=1: one clipped Adam step gives
the same gathered weights.
"""
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollplex_megatron.dist import run_local
from rollplex_megatron.recipes import load_run_config
from tests import optim_workers as W
from tests.numerics import rel_err

# sdpa also on GPU: these tests are about the optimizer and checkpoints, not the attention backend.
SMALL = ["verify.groups_per_rank=1", "rollout.group_size=2", "verify.responses_per_micro_batch=2",
         "verify.attention_backend=sdpa"]
TOL = 1e-5  # docs/design.md §3, fp32 on CPU


def _cfg(*extra):
    return load_run_config(SMALL + list(extra))


def _identical(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [n for n in a if not torch.equal(a[n], b[n])]


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory):
    """3 uninterrupted steps at TP=2, checkpointed after step 2."""
    run_dir = tmp_path_factory.mktemp("tp2_run")
    return run_dir, run_local(W.train, 2, _cfg("parallel.tp=2"), str(run_dir), 3, 2)


@pytest.fixture(scope="module")
def crashed_run(tmp_path_factory):
    """World 1: step-1 checkpoint, two crashed saves of step 2, then a good one."""
    run_dir = tmp_path_factory.mktemp("crashed_run")
    return run_dir, run_local(W.atomic_failures, 1, _cfg(), str(run_dir))[0]


def test_resume_is_bit_identical(tp2_run):
    run_dir, full = tp2_run
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000002"
    resumed = run_local(W.resume, 2, _cfg("parallel.tp=2"), str(run_dir), 3)
    for a, b in zip(full, resumed):
        assert b["step"] == 2 and b["extra"] == W.EXTRA
        assert _identical(a["params"], b["params"]) == []
        assert _identical(a["reference"], b["reference"]) == []
    assert all(s["update_successful"] and s["grad_norm"] > 0 for s in full[0]["stats"])


@pytest.fixture(scope="module")
def broken_resumes(tp2_run, crashed_run, tmp_path_factory):
    """At TP=2: resumes of `tp2_run` with mutated loading, a load of the TP=1 `crashed_run`, and a load of
    `tp2_run` with its two rank files swapped (the same shapes: the TP shards would load crosswise)."""
    swapped = tmp_path_factory.mktemp("swapped") / "run"
    shutil.copytree(tp2_run[0], swapped)
    step = swapped / "checkpoints" / "step_000002"
    a, b = step / "rank00000.pt", step / "rank00001.pt"
    a.rename(step / "tmp.pt")
    b.rename(a)
    (step / "tmp.pt").rename(b)
    return run_local(W.broken_resumes, 2, _cfg("parallel.tp=2"), str(tp2_run[0]), 3,
                     ["skip_optimizer", "skip_rng"], str(crashed_run[0]), str(swapped))[0]


@pytest.mark.parametrize("mutant", ["skip_optimizer", "skip_rng"])
def test_resume_breakage_is_detected(tp2_run, broken_resumes, mutant):
    full, params = tp2_run[1][0]["params"], broken_resumes["mutants"][mutant]
    diff = max(float((params[n] - full[n]).abs().max()) for n in params)
    assert diff > 1e-4, diff


def test_crash_leaves_previous_checkpoint(crashed_run):
    _, r = crashed_run
    assert r["errors"] == ["torch.save crashed mid-file", "crashed just before the rename to step_000002",
                           "crashed just before the rename to latest"]
    after = r["after_failures"]
    assert after["latest"] == "step_000001"
    assert [d for d in after["listing"] if d.startswith("step_") and ".tmp-" not in d] == ["step_000001"]
    # a failed save removes what it wrote: no half-written file, no temporary step directory
    assert not any(".tmp-" in d for d in after["listing"]) and after["tmp_files"] == []
    # A crash between the directory rename and the `latest` rename: step 2 is complete but unnamed.
    assert r["after_latest_failure"]["latest"] == "step_000001"
    assert "step_000002" in r["after_latest_failure"]["listing"]
    assert r["loaded_step"] == 1 and r["loaded_extra"] == {"step": 1} and r["restored"]
    retry = r["after_retry"]  # leftovers do not block saving step 2 again; the orphan is set aside
    assert retry["latest"] == "step_000002"
    assert any(d.startswith("step_000002.tmp-orphan-") for d in retry["listing"])


def test_load_into_other_layout_names_the_setting(broken_resumes):
    msg = broken_resumes["foreign_error"]
    assert "parallel.tp=1" in msg and "parallel.tp=2" in msg, msg


def test_a_saved_reference_is_left_unread_by_a_run_without_one(broken_resumes):
    """Checkpoints from before train.reference saved the reference always; a run at kl_coef 0 (auto: no reference)
    resumes from them with the actor as saved."""
    assert broken_resumes["without_reference"] == {"saved_reference": True, "actor_equal": True}


def test_rank_files_of_other_ranks_are_refused(broken_resumes):
    msg = broken_resumes["swapped_error"]
    assert "rank00000.pt holds the shard of (tp, pp, dp) ranks {'tp': 1, 'pp': 0, 'dp': 0}" in msg, msg


def test_adam_step_tp2_matches_tp1(tiny_hf):
    # adam_eps=1e-4: with 1e-8 Adam's first update is ~lr*sign(g), and parameters whose exact
    # gradient is zero (k_proj bias: softmax is shift invariant) would step by +-lr on rounding noise.
    opts = ["optim.lr=1e-3", "optim.clip_grad=0.1", "optim.adam_eps=1e-4"]
    one = run_local(W.one_step_hf, 1, _cfg(*opts), str(tiny_hf))[0]
    two = run_local(W.one_step_hf, 2, _cfg("parallel.tp=2", *opts), str(tiny_hf))[0]
    n1, n2 = one["stats"]["grad_norm"], two["stats"]["grad_norm"]
    assert n1 > 10 * 0.1 and abs(n2 - n1) / n1 <= TOL  # clipping is active and sees the same norm
    init = {k: v for f in sorted(Path(tiny_hf).glob("*.safetensors")) for k, v in load_file(f).items()}
    w1, w2 = one["weights"], two["weights"]
    assert w1.keys() == w2.keys() == init.keys()
    errs = {n: rel_err(w2[n], w1[n]) for n in w1}
    assert max(errs.values()) <= TOL, sorted(errs.items(), key=lambda kv: -kv[1])[:4]
    flat = lambda d: torch.cat([d[n].flatten().float() for n in sorted(d)])  # noqa: E731
    assert rel_err(flat(w1), flat(init)) > 1e-3  # the step moves weights far beyond the tolerance


def test_a_full_disk_names_the_filesystem_and_leaves_the_last_checkpoint(tmp_path):
    r = run_local(W.disk_full_saves, 1, _cfg(), str(tmp_path))[0]
    for case in ("before", "midway"):
        msg = r[case]
        assert msg.startswith("no space left on /") and "rank00000.pt" in msg and "step_000001" in msg, msg
        snap = r[f"{case}_snapshot"]
        assert snap["latest"] == "step_000001" and not any(".tmp-" in d for d in snap["listing"]), snap
    assert r["after_retry"]["latest"] == "step_000002"
