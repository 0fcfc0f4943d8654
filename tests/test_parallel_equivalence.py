"""TP=2 / PP=2 / TP2xPP2 forward+backward through megatron's schedule equal TP=1, PP=1.

Same checkpoint, same batches; loss within 1e-5 relative and every parameter's gradient (mapped
back to HF names) within 1e-5 relative (||diff|| / ||reference||), fp32 on CPU.
"""
import copy

import pytest

from rollplex_megatron.dist import run_local
from tests.numerics import rel_err
from tests.parallel_workers import fwd_bwd, hf_named_grads

TOL = 1e-5
_RUNS: dict = {}  # (tp, pp) -> the ranks' results: the mutation test reuses the TP=2 run (same inputs)


def _layout_run(tiny_hf, tp, pp):
    if (tp, pp) not in _RUNS:
        _RUNS[tp, pp] = run_local(fwd_bwd, tp * pp, tiny_hf, tp, pp)
    return _RUNS[tp, pp]


@pytest.fixture(scope="module")
def reference(tiny_hf):
    res = run_local(fwd_bwd, 1, tiny_hf, 1, 1)
    return res[0]["loss"], hf_named_grads(res, tiny_hf, 1, 1)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_parallel_layouts_match_single_process(tiny_hf, reference, tp, pp):
    ref_loss, ref_grads = reference
    res = _layout_run(tiny_hf, tp, pp)
    assert not any(r["no_grad"] for r in res), [r["no_grad"] for r in res]
    losses = [r["loss"] for r in res if r["loss"] is not None]
    assert losses and abs(losses[0] - ref_loss) / abs(ref_loss) <= TOL
    grads = hf_named_grads(res, tiny_hf, tp, pp)
    assert set(grads) == set(ref_grads)
    errs = {k: rel_err(grads[k], ref_grads[k]) for k in ref_grads}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= TOL, (worst, errs[worst])
    assert all(ref_grads[k].norm() > 0 for k in ref_grads), "a reference gradient is zero"


def test_gradient_comparison_detects_a_dropped_shard(tiny_hf, reference):
    """Mutation: zero one TP rank's shard of one gradient; the comparison must fail (on a copy of the
    TP=2 layout test's run: the same inputs)."""
    _, ref_grads = reference
    res = copy.deepcopy(_layout_run(tiny_hf, 2, 1))
    name = "language_model.decoder.layers.1.self_attention.linear_qkv.weight"
    res[1]["grads"][name].zero_()
    grads = hf_named_grads(res, tiny_hf, 2, 1)
    k = "model.layers.1.self_attn.k_proj.weight"
    assert rel_err(grads[k], ref_grads[k]) > 0.1
