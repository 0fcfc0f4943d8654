"""Rollout engine: shared-prefix decode attention, sampling, engine vs a plain recompute loop, TP, window."""
import re
from pathlib import Path

import pytest
import torch

from rollplex_megatron.attention.decode import group_slots, shared_prefix_decode_attention
from rollplex_megatron.attention.prefix import dense_reference
from rollplex_megatron.dist import run_local
from rollplex_megatron.recipes import load_run_config
from rollplex_megatron.rollout.sampling import SamplingParams, filter_logits, sample_tokens
from tests import rollout_workers as W
from tests.in_turn import case, in_turn


def _decode_case(seed, n_groups=3, ng=2, rep=3, d=8, r_max=6):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, 9, (n_groups,), generator=g)
    p_max = int(lens.max())
    scale_mag = 10.0 ** torch.randint(-2, 2, (1,), generator=g).item()  # very different magnitudes
    pk = torch.randn(n_groups, p_max, ng, d, generator=g) * scale_mag
    pv = torch.randn(n_groups, p_max, ng, d, generator=g)
    group_B = torch.tensor([0, 0, 2, 1, 2, 2, 0])  # active rows, groups interleaved, uneven counts
    b = group_B.numel()
    rk = torch.randn(b, r_max, ng, d, generator=g) * scale_mag
    rv = torch.randn(b, r_max, ng, d, generator=g)
    rlen = torch.randint(1, r_max + 1, (b,), generator=g)
    q = torch.randn(b, ng * rep, d, generator=g)
    return q, pk, pv, lens, group_B, rk, rv, rlen


def _dense(q, pk, pv, lens, group_B, rk, rv, rlen, scale):
    outs = []
    for i in range(q.shape[0]):
        gi, n = int(group_B[i]), int(rlen[i])
        k = torch.cat([pk[gi, :lens[gi]], rk[i, :n]])[:, None]
        v = torch.cat([pv[gi, :lens[gi]], rv[i, :n]])[:, None]
        allowed = torch.ones(1, k.shape[0], dtype=torch.bool)
        outs.append(dense_reference(q[i][None, None], k, v, allowed, scale)[0, 0])
    return torch.stack(outs)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shared_prefix_decode_matches_per_sample_attention(seed):
    case = _decode_case(seed)
    scale = case[0].shape[-1] ** -0.5
    got = shared_prefix_decode_attention(*case, scale)
    want = _dense(*case, scale)
    assert float((got - want).norm() / want.norm()) < 1e-5
    # mutation: every sample reads group 0's prefix -> must differ
    q, pk, pv, lens, group_B, rk, rv, rlen = case
    wrong = shared_prefix_decode_attention(q, pk, pv, lens, torch.zeros_like(group_B), rk, rv, rlen, scale)
    assert float((wrong - want).norm() / want.norm()) > 1e-2


def test_group_slots_ranks_samples_within_groups():
    slot, s_max = group_slots(torch.tensor([1, 0, 1, 1, 0]), 3)
    assert slot.tolist() == [0, 0, 1, 2, 1] and s_max == 3


def test_filters_keep_the_right_sets():
    x = torch.tensor([[3.0, 1.0, 2.0, 0.0]])
    assert torch.isinf(filter_logits(x, 2, 1.0)).tolist() == [[False, True, False, True]]
    p = torch.softmax(x, -1)[0]  # top token alone has mass p0; p0 + p2 exceeds 0.8
    kept = ~torch.isinf(filter_logits(x, 0, float(p[0]) + 1e-3))
    assert kept.tolist() == [[True, False, True, False]]
    assert (~torch.isinf(filter_logits(x, 0, 0.01))).sum() == 1  # the most likely token always stays


def test_sampling_is_reproducible_and_validates():
    logits = torch.randn(4, 50)
    u = torch.rand(4, 50, generator=torch.Generator().manual_seed(0))
    a = sample_tokens(logits, SamplingParams(0.7, 0.9, 10), u)
    b = sample_tokens(logits, SamplingParams(0.7, 0.9, 10), u.clone())
    assert torch.equal(a[0], b[0])
    assert torch.allclose(a[1], torch.log_softmax(logits / 0.7, -1).gather(-1, a[0][:, None])[:, 0])
    for bad in ({"temperature": 0.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}):
        with pytest.raises(ValueError, match=list(bad)[0]):
            SamplingParams(**bad)
        key, value = next(iter(bad.items()))
        with pytest.raises(Exception, match=f"rollout.{key} must be"):  # the config names its own setting
            load_run_config([f"rollout.{key}={value}"])


def _cfg(tp=1, pp=1):
    return load_run_config(["model=tiny", f"parallel.tp={tp}", f"parallel.pp={pp}"])


def _same(engine, reference, tol=1e-5):
    """Same tokens and finish reasons; log-probs within the norm-relative fp32 tolerance of docs/design.md §3 (the two
    executions reduce in different orders: other kernels, other TP splits, other thread counts)."""
    assert len(engine) == len(reference)
    got, want = [], []
    for (et, elp, ef), (rt, rlp, rf) in zip(engine, reference):
        assert et == rt and ef == rf
        for a, b in zip(elp, rlp):
            assert len(a) == len(b)
            got += a
            want += b
    got, want = torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
    assert float((got - want).norm() / want.norm()) < tol


def test_same_detects_one_wrong_logprob():
    """Mutation check of `_same`: one log-prob off by 1e-3 (in a run of 40) fails it, rounding does not."""
    lp = [[-6.0 + 0.1 * i for i in range(20)], [-3.0 - 0.05 * i for i in range(20)]]
    ref = [([[1, 2]], lp, ["stop"])]
    _same([([[1, 2]], [[x * (1 + 1e-7) for x in row] for row in lp], ["stop"])], ref)
    off = [row[:] for row in lp]
    off[1][7] += 1e-3
    with pytest.raises(AssertionError):
        _same([([[1, 2]], off, ["stop"])], ref)
    with pytest.raises(AssertionError):
        _same([([[1, 3]], lp, ["stop"])], ref)


RECOMPUTE = {"greedy": (SamplingParams(), 1.0), "sampled_small_budget": (SamplingParams(0.8, 0.9, 40), 6e-5)}
TP2_PARAMS, PP2_PARAMS = SamplingParams(1.0, 1.0, 0), SamplingParams(0.9, 0.95, 0)
MECHANISMS = ["interleave", "after", "stream", "tail", "auto"]
KEPT_PARAMS = SamplingParams(0.8, 0.9, 0)


@pytest.fixture(scope="module")
def one_rank(tiny_hf):
    """Every one-process engine run of this file's TP=1 PP=1 tests in one job (`tests.in_turn`): each case
    sets up its own model from the checkpoint, as in a job of its own."""
    hf, calls = str(tiny_hf), {}
    for name, (params, budget) in RECOMPUTE.items():
        calls["recompute", name] = (W.engine_vs_recompute, (_cfg(), hf, params, budget))
    calls["engine_only", "tp2"] = (W.engine_only, (_cfg(1), hf, TP2_PARAMS))
    calls["engine_only", "pp2"] = (W.engine_only, (_cfg(), hf, PP2_PARAMS))
    for m in MECHANISMS:
        calls["window", m] = (W.window_items_match, (_cfg(), hf, SamplingParams(), m))
    calls["kept", ""] = (W.engine_kept_state, (_cfg(), hf, KEPT_PARAMS))
    calls["kept", "length"] = (W.engine_kept_state, (_cfg(), hf, KEPT_PARAMS, "float32", "length"))
    calls["kept", "failed"] = (W.engine_kept_state, (_cfg(), hf, KEPT_PARAMS, "float32", "failed"))
    return run_local(in_turn, 1, calls)[0]


@pytest.mark.parametrize("name", list(RECOMPUTE))
def test_engine_matches_full_recompute_loop(one_rank, name):
    budget = RECOMPUTE[name][1]
    res = case(one_rank, ("recompute", name))
    _same(res["engine"], res["reference"])
    assert sum(f == "stop" for _, _, fins in res["engine"] for f in fins) > 0  # stop tokens exercised
    assert res["waves"] == (1 if budget == 1.0 else 3)  # a small budget queues requests into waves


def test_engine_tp2_equals_tp1(tiny_hf, one_rank):
    one = case(one_rank, ("engine_only", "tp2"))
    two = run_local(W.engine_only, 2, _cfg(2), str(tiny_hf), TP2_PARAMS)
    assert two[0] == two[1]  # every TP rank samples the same tokens
    _same(two[0], one)


def test_engine_pp2_equals_pp1(tiny_hf, one_rank):
    """Two pipeline stages: prefill across the pipeline, decode passing hidden states stage to stage,
    the last stage's tokens broadcast; both stages return the same results, equal to one stage's."""
    one = case(one_rank, ("engine_only", "pp2"))
    two = run_local(W.engine_only, 2, _cfg(pp=2), str(tiny_hf), PP2_PARAMS)
    assert two[0] == two[1]
    _same(two[1], one)


def test_window_items_at_pp2_equal_direct_work(tiny_hf):
    """The interleave window at two stages: every stage runs the same item after the same step."""
    res = run_local(W.window_items_match, 2, _cfg(pp=2), str(tiny_hf), SamplingParams(), "interleave")
    for r in res:
        assert r["same_keys"] and r["max_abs_diff"] == 0.0
        assert r["stats"]["items_in_window"] + r["stats"]["items_after"] == 3
    assert res[0]["actives"] == res[1]["actives"]


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_window_items_equal_direct_work(one_rank, mechanism):
    """Items run inside the window give the same K/V as direct work: on the decode thread
    (interleave) or on the issuer thread (stream, tail; on CPU without a side stream). `tail` starts its
    issuer only once the active batch has halved; `after` runs none of them while decoding; `auto` runs
    what the shipped table says at the wave's batch."""
    from rollplex_megatron.rollout.window import policy_mechanism

    res = case(one_rank, ("window", mechanism))
    assert res["same_keys"] and res["max_abs_diff"] == 0.0
    st = res["stats"]
    assert st["items_in_window"] + st["items_after"] == 3
    if mechanism == "auto":  # the shipped table's winner at this batch (after, where no window beats it)
        mechanism = policy_mechanism(res["wave_start"])[0]
    assert st["window_mechanism"] == mechanism
    # side mechanisms run exactly the in-window items on the issuer thread; the rest after decode
    assert res["issuer_items"] == (st["items_in_window"] if mechanism in ("stream", "tail") else 0)
    if mechanism == "tail":  # (active samples, items finished before the step's hook) per step
        half = 0.5 * res["wave_start"]
        assert all(done == 0 for active, done in res["actives"] if active > half)  # nothing ran early
        late = [active for active, _ in res["actives"] if 0 < active <= half]
        assert (st["items_in_window"] >= 1) == bool(late)
    elif mechanism == "interleave":
        assert st["items_in_window"] >= 1
        assert [done for _, done in res["actives"][:3]] == [0, 1, 2]  # one item per step, on the decode thread
    elif mechanism == "after":  # no window: nothing while decoding, every item once it ends
        assert st["items_in_window"] == 0 and st["items_after"] == 3
        assert all(done == 0 for _, done in res["actives"])
    else:
        assert st["items_in_window"] >= 1


def test_window_policy_reads_the_measured_table(tmp_path):
    import json

    from rollplex_megatron.rollout.window import POLICY_PATH, DecodeWindow, policy_mechanism
    from rollplex_megatron.rollout.window.policy import build_policy

    shipped = json.loads(POLICY_PATH.read_text())
    assert shipped["source"].startswith("benchmarks/results/") and shipped["rows"]
    bench = json.loads((Path(__file__).resolve().parents[1] / shipped["source"]).read_text())
    assert build_policy(bench, shipped["source"], shipped["margin"])["rows"] == shipped["rows"]  # what ran, rebuilt

    def row(case, batch, **walls):
        return {"case": case, "batch": batch, "decode_alone": {"after_prefill_s": 1.0}, "items_alone_s": 1.0,
                "mechanisms": {k.replace("_", ":"): ({"after_prefill_s": v} if v else {"error": "refused"})
                               for k, v in walls.items()}}

    bench = {"rows": [row("uniform_b16", 16, interleave=2.0, tail=1.5, stream=1.9),
                      row("uniform_b128", 128, interleave=2.0, stream=1.97, tail=2.5),  # within the margin: a tie
                      row("uniform_b64", 64, interleave=2.0, green_48=1.2, green_32=1.4, stream=None),
                      row("longtail_b64", 64, interleave=2.0, stream=1.5)]}
    t = tmp_path / "table.json"
    t.write_text(json.dumps(build_policy(bench, "x.json")))
    assert policy_mechanism(20, t) == ("tail", 0)  # the shortest wall time of decode plus side work
    assert policy_mechanism(100, t) == ("after", 0)  # 1.5% faster is noise: no window (decode, then the items) stays
    assert policy_mechanism(60, t, "uniform") == ("green", 48)  # the partition size comes with the winner
    assert policy_mechanism(60, t, "longtail") == ("stream", 0)  # the workload shape picks its own rows
    window = DecodeWindow("auto", green_sms=8, policy_path=t)
    window.on_wave(70)
    assert (window._resolved, window.green_sms) == ("green", 48)  # nearest batch, the larger gain of the two rows
    only = build_policy({"rows": [row("uniform_b8", 8, stream=2.5)]}, "y.json")["rows"][0]
    assert only["wall_s"] == {"stream": 2.5, "after": 2.0} and only["mechanism"] == "after"  # after: 1 s + 1 s
    assert policy_mechanism(64, tmp_path / "missing.json") == ("interleave", 0)
    with pytest.raises(Exception, match="mode.window must be one of"):
        load_run_config(["mode.window=fast"])
    with pytest.raises(Exception, match="mode.window_tail_fraction"):
        load_run_config(["mode.window_tail_fraction=0"])


def test_engine_bad_input(tiny_hf):
    """Each kind of bad request fails naming the setting (one process, one model, every kind in turn)."""
    want = {"prompt": "rollout.max_prompt_len", "budget": "memory.kv_cache_gib", "length": "rollout.max_response_len",
            "placeholder": r"request \d: \d+ video tokens but the video grids give \d+ embeddings",
            "prefix_placeholder": r"ValueError: \d+ video tokens but the video grids give"}
    errors = run_local(W.engine_bad_inputs, 1, _cfg(), str(tiny_hf), list(want))[0]
    for what, match in want.items():
        assert errors[what] is not None, f"{what}: no error"
        assert re.search(match, errors[what]), (what, errors[what][-2000:])


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_kv_budget_check_at_start_is_the_engines_bound(tiny_hf, tp, pp):
    """`check_kv_budget` (before any model) accepts one group of the longest prompt exactly where the engine's
    first step would, and refuses one byte under it, naming the setting: the same bytes at TP (KV heads split)
    and PP (a stage's layers)."""
    outs = run_local(W.kv_budget_edge, tp * pp, _cfg(tp, pp), str(tiny_hf))
    for o in outs:
        assert o["at"] == {"engine": None, "check": None}, o
        assert o["under"]["engine"] and "memory.kv_cache_gib" in o["under"]["engine"], o
        assert re.search(r"^memory\.kv_cache_gib=\S+ is too small: one group of the rendered task's prompt \(\d+ "
                         r"tokens\) with rollout\.group_size=\d+ responses .*raise memory\.kv_cache_gib",
                         o["under"]["check"]), o
    assert len({o["need"] for o in outs}) == 1


def test_issuer_errors_surface_and_the_thread_stops():
    """An item failing on the issuer thread is raised on the decode thread at the next step; the
    thread is joined and the GIL switch interval restored. `abort` (a failed rollout) stops it too."""
    import sys
    import time

    from rollplex_megatron.rollout.window import DecodeWindow

    before = sys.getswitchinterval()
    w = DecodeWindow("stream")
    w.submit("bad", lambda: 1 / 0)
    w.submit("never", lambda: None)
    w.on_wave(8)
    w.on_decode_step(1, 8)  # starts the issuer
    t0 = time.time()
    while w._error is None and time.time() - t0 < 10:
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match="issuer thread: ZeroDivisionError"):
        w.on_decode_step(2, 8)
    assert w._issuer is None and sys.getswitchinterval() == before and len(w.queue) == 1
    slow = DecodeWindow("stream")
    for i in range(50):
        slow.submit(f"slow[{i}]", lambda: time.sleep(0.02))
    slow.on_wave(8)
    slow.on_decode_step(1, 8)
    slow.abort()
    assert slow._issuer is None and sys.getswitchinterval() == before
    assert 1 <= len(slow.finished) < 50 and len(slow.queue) == 50 - len(slow.finished)  # stopped early


def test_row_uniforms_are_open_interval_batch_independent_and_spread():
    from rollplex_megatron.rollout.sampling import request_uniforms, row_uniforms

    u = request_uniforms(11, 64, 5, 152064)
    assert float(u.min()) > 0 and float(u.max()) < 1  # Gumbel needs log(-log(u)) finite
    assert abs(float(u.mean()) - 0.5) < 1e-3 and abs(float(u.std()) - 12 ** -0.5) < 1e-3
    alone = row_uniforms(torch.tensor([11]), torch.tensor([37]), torch.tensor([5]), 152064)
    assert torch.equal(alone[0], u[37])  # a sample's draws do not depend on the batch around it
    assert not torch.equal(request_uniforms(11, 1, 6, 100), request_uniforms(11, 1, 5, 100))  # steps differ
    assert not torch.equal(request_uniforms(12, 1, 5, 100), request_uniforms(11, 1, 5, 100))  # seeds differ


def test_side_stream_windows_need_tp1():
    with pytest.raises(Exception, match="needs parallel.tp=1 and parallel.pp=1"):
        load_run_config(["mode.window=stream", "parallel.tp=2"])
    with pytest.raises(Exception, match=r"\(got tp=1, pp=2\)"):
        load_run_config(["mode.window=tail", "parallel.pp=2"])
    assert load_run_config(["mode.window=auto", "parallel.tp=2"]).mode.window == "auto"  # resolves to interleave


def test_window_policy_command_writes_the_table(tmp_path, capsys):
    import json

    from rollplex_megatron.cli import main
    from rollplex_megatron.rollout.window import POLICY_PATH

    out = tmp_path / "p.json"
    src = json.loads(POLICY_PATH.read_text())["source"]
    root = Path(__file__).resolve().parents[1]
    assert main(["window-policy", "--from", str(root / src), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["rows"] == json.loads(POLICY_PATH.read_text())["rows"]
    assert capsys.readouterr().out.startswith(f"wrote {out}\n")  # not the shipped table: said without the note
    (tmp_path / "bad.json").write_text("{")
    (tmp_path / "other.json").write_text('{"rows": [{"case": "x"}]}')
    (tmp_path / "empty.json").write_text('{"rows": []}')
    row = json.loads((root / src).read_text())["rows"][0]
    zero = dict(row, decode_alone=dict(row["decode_alone"], after_prefill_s=0.0), items_alone_s=0.0,
                mechanisms={k: dict(m, after_prefill_s=0.0) for k, m in row["mechanisms"].items()})
    (tmp_path / "zero.json").write_text(json.dumps({"rows": [zero]}))
    odd = dict(row, mechanisms={"green:abc": dict(next(iter(row["mechanisms"].values())), after_prefill_s=1e-3)})
    (tmp_path / "odd.json").write_text(json.dumps({"rows": [odd]}))
    for argv, want in [(["--from", str(tmp_path / "bad.json")], "bad.json is not JSON"),
                       (["--from", str(tmp_path / "other.json")], "other.json is not a decode-window benchmark JSON"),
                       (["--from", str(tmp_path / "empty.json")], "empty.json has no rows"),
                       (["--from", str(tmp_path / "zero.json")], "wall times must be positive seconds"),
                       (["--from", str(tmp_path / "odd.json")], "'green:abc' is not a mechanism"),
                       (["--from", str(root / src), "--margin", "1.5"], "--margin is the share"),
                       (["--from", str(root / src), "--out", str(tmp_path / "no" / "p.json")], "folder"),
                       (["--from", str(tmp_path / "none.json"), "--out", str(out)], "none.json does not exist"),
                       (["--from", str(tmp_path)], f"--from {tmp_path} is a folder"),
                       (["--from", str(root / src), "--out", str(tmp_path)], f"--out {tmp_path} is a folder")]:
        before = POLICY_PATH.read_bytes()
        assert main(["window-policy", *argv]) == 1, argv
        err = capsys.readouterr().err
        assert want in err and err.startswith("error: ") and err.count("\n") == 1, (argv, err)
        assert POLICY_PATH.read_bytes() == before  # the shipped table is left as it was


def test_kept_decode_state_gives_fresh_engines_results(one_rank):
    """rollout.keep_decode_state: one engine decodes five request sets, refilling its kept cache and slot state
    where the shape allows (sets 2 and 4; set 4 inside a cache grown for longer responses), allocating anew
    where not (longer responses, fewer requests); every set's tokens, finish reasons and log-probs are what a
    fresh engine gives (fp32: the grown cache attends over more masked positions, so log-probs to 1e-5)."""
    runs = case(one_rank, ("kept", ""))
    assert [r["reused"] for r in runs[:5]] == [0, 1, 0, 1, 0]
    for r in runs:
        _same(r["kept"], r["fresh"])
    assert runs[1]["kept"] != runs[0]["kept"]  # other seeds: the reuse is not handing back the last results
    _failed_rollout_leaves_no_state(runs[5])


def _failed_rollout_leaves_no_state(r: dict) -> None:
    """After a rollout that failed mid-decode the engine keeps no state: the next rollout allocates anew."""
    assert r["failed_state_dropped"] and r["reused"] == 0, r


def test_kept_decode_state_mutation_fails(one_rank):
    """Mutations: sample lengths not reset when a kept state is reused (the reused sets' results differ); the
    state of a rollout that failed put back (the next rollout reuses it)."""
    runs = case(one_rank, ("kept", "length"))
    assert [r["reused"] for r in runs[:5]] == [0, 1, 0, 1, 0]
    with pytest.raises(AssertionError):
        _same(runs[1]["kept"], runs[1]["fresh"])
    with pytest.raises(AssertionError):
        _failed_rollout_leaves_no_state(case(one_rank, ("kept", "failed"))[5])


def test_trainer_with_kept_decode_state_gives_the_same_run():
    """rollout.keep_decode_state through the trainer: three rollplex steps whose engine keeps its decode state
    (reused from step 2 on) give the run without it: the same rollouts every step and the trained weights
    within the fp32 bound of docs/design.md §3."""
    from tests import trainer_workers as T
    from tests.in_turn import case as one, in_turn
    from tests.test_trainer import TOL, _cfg, _param_err

    cfgs = {k: _cfg("rollplex", f"rollout.keep_decode_state={k}") for k in ("true", "false")}
    runs = run_local(in_turn, 1, {k: (T.run_steps, (cfg, 3)) for k, cfg in cfgs.items()})[0]
    kept, fresh = one(runs, "true"), one(runs, "false")
    reused = [r["rollout"]["states_reused"] for r in kept["records"]]
    assert reused[0] == 0 and min(reused[1:]) >= 1, reused
    assert all(r["rollout"]["states_reused"] == 0 for r in fresh["records"])
    assert kept["tokens"] == fresh["tokens"]
    err, name = _param_err(kept, fresh)
    assert err <= TOL, (name, err)
