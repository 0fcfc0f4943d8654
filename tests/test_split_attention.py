"""The split training attention (`attention/split.py`: a group's prefix and a response's own tokens as two
attention calls merged by their log-sum-exp) against the masked float64 reference: outputs and every gradient
(queries, own keys and values, prefix keys and values), fp32 on CPU, fresh random layouts."""
import pytest
import torch

from rollplex_megatron.attention import split
from rollplex_megatron.attention.prefix import PackedLayout, dense_reference
from tests.numerics import rel_err

TOL = 1e-5  # docs/design.md §3: fp32 on CPU


def _layout(gen, n_groups: int, shuffled: bool, prefix: bool = True):
    """Ragged responses of `n_groups` groups (1-3 each, 1-9 tokens); `shuffled`: segments not in group order
    (a PPO mini-batch's groups in any order)."""
    segs = [(gi, int(torch.randint(1, 10, (1,), generator=gen))) for gi in range(n_groups)
            for _ in range(int(torch.randint(1, 4, (1,), generator=gen)))]
    if shuffled:
        segs = [segs[i] for i in torch.randperm(len(segs), generator=gen).tolist()]
    lens, groups = [n for _, n in segs], [g if prefix else -1 for g, _ in segs]
    seg = torch.cat([torch.full((n,), s) for s, n in enumerate(lens)])
    pos = torch.cat([torch.arange(n) for n in lens])
    grp = torch.cat([torch.full((n,), g) for g, n in zip(groups, lens)])
    present = sorted({g for g in groups if g >= 0})
    plens = [int(torch.randint(1, 12, (1,), generator=gen)) for _ in present]
    return PackedLayout(seg, pos, grp, present, plens, lens, groups)


def _inputs(gen, lay, nq, ng, d):
    t, kp = lay.seg_T.numel(), sum(lay.prefix_lens)
    mag = 10.0 ** float(torch.randint(-1, 2, (1,), generator=gen))  # large logits too: the merge must stay exact
    mk = lambda *s, m=1.0: (torch.randn(*s, generator=gen) * m).requires_grad_()  # noqa: E731
    return mk(t, 1, nq, d, m=mag), mk(t, 1, ng, d), mk(t, 1, ng, d, m=3.0), mk(kp, 1, ng, d), mk(kp, 1, ng, d)


def _compare(lay, q, k, v, pk, pv, scale, idx=None):
    """Split output and gradients vs the masked float64 reference on the concatenated keys."""
    if idx is None:
        idx = split.split_index(lay.seg_lens, lay.seg_groups, lay.prefix_groups, lay.prefix_lens, "cpu")
    w = torch.randn(q.shape[0], 1, q.shape[2] * q.shape[3], generator=torch.Generator().manual_seed(5))
    has_prefix = bool(lay.prefix_groups)
    out = split.split_attention(q, k, v, pk if has_prefix else None, pv if has_prefix else None, idx, scale)
    leaves = (q, k, v, pk, pv) if has_prefix else (q, k, v)
    grads = torch.autograd.grad((out * w).sum(), leaves)
    kk, vv = (torch.cat([pk, k]), torch.cat([pv, v])) if has_prefix else (k, v)
    ref = dense_reference(q, kk, vv, lay.allowed(), scale)
    ref_grads = torch.autograd.grad((ref.double() * w.double()).sum(), leaves)
    errs = {"out": rel_err(out, ref)} | {n: rel_err(g, r)
                                         for n, g, r in zip(("q", "k", "v", "pk", "pv"), grads, ref_grads)}
    return errs


@pytest.mark.parametrize("seed,nq,ng,scale,shuffled", [(0, 4, 2, None, False), (1, 4, 2, 0.3, True),
                                                       (2, 6, 1, None, True), (3, 4, 4, None, True)])
def test_split_equals_masked_attention_with_gradients(seed, nq, ng, scale, shuffled):
    gen = torch.Generator().manual_seed(seed)
    lay = _layout(gen, 3, shuffled)
    errs = _compare(lay, *_inputs(gen, lay, nq, ng, 16), scale)
    assert max(errs.values()) < TOL, errs


@pytest.mark.parametrize("seed", [4, 5])
def test_split_without_prefix_equals_block_causal_attention(seed):
    """Full sequences (the serial baseline): each segment causal over itself, no prefix part."""
    gen = torch.Generator().manual_seed(seed)
    lay = _layout(gen, 3, True, prefix=False)
    errs = _compare(lay, *_inputs(gen, lay, 4, 2, 16), None)
    assert max(errs.values()) < TOL, errs


def test_segments_read_back_from_the_tensors_equal_the_host_lists():
    gen = torch.Generator().manual_seed(6)
    lay = _layout(gen, 4, True)
    bare = PackedLayout(lay.seg_T, lay.pos_T, lay.group_T, lay.prefix_groups, lay.prefix_lens)
    assert bare.segments() == (lay.seg_lens, lay.seg_groups)


@pytest.mark.parametrize("mutant", ["unordered", "prefix_dq_dropped", "own_lse_in_backward"])
def test_split_mutations_are_detected(mutant, monkeypatch):
    """The segments taken in token order when they are not grouped; the prefix part's query gradient left out;
    the prefix part's backward run with its own log-sum-exp instead of the merged one."""
    gen = torch.Generator().manual_seed(7)
    lay = _layout(gen, 3, True)
    idx = split.split_index(lay.seg_lens, lay.seg_groups, lay.prefix_groups, lay.prefix_lens, "cpu")
    assert idx.order is not None  # the shuffled layout needs the permutation
    if mutant == "unordered":
        idx.order = None
    elif mutant == "prefix_dq_dropped":
        monkeypatch.setattr(split, "_add_prefix_dq", lambda dq, dq1, perm: dq)
    else:
        backward = split._math_backward

        def own_lse(do, q, k, v, out, lse, cu_q, cu_k, causal, scale):
            if not causal:  # the prefix part: recompute its own output and log-sum-exp, as if unmerged
                out, lse = split._math_forward(q, k, v, cu_q, cu_k, causal, scale)
            return backward(do, q, k, v, out, lse, cu_q, cu_k, causal, scale)
        monkeypatch.setattr(split, "_math_backward", own_lse)
    errs = _compare(lay, *_inputs(gen, lay, 4, 2, 16), None, idx)
    assert max(errs.values()) > 100 * TOL, errs


def test_segments_of_a_group_without_prefix_are_refused():
    with pytest.raises(ValueError, match="have no prefix"):
        split.split_index([3, 2], [0, 1], [0], [4], "cpu")
