"""Response packing: by count or up to a token budget (`workload.micro_batch_tokens`); the packing does not
change the update (fp32, CPU)."""
import pytest
import torch

from rollplex_megatron.dist import run_local
from rollplex_megatron.memory import planner as M
from rollplex_megatron.prefix.batch import Group, Prompt, full_micro_batches, pack_responses, response_micro_batches
from rollplex_megatron.recipes import load_run_config
from tests import trainer_workers as W
from tests.in_turn import case, in_turn
from tests.test_trainer import TOL, _param_err, _records_close


def _check_packing(lens: list[int], budget: int, runs: list[list[int]]) -> None:
    """Every response once, in order, never split; each micro-batch within the budget unless it is one
    over-long response; greedy: the next micro-batch's first response did not fit in the one before."""
    assert [i for run in runs for i in run] == list(range(len(lens)))
    for a, b in zip(runs, runs[1:]):
        assert sum(lens[i] for i in a) + lens[b[0]] > budget, (a, b)
    for run in runs:
        assert run and (sum(lens[i] for i in run) <= budget or len(run) == 1), run


def _lengths(seed: int, budget: int, n: int = 300) -> list[int]:
    """Log-normal lengths around a third of the budget: many short ones, some several budgets long."""
    g = torch.Generator().manual_seed(seed)
    return [max(1, int(x)) for x in (torch.randn(n, generator=g) * 1.3).exp() * budget / 3]


@pytest.mark.parametrize("seed,budget", [(0, 7), (1, 64), (2, 1000)])
def test_token_packer_keeps_the_budget_and_the_order(seed, budget):
    lens = _lengths(seed, budget)
    runs = pack_responses(lens, 8, budget)
    _check_packing(lens, budget, runs)
    assert any(len(r) == 1 and lens[r[0]] > budget for r in runs)  # an over-long response, alone
    assert max(len(r) for r in runs) > 2
    ones = pack_responses([1] * 2 * budget, 8, budget)  # the count (8) is ignored under a budget
    assert ones == [list(range(budget)), list(range(budget, 2 * budget))]
    assert pack_responses(lens, 8) == [list(range(i, min(i + 8, len(lens)))) for i in range(0, len(lens), 8)]


def _drop_first_overflow(lens, per_mb, budget):
    runs = pack_responses(lens, per_mb, budget)
    i = next(k for k, r in enumerate(runs[1:], 1) if len(r) > 1)
    return runs[:i] + [runs[i][1:]] + runs[i + 1:]


@pytest.mark.parametrize("mutant", [
    _drop_first_overflow,  # the response that overflowed a micro-batch is lost
    lambda lens, p, b: [[i] for i in range(len(lens))],  # a micro-batch per response (not filled)
    lambda lens, p, b: [r[:1] + r for r in pack_responses(lens, p, b)],  # a response split over two rows
    lambda lens, p, b: [r[::-1] for r in pack_responses(lens, p, b)],  # order not kept
    lambda lens, p, b: [sum(pack_responses(lens, p, b)[:2], [])] + pack_responses(lens, p, b)[2:],  # over budget
])
def test_packing_check_detects_a_broken_packer(mutant):
    lens = _lengths(3, 50)
    _check_packing(lens, 50, pack_responses(lens, 8, 50))
    with pytest.raises(AssertionError):
        _check_packing(lens, 50, mutant(lens, 8, 50))


def test_both_micro_batch_kinds_pack_the_same_responses_under_a_budget():
    """Serial's full sequences and the response stage hold the same responses (the budget counts response
    tokens only), with the same loss weights in total as under count packing."""
    cfg = load_run_config(["model=tiny"]).model
    g = torch.Generator().manual_seed(5)
    groups = [Group(Prompt(torch.randint(1, 300, (int(torch.randint(2, 40, (1,), generator=g)),), generator=g)),
                    [torch.randint(1, 300, (n,), generator=g) for n in _lengths(gi, 12, 4)],
                    torch.randn(4, generator=g) * 10 ** (gi - 2)) for gi in range(5)]
    n_tok = sum(r.numel() for gr in groups for r in gr.responses)
    resp, full = (f(cfg, groups, 3, n_tok, max_tokens=12) for f in (response_micro_batches, full_micro_batches))
    count = response_micro_batches(cfg, groups, 3, n_tok)
    assert [mb.responses for mb in resp] == [mb.responses for mb in full] != [mb.responses for mb in count]
    lens = [r.numel() for gr in groups for r in gr.responses]
    flat = [(gi, ri) for gi in range(5) for ri in range(4)]
    _check_packing(lens, 12, [[flat.index(k) for k in mb.responses] for mb in resp])
    for a, b in zip(resp, full):
        assert int(a.label_mask.sum()) == int(b.label_mask.sum()) == sum(lens[flat.index(k)] for k in a.responses)
        assert torch.equal(a.labels[a.label_mask], b.labels[b.label_mask])
    total = lambda mbs: torch.cat([mb.weight.flatten() for mb in mbs]).double().sum()  # noqa: E731
    assert float(total(resp)) == pytest.approx(float(total(count)), rel=1e-12)


# One rollplex step (tiny preset, BASE's optimizer settings): 16 responses whose lengths (drawn per group:
# 4, 16, 9, 1 tokens at this seed) pack into 4 micro-batches by count and into 11 under a 10-token budget,
# with 16-token responses alone and the short ones together.
STEP = ["model=tiny", "optim.adam_eps=1e-6", "optim.lr=3e-4", "workload.rollout_batch=16", "rollout.group_size=4",
        "workload.responses_per_micro_batch=5", "train.kl_coef=0.1", "task.format_reward=0.5",
        "task.max_answer_tokens=16", "rollout.length_dist=lognormal", "rollout.length_mean=5", "mode.name=rollplex"]
BUDGET = 10


@pytest.fixture(scope="module")
def packed_runs():
    """Count packing, token packing and a packer that packs overflowing responses twice (its patch undone after
    its case), in one job."""
    tokens = load_run_config(STEP + [f"workload.micro_batch_tokens={BUDGET}"])
    return run_local(in_turn, 1, {"count": (W.run_steps, (load_run_config(STEP), 1)),
                                  "tokens": (W.run_steps, (tokens, 1)),
                                  "twice_overflow": (W.run_steps, (tokens, 1, "twice_overflow"))})[0]


def test_token_budget_gives_the_count_packing_update(packed_runs):
    count, tok = case(packed_runs, "count"), case(packed_runs, "tokens")
    assert tok["tokens"] == count["tokens"]
    lens = [len(r) for g in count["tokens"][0] for r in g]
    sizes = tok["micro_batches"][0]
    assert len(sizes) != len(count["micro_batches"][0])  # the packings really differ
    assert count["micro_batches"][0] == [5, 5, 5, 1]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    runs = [list(range(s, s + n)) for s, n in zip(starts, sizes)]
    _check_packing(lens, BUDGET, runs)  # the trainer packed by the budget
    assert any(len(r) == 1 and lens[r[0]] > BUDGET for r in runs) and max(sizes) > 1
    # the first step's loss is 0 up to fp32 rounding (ratio 1, group-centred advantages, a group's responses
    # of one length): compared absolutely, as in test_trainer's knobs test; the gradient carries the comparison
    _records_close(tok["records"], count["records"], keys=("kl", "entropy", "grad_norm"))
    assert abs(tok["records"][0]["loss"] - count["records"][0]["loss"]) < 1e-6
    err, name = _param_err(tok, count)
    assert err <= TOL, (name, err)


def test_token_budget_comparison_detects_a_packer_that_repeats_a_response(packed_runs):
    """The broken packer's micro-batches pass a count check (every response is in one) but hold some twice."""
    count, bad = case(packed_runs, "count"), case(packed_runs, "twice_overflow")
    assert bad["tokens"] == count["tokens"] and sum(bad["micro_batches"][0]) > 16
    err, _ = _param_err(bad, count)
    assert err > 10 * TOL


def test_planner_sizes_micro_batches_from_the_budget():
    """Under a budget the shape holds enough R-token responses to cover it (at most the rank's samples), so a
    budget of k responses' tokens plans what a count of k does in the response stage; serial's micro-batches
    carry each response's prompt, and a 30-token budget may hold 30 one-token responses: planned as a count of 30
    (`planner.full_sequence_responses`)."""
    base = ["dtype=bfloat16", "workload.rollout_batch=32", "rollout.group_size=4", "plan.prefix_tokens=100",
            "plan.response_tokens=10", "plan.vision_patches=64"]
    by_count = load_run_config(base + ["workload.responses_per_micro_batch=3"])
    for budget, mb in ((30, 3), (25, 3), (21, 3), (5, 1), (10_000, 32)):
        cfg = load_run_config(base + [f"workload.micro_batch_tokens={budget}"])
        assert M.workload_shape(cfg).mb == mb, budget
    cfg = load_run_config(base + ["workload.micro_batch_tokens=30"])
    by_30 = load_run_config(base + ["workload.responses_per_micro_batch=30"])
    for mode, count in (("serial", by_30), ("rollplex", by_count)):
        a = M.summarize(M.plan(cfg, mode, "phase", "embedded"), mode)["classes"]["update_activations"]
        b = M.summarize(M.plan(count, mode, "phase", "embedded"), mode)["classes"]["update_activations"]
        assert a == b, mode


def test_token_budget_over_dp2_with_uneven_micro_batch_counts():
    """At DP=2 a 20-token budget gives the ranks different numbers of micro-batches (their responses differ in
    length); every rank calls megatron's gradient reduction once, and the update is count packing's."""
    calls = {b: (W.run_steps, (load_run_config(STEP + ["parallel.dp=2", f"workload.micro_batch_tokens={b}"]), 1))
             for b in (0, 20)}
    res = run_local(in_turn, 2, calls, False)
    count, tok = [case(r, 0) for r in res], [case(r, 20) for r in res]
    assert [len(r["micro_batches"][0]) for r in count] == [2, 2]
    assert len({len(r["micro_batches"][0]) for r in tok}) == 2
    assert [r["tokens"] for r in tok] == [r["tokens"] for r in count]
    _records_close(tok[0]["records"], count[0]["records"], keys=("kl", "entropy", "grad_norm"))
    err, name = _param_err(tok[0], count[0])
    assert err <= TOL, (name, err)
