"""Prefix stages of several groups as one forward (`workload.prefix_pack_tokens`): the same K/V, log-probs,
loss and gradients as one group per forward (docs/design.md §3, fp32 CPU, 1e-5), through the prefix/response
execution at TP 1 and 2 and PP 2 and through a rollplex training step."""
import pytest
import torch
import torch.nn.functional as F

from rollplex_megatron.attention.prefix import dense_reference, pack_index, segment_attention
from rollplex_megatron.dist import run_local
from rollplex_megatron.prefix.execution import mini_batch_slices, mini_batch_starts, prefix_packs
from rollplex_megatron.recipes import load_run_config
from tests import memory_workers as MW
from tests import prefix_workers as W
from tests import trainer_workers as TW
from tests.test_trainer import TOL as STEP_TOL
from tests.test_trainer import _cfg as trainer_cfg
from tests.test_trainer import _data_cfg as data_cfg
from tests.test_trainer import _param_err, _records_close

TOL = 1e-5
PACK = "workload.prefix_pack_tokens=100000"  # every group of a rank in one pack


def _segments(lens, nq=4, ng=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    return [torch.randn(t, 1, n, d, generator=g) * m for n, m in ((nq, 3.0), (ng, 0.5), (ng, 20.0))]


@pytest.mark.parametrize("lens", [(5, 5, 5), (5, 3, 7, 5, 1), (9,)])
def test_causal_segment_attention_is_one_causal_call_per_segment(lens):
    """Equal lengths share one batched call, ragged ones do not: each segment's rows equal the one-segment
    causal SDPA and the float64 block-causal reference; causal over the whole pack (the groups attending to
    each other) does not."""
    q, k, v = _segments(lens)
    got = segment_attention(q, k, v, pack_index(lens, "cpu"), None, causal=True)
    off, want = 0, []
    for n in lens:
        s = slice(off, off + n)
        qs, ks, vs = (x[s, 0].transpose(0, 1)[None] for x in (q, k, v))
        want.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)[0].transpose(0, 1))
        off += n
    want = torch.cat(want).reshape(sum(lens), 1, -1)
    assert torch.equal(got, want)
    seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    pos = torch.arange(sum(lens))
    allowed = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    ref = dense_reference(q.double(), k.double(), v.double(), allowed, None)
    assert float((got.double() - ref).norm() / ref.norm()) < 1e-6
    across = segment_attention(q, k, v, pack_index((sum(lens),), "cpu"), None, causal=True)
    assert len(lens) == 1 or float((across - got).norm() / got.norm()) > 1e-2


def test_the_planner_counts_a_pack_of_the_shortest_prompts():
    """A pack of 400 tokens holds 8 prefixes of 50 tokens: the planner counts 8 graphs, not 400 // P = 4 of the
    longest prompt (P=100), when the sampled prompts are ragged."""
    from rollplex_megatron.memory.classes import Shape
    from rollplex_megatron.memory.planner import pack_groups

    cfg = load_run_config(["workload.prefix_pack_tokens=400"])
    assert pack_groups(cfg, Shape(16, 8, 100, 10, 0, 2, P_min=50)) == 8
    assert pack_groups(cfg, Shape(16, 8, 100, 10, 0, 2)) == 4
    assert pack_groups(cfg, Shape(3, 8, 100, 10, 0, 2, P_min=50)) == 3  # at most the rank's groups
    minis = load_run_config(["workload.prefix_pack_tokens=400", "train.ppo_mini_batches=3"])
    assert pack_groups(minis, Shape(16, 8, 100, 10, 0, 2, P_min=50)) == 6  # ... of the largest mini-batch's
    assert pack_groups(minis, Shape(16, 8, 100, 10, 0, 2, P_min=50)) == max(map(len, mini_batch_slices(16, 3)))
    assert pack_groups(load_run_config([]), Shape(16, 8, 100, 10, 0, 2, P_min=50)) == 1  # off


def test_prefix_packs_are_consecutive_and_bounded():
    assert prefix_packs([4, 4, 4, 10, 3], 8) == [[0, 1], [2], [3], [4]]
    assert prefix_packs([4, 4, 4, 10, 3], 0) == [[0], [1], [2], [3], [4]]
    assert prefix_packs([4, 4, 4, 10, 3], 10**6) == [[0, 1, 2, 3, 4]]
    with pytest.raises(ValueError, match="workload.prefix_pack_tokens"):
        load_run_config(["workload.prefix_pack_tokens=-2"])  # -1 is auto (the default)
    # a kept group's pack would hold the dropped groups' prefill graph and K/V: refused before any work
    packed = ["workload.prefix_pack_tokens=4096", "train.dynamic_sampling=true"]
    with pytest.raises(ValueError, match="prefix_pack_tokens=0 or train.dynamic_sampling=false"):
        load_run_config(["mode.name=rollplex", *packed]).check_training()
    load_run_config(["mode.name=prefix_shared", *packed]).check_training()  # packs only the kept groups


def test_prefix_packs_end_at_the_ppo_mini_batch_bounds():
    """The trainer's mini-batches and the packs' bounds come from one rule: no pack spans two mini-batches."""
    assert mini_batch_slices(7, 3) == [[0, 1], [2, 3], [4, 5, 6]]
    assert mini_batch_starts(7, 3) == {2, 4} and mini_batch_starts(7, 1) == set()
    assert prefix_packs([4] * 8, 10**6, mini_batch_starts(8, 2)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert prefix_packs([4, 4, 10, 4, 4], 8, frozenset({1})) == [[0], [1], [2], [3, 4]]


def _cfg(tp, pp, seed, *extra):
    return load_run_config([f"parallel.tp={tp}", f"parallel.pp={pp}", "rollout.group_size=4", f"verify.seed={seed}",
                            "verify.groups_per_rank=3", *extra])


@pytest.mark.parametrize("tp,pp,seed", [(1, 1, 7), (2, 1, 8), (1, 2, 9)])
def test_packed_prefixes_match_full_sequences(tiny_hf, tp, pp, seed):
    """Three groups (ragged prompts with an image and a video each) in one pack: the actor's log-probs, loss
    and every gradient and the reference's log-probs against full sequences, as one group per forward is."""
    cfg = _cfg(tp, pp, seed, PACK)
    r = run_local(W.exact, tp * pp, cfg, tiny_hf)[0]
    assert r["max_rel_err_logp"] <= TOL and r["max_rel_err_ref_logp"] <= TOL, r
    assert r["max_rel_err_loss"] <= TOL and r["max_rel_err_grad"] <= TOL, r


def test_packs_that_attend_across_groups_are_detected(tiny_hf):
    r = run_local(W.packs_attend_across_groups, 1, _cfg(1, 1, 7, PACK), tiny_hf)[0]
    assert r["max_rel_err_ref_logp"] > 10 * TOL and r["max_rel_err_grad"] > 10 * TOL, r


@pytest.mark.parametrize("tp,pp", [(1, 1), (1, 2), (2, 1)])
def test_packed_prefix_recompute_equals_the_saved_pack_graph(tiny_hf, tp, pp):
    """The recompute plan over packs (the forward keeps no graph; the backward recomputes one pack at a time)
    against the pack's saved graph: the same log-probs and gradients."""
    cfg = _cfg(tp, pp, 21, PACK)
    for o in run_local(MW.recompute_vs_saved, tp * pp, cfg, tiny_hf):
        assert o["grad_norm_sum"] > 0 and o["same_logp"]
        assert o["err"] <= 1e-6, o["err"]  # same ops on the same inputs: equal up to reduction order


def test_packed_recompute_that_drops_the_graph_is_detected(tiny_hf):
    o = run_local(MW.recompute_vs_saved, 1, _cfg(1, 1, 21, PACK), tiny_hf, "empty_pack_recompute")[0]
    assert o["err"] > 1e-2


def test_the_actor_pack_is_lowered_until_one_recomputed_pack_fits_the_device(monkeypatch):
    """Under memory.plan=phase the actor prefix is recomputed one pack at a time and the planner counts that
    pack's graph: on a GPU with no memory.budget_gib (here a stand-in of 134 GiB of free memory) the actor's
    packs shrink a group at a time until the plan fits, before any work, while the reference and scoring
    prefixes keep the full setting; on CPU (no budget) nothing is lowered."""
    from rollplex_megatron.data import build_source
    from rollplex_megatron.trainer import runtime as R

    # 16 groups of 1039 prefix tokens a step, 14.8 GiB a graph; the plan named (the default is auto)
    over = ["+bench=video_long", "mode.name=rollplex", "memory.plan=phase"]
    cfg = load_run_config(over + ["workload.prefix_pack_tokens=100000"])
    src = build_source(cfg)
    assert R.memory_plan(cfg, src)["actor_pack_tokens"] == 100000  # CPU: no device budget
    monkeypatch.setattr(R, "auto_budget_gib", lambda cfg: 134.0)  # the device's free memory less the margin
    fit = R.memory_plan(cfg, src)
    k = fit["actor_pack_tokens"] // 1039
    assert fit["actor_pack_tokens"] == k * 1039 and 1 < k < 16 and fit["peak_gib"] <= 134
    monkeypatch.setattr(R, "auto_budget_gib", lambda cfg: None)
    over_budget = R.memory_plan(load_run_config(over + [f"workload.prefix_pack_tokens={(k + 1) * 1039}"]), src)
    assert over_budget["peak_gib"] > 134  # one group more would not fit
    assert over_budget["classes"]["update_activations"]["gib"] == pytest.approx(
        (k + 1) * R.memory_plan(load_run_config(over), src)["classes"]["update_activations"]["gib"])
    monkeypatch.setattr(R, "auto_budget_gib", lambda cfg: 60.0)  # not even one group fits: refused, named
    with pytest.raises(ValueError, match="over memory.budget_gib=60"):
        R.memory_plan(cfg, src)
    monkeypatch.setattr(R, "auto_budget_gib", lambda cfg: 134.0)
    auto = R.memory_plan(load_run_config(over + ["workload.prefix_pack_tokens=100000", "memory.plan=auto"]), src)
    ka = auto["actor_pack_tokens"] // 1039  # releases chosen with one group a pack, then the pack grown to fit
    assert auto["released"] == ["actor_prefix_graph"] and 1 < ka < k and auto["peak_gib"] <= 134
    keep = R.memory_plan(load_run_config(over + ["workload.prefix_pack_tokens=100000", "memory.plan=keep"]), src)
    assert keep["actor_pack_tokens"] == 100000  # kept graphs cost the same in any packs: nothing lowered


def test_packed_rollplex_with_ppo_mini_batches_equals_serial(tiny_hf):
    """Each mini-batch's prefixes in one pack and two PPO mini-batches a step: the first update's prefix backward
    runs through its pack of the rollout's prefill, the second recomputes its groups' prefixes at the moved weights;
    two steps equal serial (records and weights within docs/design.md §3), and a run without the prefix backward
    does not."""
    minis = ["train.ppo_mini_batches=2"]
    serial = run_local(TW.run_steps, 1, trainer_cfg("serial", *minis, hf=tiny_hf), 2)[0]
    packed = trainer_cfg("rollplex", *minis, PACK, hf=tiny_hf)
    run = run_local(TW.run_steps, 1, packed, 2)[0]
    assert run["tokens"] == serial["tokens"]
    _records_close(run["records"], serial["records"])
    err, name = _param_err(run, serial)
    assert err <= STEP_TOL, (name, err)
    broken = run_local(TW.run_steps, 1, packed, 2, "skip_prefix_backward")[0]
    assert _param_err(broken, serial)[0] > 10 * STEP_TOL


@pytest.mark.parametrize("mode", ["prefix_shared", "rollplex"])
def test_packed_mini_batches_leave_the_weights_where_serial_does(example_dir, mode):
    """Ragged image and video prompts in one pack, two PPO mini-batches, KL on, a first step whose reward function
    gives 0: the true gradient is exactly 0 (actor = reference, advantages 0) and serial's is 0 bit for bit. Every
    phase packs a mini-batch's groups apart from the other's (rollout prefill, window reference items, scoring), as
    the updates do, so the same kernels give the same log-probs and the weights stay exactly where they were.
    Packs spanning the bound (measured on the development machine: prefix_shared moved 1.7e-4, rollplex 5.4e-7)
    give Adam rounding noise to normalise into a step."""
    cfg = data_cfg(mode, example_dir, PACK, "train.ppo_mini_batches=2", "reward.fn=tests.trainer_workers:no_reward",
                   "reward.format_reward=0")
    run = run_local(TW.run_steps, 1, cfg, 1)[0]
    assert run["records"][0]["reward_mean"] == 0.0
    assert run["records"][0]["kl"] == 0.0
    assert all(torch.equal(run["last"][n], run["first"][n]) for n in run["first"])
    if mode == "rollplex":  # the window's reference prefixes: one pack per mini-batch
        ro = run["records"][0]["rollout"]
        assert ro["items_in_window"] + ro.get("items_after", 0) == 2
