"""The fused log-prob / entropy kernel (`rl/triton_logprob.py`) against the torch path it replaces.

On CPU it runs under Triton's interpreter (tests/__init__.py sets TRITON_INTERPRET=1 without CUDA), in fp32;
on the GPU machine the same tests run the compiled kernels. Fresh random logits each case: several rows'
worth of vocabulary iterations, the padded columns at the dtype minimum, banned columns, temperatures, logit
magnitudes; values and the gradient of a random mix of log-probs and entropies equal the torch path's.
Mutations (each must fail): the banned columns taken into the distribution, the temperature left out of the
gradient, the entropy's gradient dropped; at TP 2 the shards' statistics not combined.
"""
import pytest
import torch

from rollplex_megatron.dist import run_local
from rollplex_megatron.recipes import load_run_config
from rollplex_megatron.rl import triton_logprob as TL
from rollplex_megatron.rl.grpo import policy_logprob_entropy
from tests import trainer_workers as W
from tests.in_turn import case, in_turn
from tests.numerics import rel_err
from tests.test_trainer import _param_err, _records_close

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
TOL = 1e-5  # docs/design.md §3, fp32


def _case(seed, vocab, lo=0, full=None):
    g = torch.Generator().manual_seed(seed)
    b, t = 2, int(torch.randint(3, 9, (1,), generator=g))
    mag = 10.0 ** float(torch.randint(-1, 2, (1,), generator=g))
    full = full or vocab
    logits = torch.randn(b, t, full, generator=g) * mag
    logits[..., full - 7:] = torch.finfo(torch.float32).min  # the vocabulary padding
    labels = torch.randint(0, full - 7, (b, t), generator=g)
    banned = tuple(int(x) for x in torch.randperm(full - 7, generator=g)[:4])
    logits[..., banned[0]] = logits[..., :full - 7].max(-1).values + 1.0  # a placeholder the model favours
    labels = torch.where(torch.isin(labels, torch.tensor(banned)), (labels + 1) % (full - 7), labels)
    labels = torch.where(torch.isin(labels, torch.tensor(banned)), (labels + 1) % (full - 7), labels)
    mask = torch.rand(b, t, generator=g) < 0.7
    mask[0, 0] = True
    temperature = [1.0, 0.7, 1.3][seed % 3]
    w_lp, w_h = torch.randn(b, t, generator=g), torch.randn(int(mask.sum()), generator=g)
    return logits, labels, banned, mask, temperature, w_lp, w_h


def _run(kernel, logits, labels, banned, mask, temperature, w_lp, w_h, tp_rank=0, group=None):
    x = logits.detach().to(DEV).requires_grad_()
    logp, ent = policy_logprob_entropy(x, labels.to(DEV), temperature, banned, tp_rank, group, mask.to(DEV), True,
                                       kernel)
    ((logp * w_lp.to(DEV)).sum() + (ent * w_h.to(DEV)).sum()).backward()
    return logp.detach().cpu(), ent.detach().cpu(), x.grad.cpu()


def _ref64(logits, labels, banned, mask, temperature, w_lp, w_h):
    """The same values and gradient in float64 (the precise reference both fp32 paths are measured by)."""
    x = logits.double().requires_grad_()
    keep = torch.ones(x.shape[-1], dtype=torch.bool)
    keep[list(banned)] = False
    y = torch.where(keep & (logits > -1e30), x / temperature, torch.tensor(-1e300, dtype=torch.float64))
    lp = torch.log_softmax(y, -1)
    logp = lp.gather(-1, labels[..., None]).squeeze(-1)
    ent = -(lp.exp() * lp).sum(-1)[mask]
    ((logp * w_lp.double()).sum() + (ent * w_h.double()).sum()).backward()
    return logp.detach(), ent.detach(), x.grad


def _errors(got, want, ref) -> dict:
    """Per output: the fused path's error against float64 and against the torch path, and the torch path's."""
    names = ("logp", "entropy", "grad")
    return {"fused": {k: rel_err(a, r) for k, a, r in zip(names, got, ref)},
            "vs_torch": {k: rel_err(a, b) for k, a, b in zip(names, got, want)},
            "torch": {k: rel_err(b, r) for k, b, r in zip(names, want, ref)}}


def _check(e: dict) -> None:
    """Within docs/design.md §3's fp32 bound of the precise values, and as close to the torch path as that path's own
    rounding allows (a peaked distribution of large logits costs the torch path ~1e-5 on its gradient)."""
    for k, err in e["fused"].items():
        assert err <= TOL, (k, e)
        assert e["vs_torch"][k] <= TOL + e["torch"][k], (k, e)


class _Patched:
    """A kernel launcher whose arguments `change` rewrites (a mutation)."""

    def __init__(self, kernel, change):
        self.kernel, self.change = kernel, change

    def __getitem__(self, grid):
        return lambda *a, **k: self.kernel[grid](*self.change(list(a)), **k)


# each replaces one name of the kernel module for one case; the _grad_kernel launch's arguments are
# (logits, stride, grad, stride, labels, banned, n_banned, t, vocab, lo, m, z, mean, g_logp, g_ent)
MUTATIONS = {
    "banned_kept": ("_banned_local", lambda orig: lambda *a: torch.tensor([-1], dtype=torch.int32, device=a[-1])),
    "untempered_grad": ("_grad_kernel", lambda orig: _Patched(orig, lambda a: a[:7] + [1.0] + a[8:])),
    "no_entropy_grad": ("_grad_kernel", lambda orig: _Patched(orig, lambda a: a[:14] + [torch.zeros_like(a[14])])),
}
CASES = [(0, 1500), (1, 700), (2, 2100)]


def _tp1(seed: int, vocab: int, mutation: str = "") -> dict:
    """One case at TP 1: the fused kernel (under `mutation`, at temperature 0.7) and the torch path."""
    from rollplex_megatron.dist import init_parallel

    init_parallel(tp=1)
    c = _case(seed, vocab)
    if mutation:
        c = c[:4] + (0.7,) + c[5:]  # a temperature other than 1: the untempered gradient differs
    want = _run("torch", *c)
    name, make = MUTATIONS.get(mutation, (None, None))
    orig = getattr(TL, name) if name else None
    if name:
        setattr(TL, name, make(orig))
    try:
        got = _run("triton", *c)
    finally:
        if name:
            setattr(TL, name, orig)
    return {**_errors(got, want, _ref64(*c)),
            "finite": bool(torch.isfinite(got[2]).all()), "pad_grad": float(got[2][..., vocab - 7:].abs().max()),
            "banned_grad": float(got[2][..., list(c[2])].abs().max())}


@pytest.fixture(scope="module")
def tp1_runs():
    """Every TP-1 case and mutation in one job (`tests.in_turn`)."""
    calls = {f"{seed}-{vocab}": (_tp1, (seed, vocab)) for seed, vocab in CASES}
    calls.update({m: (_tp1, (1, 700, m)) for m in MUTATIONS})
    return run_local(in_turn, 1, calls)[0]


@pytest.mark.parametrize("seed,vocab", CASES)
def test_fused_logprob_entropy_matches_the_torch_path(tp1_runs, seed, vocab):
    r = case(tp1_runs, f"{seed}-{vocab}")
    _check(r)
    assert r["finite"] and r["pad_grad"] == 0.0 and r["banned_grad"] == 0.0  # padding and banned: no gradient


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_fused_logprob_mutations_are_caught(tp1_runs, mutation):
    r = case(tp1_runs, mutation)
    assert max(r["fused"].values()) > 100 * TOL, (mutation, r["fused"])


def _tp2(seed: int, combine: bool) -> dict:
    """TP 2: each rank's shard through the fused kernel and through the torch path (megatron's
    vocab-parallel cross-entropy and entropy over the same TP group)."""
    from megatron.core import parallel_state as ps

    from rollplex_megatron.dist import init_parallel

    init_parallel(tp=2)
    rank, group = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
    logits, labels, banned, mask, t, w_lp, w_h = _case(seed, 640, full=1280)
    shard = logits.chunk(2, dim=-1)[rank].contiguous()
    args = (shard, labels, banned, mask, t, w_lp, w_h, rank)
    want = _run("torch", *args, group=group)
    got = _run("triton", *args, group=group if combine else None)
    lp, ent, grad = _ref64(logits, labels, banned, mask, t, w_lp, w_h)
    return _errors(got, want, (lp, ent, grad.chunk(2, dim=-1)[rank]))


@pytest.mark.skipif(GPU and torch.cuda.device_count() < 2, reason="TP 2 on the GPU machine needs two GPUs (on CPU "
                    "it runs over gloo)")
def test_fused_logprob_at_tp2_matches_the_vocab_parallel_torch_path():
    res = run_local(in_turn, 2, {"exact": (_tp2, (3, True)), "uncombined": (_tp2, (3, False))}, False)
    for r in res:
        _check(case(r, "exact"))
        assert max(case(r, "uncombined")["fused"].values()) > 100 * TOL  # mutation: each shard its own softmax


def test_trainer_steps_with_the_fused_kernel_give_the_torch_update():
    """Two rollplex steps (reference and old log-probs, the GRPO loss with an entropy bonus, at a sampling
    temperature other than 1) with train.logprob_kernel=triton against torch: tokens, records and every
    parameter after the optimizer steps."""
    base = ["model=tiny", "optim.adam_eps=1e-6", "optim.lr=3e-4", "workload.rollout_batch=8", "rollout.group_size=4",
            "task.max_answer_tokens=6", "train.kl_coef=0.1", "train.entropy_coef=0.01", "rollout.temperature=0.8",
            "task.format_reward=0.5", "mode.name=rollplex"]
    runs = run_local(in_turn, 1, {k: (W.run_steps, (load_run_config(base + [f"train.logprob_kernel={k}"]), 2))
                                  for k in ("torch", "triton")})[0]
    fused, plain = case(runs, "triton"), case(runs, "torch")
    assert (fused["logprob_kernel"], plain["logprob_kernel"]) == ("triton", "torch")  # the runs took each path
    assert fused["tokens"] == plain["tokens"]
    _records_close(fused["records"], plain["records"], keys=("kl", "entropy", "grad_norm"))
    err, name = _param_err(fused, plain)
    assert err <= TOL, (name, err)
