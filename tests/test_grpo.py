"""GRPO functions against direct computations and by hand."""
import pytest
import torch

from rollplex_megatron.rl import grpo


def test_group_advantages_by_hand():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    a = grpo.group_advantages(r)
    assert torch.allclose(a[0], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    assert torch.equal(a[1], torch.zeros(4))  # equal rewards: no signal, no NaN
    assert torch.allclose(grpo.group_advantages(r, normalize_std=False)[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    with pytest.raises(ValueError, match=r"rewards must be \[prompts, group_size\]"):
        grpo.group_advantages(torch.ones(4))


def test_clipped_ratio_loss_regions():
    logp = torch.log(torch.tensor([1.5, 0.5, 1.1, 0.5]))
    old = torch.zeros(4)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss = grpo.clipped_ratio_loss(logp, old, adv)
    # A>0, r=1.5 -> clipped at 1.2; A>0, r=0.5 -> unclipped 0.5; A<0, r=1.1 -> 1.1; A<0, r=0.5 -> clipped 0.8
    assert torch.allclose(loss, torch.tensor([-1.2, -0.5, 1.1, 0.8]), atol=1e-6)


def test_ratio_one_gradient_is_policy_gradient():
    """On-policy (old = current): the surrogate's gradient equals -A * grad logp."""
    logp = torch.randn(5, requires_grad=True)
    adv = torch.randn(5)
    grpo.clipped_ratio_loss(logp, logp.detach(), adv).sum().backward()
    assert torch.allclose(logp.grad, -adv)


def test_kl_k3_is_unbiased_for_kl():
    torch.manual_seed(0)
    p_logits, q_logits = torch.randn(6), torch.randn(6)
    p, q = torch.softmax(p_logits, 0), torch.softmax(q_logits, 0)
    samples = torch.multinomial(p, 200000, replacement=True)
    est = grpo.kl_k3(torch.log(p)[samples], torch.log(q)[samples]).mean()
    exact = (p * (p.log() - q.log())).sum()
    assert abs(est - exact) < 0.02 * exact + 1e-3
    assert (grpo.kl_k3(torch.log(p)[samples], torch.log(q)[samples]) >= 0).all()


def test_token_mean_uses_global_count():
    v, m = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 1.0, 0.0])
    assert grpo.token_mean(v, m) == 1.5
    assert grpo.token_mean(v, m, total_tokens=6) == 0.5


def _entropy_worker(seed):
    from megatron.core import parallel_state as ps

    from rollplex_megatron.dist import init_parallel

    init_parallel(tp=2)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 7, 40, generator=g) * 4
    logits[..., 37:] = torch.finfo(torch.float32).min  # padded vocabulary columns
    local = logits.chunk(2, dim=-1)[ps.get_tensor_model_parallel_rank()]
    return grpo.vocab_parallel_entropy(local, ps.get_tensor_model_parallel_group()), logits


@pytest.fixture(scope="module")
def entropy_tp2():
    """Both TP=2 entropy workers in one 2-rank job (`tests.in_turn`)."""
    from rollplex_megatron.dist import run_local
    from tests.in_turn import in_turn

    return run_local(in_turn, 2, {"values": (_entropy_worker, (3,)), "grads": (_entropy_grad_worker, (5,))}, False)


def test_vocab_parallel_entropy_matches_full_softmax(entropy_tp2):
    from tests.in_turn import cases

    for h, logits in cases(entropy_tp2, "values"):
        p = torch.softmax(logits[..., :37], -1)
        ref = -(p * p.log()).sum(-1)
        assert torch.allclose(h, ref, atol=1e-5)


def _entropy_grad_worker(seed):
    from megatron.core import parallel_state as ps

    from rollplex_megatron.dist import init_parallel

    init_parallel(tp=2)
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(seed))
    full = logits.clone().requires_grad_(True)
    h = grpo.vocab_parallel_entropy(full.chunk(2, dim=-1)[ps.get_tensor_model_parallel_rank()],
                                    ps.get_tensor_model_parallel_group())
    (h * torch.arange(1.0, 7.0)).sum().backward()  # every rank's local columns get their part
    return full.grad, logits


def test_vocab_parallel_entropy_gradient_matches_full_softmax(entropy_tp2):
    """The entropy bonus differentiates through the TP-split entropy: gradients equal the full one's."""
    from tests.in_turn import cases

    grads = cases(entropy_tp2, "grads")
    logits = grads[0][1].clone().requires_grad_(True)
    p = torch.softmax(logits, -1)
    (-(p * p.log()).sum(-1) * torch.arange(1.0, 7.0)).sum().backward()
    merged = torch.cat([grads[0][0][:, :20], grads[1][0][:, 20:]], dim=-1)
    assert torch.allclose(merged, logits.grad, atol=1e-5), (merged - logits.grad).abs().max()
    assert logits.grad.abs().max() > 1e-3


def _bonus_worker():
    from types import SimpleNamespace

    from rollplex_megatron.dist import init_parallel

    init_parallel()
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 5, 30, generator=g)
    labels = torch.randint(0, 30, (1, 5), generator=g)
    mask = torch.ones(1, 5, dtype=torch.bool)
    mb = SimpleNamespace(label_mask=mask, label_at=mask, labels=labels,
                         token_data={"adv": torch.randn(1, 5, generator=g)})
    base, _, st = grpo.GRPOLoss(0.0, 0.2, 0.2, 5)(mb, logits.clone())
    bonus, _, st2 = grpo.GRPOLoss(0.0, 0.2, 0.2, 5, entropy_coef=0.1)(mb, logits.clone())
    return base, bonus, st["entropy"], st2["entropy"]


def test_entropy_bonus_enters_the_loss_only_when_set():
    from rollplex_megatron.dist import run_local

    base, bonus, h, h2 = run_local(_bonus_worker, 1)[0]
    assert torch.allclose(bonus, base - 0.1 * h, atol=1e-6) and torch.allclose(h, h2) and h > 1.0


def test_kl_estimators_by_formula_and_clamp():
    g = torch.Generator().manual_seed(3)
    logp = -torch.rand(1000, generator=g) * 8
    ref = logp + torch.randn(1000, generator=g) * 0.3
    d = logp - ref
    assert torch.allclose(grpo.kl_estimate(logp, ref, "k1"), d)
    assert torch.allclose(grpo.kl_estimate(logp, ref, "k2"), 0.5 * d**2)
    assert torch.allclose(grpo.kl_estimate(logp, ref, "k3"), torch.exp(-d) + d - 1)
    assert torch.allclose(grpo.kl_estimate(logp, ref, "low_var_kl"), torch.exp(-d) + d - 1)  # no clamp needed here
    # a token the policy made far less likely than the reference: k3 explodes, low_var_kl is clamped at 10
    far = grpo.kl_estimate(torch.tensor([-40.0]), torch.tensor([-1.0]), "k3")
    assert float(far) > 1e16 and float(grpo.kl_estimate(torch.tensor([-40.0]), torch.tensor([-1.0]),
                                                        "low_var_kl")) == 10.0
    with pytest.raises(ValueError, match="train.kl_estimator must be one of"):
        grpo.kl_estimate(logp, ref, "k4")


def test_policy_logits_temperature_and_banned_tokens_per_tp_shard():
    g = torch.Generator().manual_seed(4)
    full = torch.randn(2, 3, 16, generator=g)
    ref = (full / 0.7).index_fill(-1, torch.tensor([5, 12]), torch.finfo(torch.float32).min)
    shards = [grpo.policy_logits(part, 0.7, (5, 12), rank) for rank, part in enumerate(full.chunk(2, dim=-1))]
    assert torch.equal(torch.cat(shards, dim=-1), ref)
    masked = torch.full_like(full, torch.finfo(torch.float32).min)  # padded columns divided by T stay finite
    assert torch.isfinite(grpo.policy_logits(masked, 0.5)).all()


def test_loss_weights_by_hand():
    lens, s, t, lmax = [2, 4, 6], 3, 12, 8
    assert grpo.loss_weights(lens, "token-mean", s, t, lmax) == [1 / 12] * 3
    assert grpo.loss_weights(lens, "seq-mean-token-sum", s, t, lmax) == [1 / 3] * 3
    assert grpo.loss_weights(lens, "seq-mean-token-mean", s, t, lmax) == [1 / 6, 1 / 12, 1 / 18]
    assert grpo.loss_weights(lens, "seq-mean-token-sum-norm", s, t, lmax) == [1 / 24] * 3
    # seq-mean-token-mean: every response's token mean counts once, whatever its length
    per_token = [torch.full((n,), float(i + 1)) for i, n in enumerate(lens)]
    w = grpo.loss_weights(lens, "seq-mean-token-mean", s, t, lmax)
    assert abs(sum(float((x * wi).sum()) for x, wi in zip(per_token, w)) - (1 + 2 + 3) / 3) < 1e-6  # fp32 sums


def test_dual_clip_caps_negative_advantage_losses():
    logp, old = torch.tensor([2.0, 2.0, 2.0]), torch.zeros(3)  # ratio e^2 = 7.39
    adv = torch.tensor([-1.0, 1.0, -0.5])
    plain = grpo.clipped_ratio_loss(logp, old, adv)
    dual = grpo.clipped_ratio_loss(logp, old, adv, clip_ratio_c=3.0)
    assert torch.allclose(plain, torch.tensor([7.389056, -1.2, 3.694528]), atol=1e-5)
    assert torch.allclose(dual, torch.tensor([3.0, -1.2, 1.5]))  # capped at 3|A| where A < 0
    assert torch.equal(grpo.clipped_ratio_loss(torch.zeros(3), old, adv, clip_ratio_c=3.0),
                       grpo.clipped_ratio_loss(torch.zeros(3), old, adv))  # ratio 1: nothing to cap


def _gather_worker():
    """GRPOLoss and the scoring loss on both micro-batch kinds (random groups, tiny preset's vocabulary), once
    selecting the loss positions by `label_index` and once by the mask alone: losses, statistics, logit
    gradients, and the aten ops each dispatches that read a count or a value back to the host (indexing by a
    bool mask, nonzero, item)."""
    import copy

    from torch.utils._python_dispatch import TorchDispatchMode

    from rollplex_megatron.dist import init_parallel
    from rollplex_megatron.prefix.batch import Group, Prompt, full_micro_batches, response_micro_batches
    from rollplex_megatron.prefix.execution import logprob_loss
    from rollplex_megatron.recipes import load_run_config

    class Syncs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            # a gather or scatter by a bool mask counts its positions; a scalar written under a mask (megatron's
            # cross-entropy does) is a masked_fill in torch, no count
            by_mask = name in ("index", "index_put", "index_put_", "_index_put_impl_") and any(
                torch.is_tensor(i) and i.dtype == torch.bool for i in args[1]) and (name == "index" or args[2].dim())
            self.n += by_mask or name in ("nonzero", "masked_select", "item", "_local_scalar_dense")
            return func(*args, **(kwargs or {}))

    init_parallel()
    cfg = load_run_config(["model=tiny"]).model
    g = torch.Generator().manual_seed(int(torch.randint(0, 10**6, (1,))))
    groups = [Group(Prompt(torch.randint(1, 300, (int(torch.randint(2, 30, (1,), generator=g)),), generator=g)),
                    [torch.randint(1, 300, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g)
                     for _ in range(3)], torch.randn(3, generator=g)) for _ in range(4)]
    n_tok = sum(r.numel() for gr in groups for r in gr.responses)
    out = {}
    for kind, build in (("response", response_micro_batches), ("full", full_micro_batches)):
        for mb in build(cfg, groups, 5, n_tok):
            mb = mb.to("cpu")  # the copy a phase trains on keeps the host's positions
            t = mb.labels.shape[1]
            mb.token_data = {k: torch.randn(1, t, generator=g) * s for k, s in (("adv", 1.0), ("old_logp", 0.1),
                                                                                 ("ref_logp", 0.1))}
            mb.token_data["old_logp"] -= 3
            mb.token_data["ref_logp"] -= 3
            logits = torch.randn(1, t, 300, generator=g)
            bare = copy.copy(mb)
            bare.label_index = None
            for name, m in (("index", mb), ("mask", bare)):
                res = []
                for fn in (grpo.GRPOLoss(0.1, 0.2, 0.28, n_tok, entropy_coef=0.05), logprob_loss):
                    x = logits.clone().requires_grad_(True)
                    with Syncs() as syncs:
                        loss, n, stats = fn(m, x)
                        loss.backward()
                    res.append({"loss": loss.detach(), "n": n, "grad": x.grad,
                                "stats": {k: v for k, v in stats.items()}, "syncs": syncs.n})
                out.setdefault((kind, name), []).append(res)
            out.setdefault((kind, "positions"), []).append(
                (mb.label_index, mb.label_mask.reshape(-1).nonzero().squeeze(1)))
    return out


def test_losses_gather_the_loss_positions_without_a_device_count():
    """The losses select their positions by the host-made `label_index` (a gather), not by the mask (which on
    CUDA waits for the device to count them): the same losses, statistics and logit gradients bit for bit as
    selecting by the mask, on both micro-batch kinds, and no op that reads a count back. The mask path does
    dispatch such ops, so the count would catch a mask selection creeping back."""
    from rollplex_megatron.dist import run_local

    out = run_local(_gather_worker, 1)[0]
    for kind in ("response", "full"):
        for got, want in out[(kind, "positions")]:
            assert got is not None and torch.equal(got, want)
        assert len(out[(kind, "index")]) >= 2
        for idx, msk in zip(out[(kind, "index")], out[(kind, "mask")]):
            for a, b in zip(idx, msk):  # GRPOLoss, logprob_loss
                assert torch.equal(a["loss"], b["loss"]) and torch.equal(a["n"], b["n"])
                assert torch.equal(a["grad"], b["grad"]) and a["grad"].abs().max() > 0
                assert a["stats"].keys() == b["stats"].keys()
                for k in a["stats"]:
                    assert torch.equal(a["stats"][k], b["stats"][k]), (kind, k)
                assert a["syncs"] == 0 and b["syncs"] > 0, (kind, a["syncs"], b["syncs"])


def test_reward_extra_metrics_are_means_over_every_rank_that_reports_them():
    """Two DP ranks with different key sets (rank 1 has a key rank 0 lacks, and a response without any): each key
    is the mean over the responses that report it, on both ranks."""
    from rollplex_megatron.dist import run_local
    from tests import trainer_workers as W

    per_rank = [[[{"a": 1.0}, {"a": 3.0}]], [[{"b": 2.0}, {}], [{"a": 5.0, "b": 4.0}]]]
    got = run_local(W.reward_extra_means, 2, per_rank)
    assert got[0] == got[1] == {"a": 3.0, "b": 3.0}
    assert run_local(W.reward_extra_means, 2, [[[{}]], [[{}]]]) == [{}, {}]


def test_dr_grpo_normalises_by_the_generation_cap_of_the_run(tiny_hf):
    """seq-mean-token-sum-norm's constant is the longest response the run generates: the rendered task's
    task.max_answer_tokens (6 in the trainer tests), not rollout.max_response_len (256 by default), which it never
    reaches (the loss would be 40x smaller than Dr. GRPO's)."""
    from rollplex_megatron.dist import run_local
    from tests import trainer_workers as W
    from tests.test_trainer import _cfg

    cfg = _cfg("rollplex", "train.loss_agg_mode=seq-mean-token-sum-norm", hf=tiny_hf)
    got = run_local(W.dr_grpo_weights, 1, cfg)[0]
    assert got["cap"] == cfg.task.max_answer_tokens == 6 != cfg.rollout.max_response_len
    assert got["weights"] == [pytest.approx(1 / (got["responses"] * 6))]
