"""The shared-prefix attention abstraction against plain float64 math, and its masks by hand."""
import pytest
import torch

from rollplex_megatron.attention.prefix import PackedLayout, dense_reference, shared_prefix_attention


def _layout(g):
    """Two groups (prefixes of 5 and 3), three responses of lengths 4, 2, 3 (groups 0, 0, 1)."""
    lens, groups = [4, 2, 3], [0, 0, 1]
    seg = torch.cat([torch.full((n,), s) for s, n in enumerate(lens)])
    pos = torch.cat([torch.arange(n) for n in lens])
    grp = torch.cat([torch.full((n,), gg) for gg, n in zip(groups, lens)])
    return PackedLayout(seg, pos, grp, [0, 1], [5, 3])


def test_mask_by_hand():
    a = _layout(None).allowed()
    assert a.shape == (9, 8 + 9)
    # token 4 = response 1 (group 0) position 0: all of prefix 0, none of prefix 1, itself only
    assert a[4, :5].all() and not a[4, 5:8].any()
    assert a[4, 8:].tolist() == [False] * 4 + [True, False] + [False] * 3
    # token 8 = response 2 (group 1) position 2: prefix 1 and its own three tokens
    assert not a[8, :5].any() and a[8, 5:8].all() and a[8, 8 + 6:].all() and not a[8, 8:8 + 6].any()


@pytest.mark.parametrize("nq,ng,scale", [(4, 2, None), (4, 4, 0.3), (6, 1, None)])
def test_sdpa_path_matches_float64_math(nq, ng, scale):
    torch.manual_seed(nq * 10 + ng)
    lay = _layout(None)
    t, kp, d = 9, 8, 16
    q = torch.randn(t, 1, nq, d) * 3
    k = torch.randn(kp + t, 1, ng, d) * 0.5
    v = torch.randn(kp + t, 1, ng, d) * 100
    allowed = lay.allowed()
    out = shared_prefix_attention(q, k, v, allowed, scale, "sdpa")
    ref = dense_reference(q, k, v, allowed, scale)
    assert ((out - ref).norm() / ref.norm()) < 1e-6


def test_flex_path_matches_sdpa_forward():
    """FlexAttention (eager on CPU; compiled on GPU) computes the same function as the SDPA path."""
    torch.manual_seed(3)
    lay = _layout(None)
    q, k, v = torch.randn(9, 1, 4, 16), torch.randn(17, 1, 2, 16), torch.randn(17, 1, 2, 16)
    a = shared_prefix_attention(q, k, v, lay.allowed(), None, "sdpa")
    b = shared_prefix_attention(q, k, v, lay.allowed(), None, "flex")
    assert ((a - b).norm() / a.norm()) < 1e-5


def test_unknown_backend_is_rejected():
    lay = _layout(None)
    q, k = torch.randn(9, 1, 2, 8), torch.randn(17, 1, 2, 8)
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        shared_prefix_attention(q, k, k, lay.allowed(), None, "fast")


@pytest.mark.parametrize("seed", [0, 1])
def test_segment_attention_matches_block_diagonal_mask(seed):
    """Vision attention by equal-length segment batches equals the dense block-diagonal mask."""
    from rollplex_megatron.attention.prefix import SegmentContext
    from rollplex_megatron.models.qwen25vl.positions import block_diagonal_mask

    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, 16, 32, 40, 56, 60, 76])  # lengths 16, 16, 8, 16, 4, 16
    n = int(cu[-1])
    q, k, v = (torch.randn(n, 1, 2, 8, generator=g) * s for s in (2.0, 0.5, 30.0))
    out = SegmentContext(cu=cu).attend(1, q, k, v, None)
    allowed = ~block_diagonal_mask(cu)[0, 0]
    ref = dense_reference(q, k, v, allowed, None)
    assert ((out - ref).norm() / ref.norm()) < 1e-6
    wrong = SegmentContext(cu=torch.tensor([0, 16, 33, 40, 56, 60, 76])).attend(1, q, k, v, None)
    assert ((wrong - ref).norm() / ref.norm()) > 1e-3  # a shifted boundary is detected
