"""`small_m_linear` (models/triton_linear.py), the decode GEMM for few rows, against `F.linear` (+ bias), and
`small_m_gated` (linear_fc1 and the gated activation in one kernel) against `silu_mul` of either GEMM.

On CPU under Triton's interpreter in fp32 (norm-relative 1e-5); on the GPU machine the compiled kernel in bf16
(the design's 1e-2), with fresh random inputs of ragged sizes: rows 1..130 (one and several row blocks), K not a
multiple of the K step, N not a multiple of the column block, one kernel and split K (2..5 splits, some with a short
last one), with and without a bias. The split sum is in a fixed order, so two calls are bit-equal. The bias is added
after the GEMM's rounding, as megatron's linear adds it (bf16, an exactly summable GEMM: bit-equal to matmul then
the add). Mutation: the last K split left out, caught; and the check tells a doubled bias from the right one.
`small_m_gated` equals `silu_mul(small_m_linear(...))` bit
for bit (the same sums, the same roundings; fp32 and bf16) and `silu_mul(F.linear(...))` within the tolerance;
mutation: gate and up swapped.
"""
import pytest
import torch

from rollplex_megatron.models import triton_linear as TL
from rollplex_megatron.models.triton_layer import silu_mul

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
DT = torch.bfloat16 if GPU else torch.float32
TOL = 1e-2 if GPU else 1e-5  # docs/design.md §3


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _ref(x, w, b):
    y = torch.nn.functional.linear(x, w)
    return y if b is None else (y.float() + b.float()).to(y.dtype)


CASES = [  # rows, K, N, bias, split_k, block_n, block_k
    (1, 128, 16, False, 1, 16, 128),
    (3, 100, 70, True, 1, 32, 32),
    (8, 256, 48, False, 3, 16, 64),
    (20, 64, 33, True, 2, 32, 16),
    (40, 96, 20, True, 5, 16, 16),
    (130, 300, 40, True, 3, 16, 32),  # three row blocks, a short last split
]


def _case(seed, rows, k, n, bias):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(DEV, DT)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(DEV, DT)
    b = torch.randn(n, generator=g).to(DEV, DT) if bias else None
    return x, w, b


def _worst(cases, seed0=0):
    worst = 0.0
    for i, (rows, k, n, bias, split, bn, bk) in enumerate(cases):
        x, w, b = _case(seed0 + i, rows, k, n, bias)
        y = TL.small_m_linear(x, w, b, block_n=bn, block_k=bk, split_k=split)
        assert y.shape == (rows, n) and y.dtype == DT
        worst = max(worst, _rel(y, _ref(x, w, b)))
    return worst


def test_small_m_linear_equals_linear():
    seed = int(torch.randint(0, 1 << 30, ()).item())  # fresh inputs each run, reported on failure
    worst = _worst(CASES, seed)
    assert worst < TOL, f"seed {seed}: worst norm-relative difference {worst:.2e} >= {TOL}"


def test_small_m_linear_leading_dims_and_determinism():
    x, w, b = _case(7, 6, 200, 40, True)
    x3 = x.reshape(1, 6, 200)
    y1 = TL.small_m_linear(x3, w, b, block_n=16, block_k=32, split_k=3)
    y2 = TL.small_m_linear(x3, w, b, block_n=16, block_k=32, split_k=3)
    assert y1.shape == (1, 6, 40)
    assert torch.equal(y1, y2), "the split sum must be in a fixed order (bit-equal calls)"
    assert _rel(y1.reshape(6, 40), _ref(x, w, b)) < TOL


def test_mutation_short_split_fails(monkeypatch):
    real = TL._split_layout
    monkeypatch.setattr(TL, "_split_layout", lambda k, s, bk: (real(k, s, bk)[0], real(k, s, bk)[1] - 1))
    split_cases = [c for c in CASES if c[4] > 1]
    assert _worst(split_cases) > 10 * TOL


def test_the_check_tells_a_doubled_bias():
    rows, k, n, _, split, bn, bk = CASES[1]
    x, w, b = _case(3, rows, k, n, True)
    y = TL.small_m_linear(x, w, b, block_n=bn, block_k=bk, split_k=split)
    assert _rel(y, _ref(x, w, 2 * b)) > 10 * TOL  # the check tells a doubled bias from the right one


@pytest.mark.parametrize("split", [1, 3])
def test_the_bias_is_added_after_the_gemms_rounding(split):
    """bf16 with small integer inputs (every product and sum exact in fp32): the GEMM's result is exact, so the only
    rounding is where the bias goes: megatron's order (the GEMM rounded to bf16, then the bias added and rounded)
    bit for bit, and not the fused order (the bias added to the fp32 sum, one rounding) on this case, which the two
    tell apart."""
    g = torch.Generator().manual_seed(11)
    x = torch.randint(-8, 9, (5, 96), generator=g).to(DEV, torch.bfloat16)
    w = torch.randint(-8, 9, (48, 96), generator=g).to(DEV, torch.bfloat16)
    b = (torch.randn(48, generator=g) * 300).to(DEV, torch.bfloat16)
    y = TL.small_m_linear(x, w, b, block_n=16, block_k=32, split_k=split)
    exact = x.float() @ w.float().T  # integers below 2^24: exact
    megatron = (exact.to(torch.bfloat16).float() + b.float()).to(torch.bfloat16)
    fused = (exact + b.float()).to(torch.bfloat16)
    assert not torch.equal(megatron, fused)  # the case separates the two orders
    assert torch.equal(y, megatron)


def test_bad_bias_is_refused():
    x, w, _ = _case(0, 2, 64, 32, False)
    for bias in (torch.zeros(31, device=DEV, dtype=DT), torch.zeros(32, device=DEV, dtype=torch.float64)):
        with pytest.raises(ValueError, match="small_m_linear: bias"):
            TL.small_m_linear(x, w, bias)
    strided = torch.randn(64, device=DEV, dtype=DT)[::2]  # made contiguous, not read with the wrong stride
    assert _rel(TL.small_m_linear(x, w, strided), _ref(x, w, strided)) < TOL


@pytest.mark.parametrize("kw", [{"block_n": 24}, {"block_k": 8}, {"split_k": 0}])
def test_bad_arguments_are_refused(kw):
    x, w, _ = _case(0, 2, 64, 32, False)
    with pytest.raises(ValueError, match="small_m_linear"):
        TL.small_m_linear(x, w, **kw)
    with pytest.raises(ValueError, match="does not take"):
        TL.small_m_linear(x, w[:, :32])


GATED = [(3, 100, 35, 1, 32, 32, 0.0), (8, 256, 24, 3, 16, 64, 0.5), (20, 64, 33, 2, 32, 16, 0.0),  # rows, K, F..
         (70, 200, 20, 3, 16, 32, 0.0)]  # two row blocks, K not a multiple of the K step, a short last split


def _gated_worst(dtype, swap=False, seed0=0):
    worst = 0.0
    for i, (rows, k, f, split, bn, bk, off) in enumerate(GATED):
        g = torch.Generator().manual_seed(seed0 + i)
        x = torch.randn(rows, k, generator=g).to(DEV, dtype)
        w = (torch.randn(2 * f, k, generator=g) * k ** -0.5).to(DEV, dtype)
        kw = {"block_n": bn, "block_k": bk, "split_k": split}
        y = TL.small_m_gated(x, torch.cat([w[f:], w[:f]]) if swap else w, off, **kw)
        assert y.shape == (rows, f) and y.dtype == dtype
        if not swap:
            assert torch.equal(y, silu_mul(TL.small_m_linear(x, w, **kw), off)), (rows, k, f, split)
        ref = silu_mul(torch.nn.functional.linear(x, w), off)
        worst = max(worst, _rel(y, ref))
    return worst


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_small_m_gated_equals_the_gemm_then_silu_mul(dtype):
    seed = int(torch.randint(0, 1 << 30, ()).item())
    tol = 1e-2 if dtype == torch.bfloat16 else TOL
    worst = _gated_worst(dtype, seed0=seed)
    assert worst < tol, f"seed {seed}: {worst:.2e}"


def test_mutation_gate_and_up_swapped_fails():
    assert _gated_worst(DT, swap=True) > 0.1
