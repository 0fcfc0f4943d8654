"""GPU-only: memory.optimizer_step=stream against megatron's resident step in bf16 with fp32 masters, on the copy
streams (one, and one per direction): the same weights, masters and Adam states after three steps, bit for bit
(Adam is elementwise: a bucket's elements get the resident step's arithmetic), with the optimizer phase's
allocator peak lower and both steps' seconds printed (the streaming cost: the copies in and out run inside the
phase, where the resident plan copies them at the phase's entry and the next phase's).

Marked `gpu`: skipped, with a reason, without CUDA (tests/test_streamed_optimizer.py checks the same on CPU, at
TP=1 and TP=2, with mutants); run on the device machine with `benchmarks/gpu_env.sh`'s `gpu_tests`.
"""
import pytest
import torch

from rollplex_megatron.dist import run_local
from tests import stream_optimizer_workers as W

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA: the copy streams and the allocator's peak exist on GPU only", allow_module_level=True)

# 3B's widths and vocabulary (its 311M-element embedding is split across buckets), 4 of its 36 layers
MODEL = ("model=qwen2_5_vl_3b", "model.num_layers=4", "model.vision.depth=2", "model.vision.fullatt_block_indexes=[1]")


@pytest.fixture(scope="module")
def results():
    """One spawn: the timed case (3B's widths, 512 MiB buckets), and the tiny model in buckets of ~4096 elements
    (every larger parameter split, about 60 buckets through the two slots) with a checkpoint's state loaded."""
    cases = {f"bf16_{n}": dict(dtype="bfloat16", released="phase", bucket_mib=512.0, model=MODEL, load=False,
                               copy_streams=n) for n in (1, 2)}
    cases["small_buckets"] = dict(dtype="bfloat16", released="phase", bucket_mib=0.05)
    return run_local(W.run_cases, 1, 1, cases, "auto")[0]


def test_small_buckets_on_the_copy_stream_equal_resident(results):
    out = results["small_buckets"]
    assert out["equal"] == {"weights": True, "state_dict": True}, out["equal"]
    assert out["equal_after_load"] == {"weights": True, "state_dict": True}, out["equal_after_load"]
    assert out["stats"][-1]["buckets"] > 10 and out["stats"][-1]["split_params"] > 0


@pytest.mark.parametrize("copy_streams", [1, 2])
def test_streamed_step_equals_resident_in_bf16_and_is_timed(results, copy_streams):
    out = results[f"bf16_{copy_streams}"]
    assert out["equal"] == {"weights": True, "state_dict": True}, out["equal"]
    assert all(a == b for a, b in out["grad_norms"]), out["grad_norms"]
    assert all(out["streamed_zero"])
    r = lambda xs: [round(x, 3) for x in xs]  # noqa: E731
    resident_peak, stream_peak = out["peak_bytes"][0::2], out["peak_bytes"][1::2]
    print(f"\nmemory.copy_streams={copy_streams}, steps 1-{W.STEPS}: optimizer phase (entry + step) resident "
          f"{r(out['seconds'][0::2])} s, streamed {r(out['seconds'][1::2])} s; the next phase's entry (the resident "
          f"plan's offload) resident {r(out['exit_seconds'][0::2])} s, streamed {r(out['exit_seconds'][1::2])} s; "
          f"allocator peak resident {max(resident_peak) / 2**30:.2f} GiB, streamed {max(stream_peak) / 2**30:.2f} "
          f"GiB; {out['stats'][-1]}")
    assert max(stream_peak) < max(resident_peak) - 2 * 2**30  # masters and states (~6 GiB here) stay on the host
