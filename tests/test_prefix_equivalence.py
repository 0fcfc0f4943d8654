"""Prefix/response execution equals full-sequence execution (docs/design.md §3, fp32 CPU, 1e-5).

Per-token log-probs, loss and every parameter gradient (DP-reduced) of the actor, and the
reference variant's log-probs, on a random batch: image+video prompts, variable response lengths,
several groups packed per micro-batch, through megatron's no-pipelining and 1F1B schedules.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollplex_megatron.dist import run_local
from rollplex_megatron.recipes import load_run_config
from tests import prefix_workers as W
from tests.in_turn import case, cases, in_turn

TOL = 1e-5


def _cfg(tp, pp, dp, g, seed=7):
    return load_run_config([f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.dp={dp}",
                            f"rollout.group_size={g}", f"verify.seed={seed}"])


def _run_all(worker, cfg, hf):
    return run_local(worker, cfg.parallel.world_size, cfg, hf)


def _run(worker, cfg, hf):
    return _run_all(worker, cfg, hf)[0]


def _bf16_cfg():
    return load_run_config(["dtype=bfloat16", "rollout.group_size=4", "verify.seed=21"])


@pytest.fixture(scope="module")
def shared_jobs(tiny_hf):
    """Runs that need the same layout and patch nothing, one job per layout (`tests.in_turn`; each case
    builds its own models): at one process the fp32 exact case and the bf16 one; at PP=2 the exact case
    and the position-offset mutation (a parameter of the run, no patch)."""
    one = run_local(in_turn, 1, {"exact": (W.exact, (_cfg(1, 1, 1, 4, 7), tiny_hf)),
                                 "bf16": (W.exact, (_bf16_cfg(), None))})[0]
    pp2 = run_local(in_turn, 2, {"exact": (W.exact, (_cfg(1, 2, 1, 4, 9), tiny_hf)),
                                 "offset": (W.wrong_position_offset, (_cfg(1, 2, 1, 4), tiny_hf))}, False)
    return {(1, 1, 1, 4, 7): cases([one], "exact"), "bf16": case(one, "bf16"),
            (1, 2, 1, 4, 9): cases(pp2, "exact"), W.wrong_position_offset: cases(pp2, "offset")}


@pytest.mark.parametrize("tp,pp,dp,g,seed", [
    (1, 1, 1, 4, 7), (2, 1, 1, 4, 8), (1, 2, 1, 4, 9), (2, 2, 1, 4, 10), (1, 1, 2, 4, 11),
    (2, 1, 2, 1, 12), (1, 2, 2, 1, 13),
])
def test_prefix_response_matches_full_sequence(request, tiny_hf, tp, pp, dp, g, seed):
    key = (tp, pp, dp, g, seed)
    ranks = request.getfixturevalue("shared_jobs")[key] if key in ((1, 1, 1, 4, 7), (1, 2, 1, 4, 9)) else _run_all(
        W.exact, _cfg(tp, pp, dp, g, seed), tiny_hf)
    assert all(x["zero_reference_grads_local"] == [] for x in ranks), [x["zero_reference_grads_local"] for x in ranks]
    r = ranks[0]
    assert (r["tp"], r["pp"], r["dp"]) == (tp, pp, dp)
    assert r["max_rel_err_logp"] <= TOL and r["max_rel_err_ref_logp"] <= TOL, r
    assert r["max_rel_err_loss"] <= TOL and r["max_rel_err_grad"] <= TOL, r
    assert r["zero_reference_grads_local"] == [], r
    assert r["ok"] and abs(r["loss"]) > 1e-3


def test_tied_embeddings_over_pipeline(tiny_hf_tied):
    """Tied embeddings on PP=2: the output copy's gradient is synced by finalize_model_grads."""
    r = _run(W.exact, _cfg(2, 2, 1, 3), tiny_hf_tied)
    assert r["ok"], r


@pytest.mark.parametrize("mutant,field", [
    (W.wrong_position_offset, "max_rel_err_logp"),
    (W.dropped_gkv, "max_rel_err_grad"),
    (W.shared_kv_per_response, "max_rel_err_logp"),
])
def test_mechanism_breakage_is_detected(request, tiny_hf, mutant, field):
    r = request.getfixturevalue("shared_jobs")[mutant][0] if mutant is W.wrong_position_offset else _run(
        mutant, _cfg(1, 2, 1, 4), tiny_hf)
    assert r[field] > 100 * TOL, r
    assert not r["ok"]


def test_verify_equivalence_cli():
    cmd = [sys.executable, "-m", "rollplex_megatron", "verify-equivalence", "model=tiny", "parallel.tp=2",
           "parallel.pp=2", "rollout.group_size=4", "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert {"max_rel_err_logp", "max_rel_err_loss", "max_rel_err_grad", "tp", "pp", "dp"} <= set(res)
    assert (res["tp"], res["pp"], res["dp"]) == (2, 2, 1) and res["ok"]


def test_verify_equivalence_hf_dir_takes_the_checkpoints_model(tiny_hf, capsys):
    """--hf-dir sets the model as train.init_hf does: a model= preset that disagrees is refused, not ignored."""
    from rollplex_megatron.cli import main

    assert main(["verify-equivalence", "--hf-dir", str(tiny_hf), "model=qwen2_5_vl_3b"]) == 1
    err = capsys.readouterr().err
    assert "(from model=qwen2_5_vl_3b) disagrees with" in err and "--hf-dir sets the model" in err, err
    assert err.count("\n") == 1
    missing = Path(tiny_hf) / "nowhere"
    assert main(["verify-equivalence", "--hf-dir", str(missing)]) == 1  # named as the user gave it
    err = capsys.readouterr().err
    assert f"--hf-dir {missing}: " in err and "does not exist" in err and "train.init_hf" not in err, err


def test_bf16_gradient_rule_is_against_fp32(shared_jobs):
    """bf16: the prefix path may add at most 1e-2 to the serial path's own error against fp32."""
    r = shared_jobs["bf16"]
    ref = r["fp32_reference_local"]
    assert r["grad_rule"].startswith("excess") and r["ok"], r
    assert 0 < ref["rel_err_grad_global_serial"] < 0.05 and 0 < ref["rel_err_grad_global_prefix"] < 0.05, ref
    assert r["max_grad_excess_over_serial"] <= 1e-2, r


def test_bf16_gradient_rule_detects_dropped_gkv():
    r = _run(W.dropped_gkv, _bf16_cfg(), None)
    assert r["max_grad_excess_over_serial"] > 0.1 and not r["ok"], r
