"""GPU-only: the split training attention on torch's varlen flash kernels (bf16) against the same split in fp32
math on the same bf16 inputs, and against the masked SDPA path in bf16: outputs and every gradient.

Marked `gpu`: skipped, with a reason, without CUDA. The CPU suite tests the math path against the masked float64
reference (`test_split_attention.py`); these run on the device machine (`benchmarks/gpu_split_attention.sh`).
"""
import pytest
import torch

from rollplex_megatron.attention import split
from rollplex_megatron.attention.decode import flash_varlen_available
from rollplex_megatron.attention.prefix import PackedLayout, shared_prefix_attention
from tests.numerics import rel_err

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA: the split attention's flash kernels run on GPU only", allow_module_level=True)

BF16_TOL = 1e-2  # docs/design.md §3: bf16 outputs within 1e-2 relative; attention gradients held to the same bound here


def _case(seed, groups=3, nq=16, ng=2, d=128, p_max=1100, r_max=300):
    """A micro-batch of ragged responses (1-4 per group) of `groups` groups in shuffled order, 3B head shapes."""
    g = torch.Generator().manual_seed(seed)
    segs = [(gi, int(torch.randint(1, r_max + 1, (1,), generator=g))) for gi in range(groups)
            for _ in range(int(torch.randint(1, 5, (1,), generator=g)))]
    segs = [segs[i] for i in torch.randperm(len(segs), generator=g).tolist()]
    lens, grp = [n for _, n in segs], [gi for gi, _ in segs]
    plens = [int(torch.randint(p_max // 2, p_max + 1, (1,), generator=g)) for _ in range(groups)]
    lay = PackedLayout(torch.cat([torch.full((n,), s) for s, n in enumerate(lens)]),
                       torch.cat([torch.arange(n) for n in lens]),
                       torch.cat([torch.full((n,), gi) for gi, n in zip(grp, lens)]), list(range(groups)), plens,
                       lens, grp)
    t, kp = sum(lens), sum(plens)
    mk = lambda *s, m=1.0: (torch.randn(*s, generator=g) * m).cuda().to(torch.bfloat16)  # noqa: E731
    xs = (mk(t, 1, nq, d, m=2.0), mk(t, 1, ng, d), mk(t, 1, ng, d), mk(kp, 1, ng, d), mk(kp, 1, ng, d))
    return lay, xs, torch.randn(t, 1, nq * d, generator=g).cuda()


def _run(lay, xs, w, kernel, dtype):
    leaves = [x.detach().to(dtype).requires_grad_() for x in xs]
    idx = split.split_index(lay.seg_lens, lay.seg_groups, lay.prefix_groups, lay.prefix_lens, "cuda")
    out = split.split_attention(*leaves, idx, None, kernel=kernel)
    grads = torch.autograd.grad((out.float() * w).sum(), leaves)
    return out.float(), [g.float() for g in grads]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_flash_split_matches_fp32_math_and_the_masked_path(seed):
    assert flash_varlen_available(torch.bfloat16, "cuda", 128)
    lay, xs, w = _case(seed)
    out, grads = _run(lay, xs, w, "flash", torch.bfloat16)
    ref, ref_grads = _run(lay, xs, w, "math", torch.float32)
    errs = {"out": rel_err(out, ref)} | {n: rel_err(g, r) for n, g, r in zip("q k v pk pv".split(), grads, ref_grads)}
    assert max(errs.values()) < BF16_TOL, errs
    # the masked SDPA path (today's default) on the same bf16 inputs: the same function
    q, k, v, pk, pv = xs
    masked = shared_prefix_attention(q, torch.cat([pk, k]), torch.cat([pv, v]), lay.allowed().cuda(), None, "sdpa")
    assert rel_err(masked.float(), ref) < BF16_TOL


def test_flash_split_without_prefix_matches_fp32_math():
    """Full sequences (serial): the self part alone, causal per segment."""
    lay, xs, w = _case(3)
    lay = PackedLayout(lay.seg_T, lay.pos_T, torch.full_like(lay.group_T, -1), [], [], lay.seg_lens,
                       [-1] * len(lay.seg_lens))
    leaves = [x.detach().requires_grad_() for x in xs[:3]]
    idx = split.split_index(lay.seg_lens, lay.seg_groups, [], [], "cuda")
    out = split.split_attention(*leaves, None, None, idx, None, kernel="flash")
    grads = torch.autograd.grad((out.float() * w).sum(), leaves)
    leaves32 = [x.detach().float().requires_grad_() for x in xs[:3]]
    ref = split.split_attention(*leaves32, None, None, idx, None, kernel="math")
    ref_grads = torch.autograd.grad((ref * w).sum(), leaves32)
    errs = [rel_err(out.float(), ref)] + [rel_err(g.float(), r) for g, r in zip(grads, ref_grads)]
    assert max(errs) < BF16_TOL, errs
