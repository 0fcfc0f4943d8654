"""compat.optim's foreach fallbacks against megatron-core's local ones (used by its optimizer when neither
transformer-engine nor apex is installed): the same gradient norm and the same scaled copies, bit for bit on CPU,
without megatron's host read of every tensor's norm."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rollplex_megatron.compat import apply_cpu_shims
from rollplex_megatron.compat.optim import foreach_l2_norm, foreach_scale, use_foreach_fallbacks


class HostReads(TorchDispatchMode):
    """Counts the ops that read a device value back to the host."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func.overloadpacket.__name__ in ("_local_scalar_dense", "item")
        return func(*args, **(kwargs or {}))


def _tensors(seed: int, dtype) -> list[torch.Tensor]:
    """Tensors of ragged shapes and scales (a norm over many magnitudes), one of them all zero."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(int(torch.randint(1, 300, (1,), generator=g)),) for _ in range(13)] + [(7, 5), (1,), (64, 3)]
    out = [(torch.randn(s, generator=g) * 10.0 ** float(torch.randint(-4, 4, (1,), generator=g))).to(dtype)
           for s in shapes]
    out[3].zero_()
    return out


def _norm_case(seed, dtype, ours=foreach_l2_norm):
    from megatron.core.utils import local_multi_tensor_l2_norm

    apply_cpu_shims()
    grads = _tensors(seed, dtype)
    with HostReads() as theirs_reads:
        want, _ = local_multi_tensor_l2_norm(2048 * 32, None, [grads], False)
    with HostReads() as our_reads:
        got, _ = ours(2048 * 32, None, [grads], False)
    return got, want, our_reads.n, theirs_reads.n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_l2_norm_equals_megatrons_without_host_reads(seed, dtype):
    got, want, ours, theirs = _norm_case(seed, dtype)
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape == (1,)
    assert torch.equal(got, want), (got, want)
    # megatron reads the total back (and, on CUDA, each tensor's norm as it builds a host tensor of them)
    assert ours == 0 and theirs >= 1


def test_l2_norm_check_fails_a_wrong_norm():
    """Mutation: a norm that leaves the last tensor out is caught."""
    def short(chunk, noop, lists, per_tensor):
        return foreach_l2_norm(chunk, noop, [lists[0][:-1]], per_tensor)

    got, want, _, _ = _norm_case(0, torch.float32, short)
    assert not torch.equal(got, want)


@pytest.mark.parametrize("scale", [1.0, 0.37])
@pytest.mark.parametrize("src_dtype,dst_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                 (torch.float32, torch.float32)])
def test_scale_equals_megatrons(scale, src_dtype, dst_dtype):
    from megatron.core.utils import local_multi_tensor_scale

    src = _tensors(5, src_dtype)
    theirs = [torch.full_like(s, 7.0, dtype=dst_dtype) for s in src]
    ours = [t.clone() for t in theirs]
    local_multi_tensor_scale(2048 * 32, None, [src, theirs], scale)
    foreach_scale(2048 * 32, None, [src, ours], scale)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert any(not torch.equal(a, torch.full_like(a, 7.0)) for a in ours)  # written


def test_only_megatrons_local_fallbacks_are_replaced():
    from megatron.core.optimizer import clip_grads, optimizer

    use_foreach_fallbacks()
    assert clip_grads.l2_norm_impl is foreach_l2_norm
    assert clip_grads.multi_tensor_scale_impl is optimizer.multi_tensor_scale_impl is foreach_scale
    assert use_foreach_fallbacks() == []  # nothing of megatron's left to replace (and TE/apex kernels never are)


class Ops(TorchDispatchMode):
    """The ops run, by name."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clipping_scales_the_gradients_in_place_as_megatron(dtype):
    """Clipping passes one list as source and destination: the result is megatron's, and no out-of-place product
    (a second copy of every gradient at once) is made; a distinct source list is left as it was."""
    from megatron.core.utils import local_multi_tensor_scale

    theirs = _tensors(7, dtype)
    ours = [t.clone() for t in theirs]
    local_multi_tensor_scale(2048 * 32, None, [theirs, theirs], 0.37)
    with Ops() as ops:
        foreach_scale(2048 * 32, None, [ours, ours], 0.37)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert "_foreach_mul" not in ops.names and "mul" not in ops.names  # only in-place products
    src = _tensors(8, dtype)
    before = [t.clone() for t in src]
    foreach_scale(2048 * 32, None, [src, [torch.empty_like(t) for t in src]], 0.37)
    assert all(torch.equal(a, b) for a, b in zip(src, before))


def test_the_norm_stays_on_the_gradients_device_and_empty_lists_pass():
    """The norm is left where the gradients are (meta here stands for a GPU: the all-reduce reads it there);
    no tensors give megatron's 0 and a scale of nothing does nothing."""
    grads = [t.to("meta") for t in _tensors(9, torch.float32)]
    norm, _ = foreach_l2_norm(2048 * 32, None, [grads], False)
    assert norm.device.type == "meta" and norm.shape == (1,)
    empty, _ = foreach_l2_norm(2048 * 32, None, [[]], False)
    assert empty.shape == (1,) and float(empty.cpu()) == 0.0
    foreach_scale(2048 * 32, None, [[], []], 0.5)
