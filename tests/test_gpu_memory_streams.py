"""GPU-only: the residency copies on one stream and on a stream per direction (`memory.copy_streams`) give the
same tensors, bit for bit, through rollplex's phase cycle: at the rollout's entry the master weights go to the
host while the reference comes back, and at the optimizer's entry the master weights come back from the host
buffers their offload was still writing (the prefetch must wait for that copy on the other stream).

Marked `gpu`: skipped, with a reason, without CUDA (on CPU the copies are synchronous and
`test_memory_runtime.py` checks the round trips); these run on the device machine
(`benchmarks/gpu_memory_streams.sh`), which also times the rollout entry's wait (`benchmarks/copy_streams.py`).
"""
import pytest
import torch

from tests.memory_streams_case import manager

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA: the copy streams exist on GPU only", allow_module_level=True)


@pytest.mark.parametrize("copy_streams,ahead", [(1, False), (2, False), (2, True)])
def test_phase_cycle_is_bit_exact(copy_streams, ahead):
    """`ahead`: the masters come back at the update's entry (memory.prefetch_ahead), copied beside the update's
    work and waited for at the optimizer step's entry."""
    early = {"main_weights": "update"} if ahead else None
    mm, main, ref = manager(copy_streams, main_gib=2.0, ref_gib=1.0, seed=copy_streams, ahead=early)
    want_ref = [r.cpu() for r in ref]
    mm.enter("optimizer")  # the reference leaves (its first offload: a device-to-host copy)
    for cycle in range(3):
        with torch.no_grad():
            for i, t in enumerate(main):  # the optimizer step writes the masters in place
                t.mul_(1.0 + 0.001 * (cycle + 1)).add_(float(i + cycle))
        want_main = [t.cpu() for t in main]
        mm.enter("rollout")  # masters out (device to host) while the reference comes back (host to device)
        got_ref = [r.clone() for r in ref]  # read on the compute stream at once, as the window's first item does
        assert all(t.untyped_storage().nbytes() == 0 for t in main)
        mm.enter("update")  # with `ahead` the masters' copy starts here, the update's work beside it
        busy = torch.randn(4096, 4096, device="cuda")
        for _ in range(20):
            busy = busy @ busy / 64
        assert all(t.untyped_storage().nbytes() > 0 for t in main) == ahead
        mm.enter("optimizer")  # masters back from the buffers their offload wrote; the reference leaves
        got_main = [t.clone() for t in main]
        torch.cuda.synchronize()
        assert all(torch.equal(a.cpu(), b) for a, b in zip(got_ref, want_ref)), (copy_streams, cycle, "reference")
        assert all(torch.equal(a.cpu(), b) for a, b in zip(got_main, want_main)), (copy_streams, cycle, "masters")
    assert mm.copy_bytes["h2d"] > 0 and mm.copy_bytes["d2h"] > 0
    separate = mm.copy_streams["d2h"] is not mm.copy_streams["h2d"]
    assert separate == (copy_streams == 2)


def test_reference_ahead_survives_update_and_optimizer_alternating():
    """rollplex's reference brought back at the optimizer step's entry (its phase before the rollout) and released
    again at the next update's before the compute stream waited for it (update and optimizer alternating, entered
    without `then`: the trainer names the update that follows, and the reference then stays out until the last
    optimizer step): the storage is not handed out while that copy may still write it, and the reference read
    at the rollout is bit-exact."""
    mm, main, ref = manager(2, main_gib=2.0, ref_gib=2.0, seed=5, ahead={"reference_weights": "optimizer"})
    want_ref = [r.cpu() for r in ref]
    sizes = [r.numel() for r in ref]
    mm.enter("update")  # the reference leaves (its first offload: a device-to-host copy)
    scratch = []
    for _ in range(3):
        mm.enter("optimizer")  # the reference's copy back starts; nothing waits for it here
        mm.enter("update")  # released again while that copy may still run
        # allocations of its sizes on the compute stream: given its blocks too early, the copy would write them
        scratch += [torch.full((n,), 7.0, dtype=torch.bfloat16, device="cuda") for n in sizes]
    mm.enter("rollout")
    got = [r.clone() for r in ref]
    torch.cuda.synchronize()
    assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want_ref))
    assert all(bool((t == 7.0).all()) for t in scratch)
