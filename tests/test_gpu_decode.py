"""GPU-only: the flash decode attention against the fp32 reference path, eager and graph-captured; the decode layer
path's kernels against the torch ops they replace, and graph decode through it against the module path (bf16).

Marked `gpu`: skipped, with a reason, without CUDA. The CPU suite tests the reference path
(`test_rollout.py`); these run on the device machine (`benchmarks/gpu_decode_attention.sh`).
"""
import pytest
import torch

from rollplex_megatron.attention.decode import (
    flash_varlen_available,
    flash_index,
    flash_shared_prefix_decode_attention,
    group_slots,
    shared_prefix_decode_attention,
)
from rollplex_megatron.dist import run_local
from rollplex_megatron.recipes import load_run_config
from rollplex_megatron.rollout.sampling import SamplingParams

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA: the flash decode path runs on GPU only", allow_module_level=True)

BF16_TOL = 1e-2  # docs/design.md §3: bf16 outputs within 1e-2 relative


def _case(seed, groups, per_group, p_max=300, rm=64, ng=2, rep=8, d=128, dtype=torch.bfloat16):
    """Random decode step: uneven groups (some with fewer samples), ragged prefix and response lengths."""
    g = torch.Generator().manual_seed(seed)
    dev = "cuda"
    lens = torch.randint(p_max // 3, p_max + 1, (groups,), generator=g)
    mag = 10.0 ** torch.randint(-1, 2, (1,), generator=g).item()
    counts = torch.randint(1, per_group + 1, (groups,), generator=g)
    counts[0] = per_group
    group_B = torch.repeat_interleave(torch.arange(groups), counts)[torch.randperm(int(counts.sum()), generator=g)]
    b = group_B.numel()
    mk = lambda *s, m=1.0: (torch.randn(*s, generator=g) * m).to(dev, dtype)  # noqa: E731
    pk, pv = mk(groups, p_max, ng, d, m=mag), mk(groups, p_max, ng, d)
    rk, rv = mk(b, rm, ng, d, m=mag), mk(b, rm, ng, d)
    rlen = torch.randint(1, rm + 1, (b,), generator=g).to(dev)
    q = mk(b, ng * rep, d)
    return q, pk, pv, lens.to(dev), group_B.to(dev), rk, rv, rlen


def _both(case, window=None):
    q, pk, pv, lens, group_B, rk, rv, rlen = case
    rm = rk.shape[1]
    window = rm if window is None else window
    slot, s_max = group_slots(group_B, pk.shape[0])
    idx = flash_index(lens, pk.shape[1], s_max, rlen, rm)
    fast = flash_shared_prefix_decode_attention(q, pk, pv, group_B, slot, s_max, rk, rv, window, idx, None)
    ref = shared_prefix_decode_attention(q.double(), pk.double(), pv.double(), lens, group_B, rk[:, :window].double(),
                                         rv[:, :window].double(), rlen, None)
    return fast, ref


def _rel(a, b):
    return float((a.double() - b).norm() / b.norm())


@pytest.mark.parametrize("seed,groups,per_group", [(0, 16, 8), (1, 64, 1), (2, 5, 3)])
def test_flash_decode_matches_reference(seed, groups, per_group):
    assert flash_varlen_available(torch.bfloat16, "cuda", 128)
    assert not flash_varlen_available(torch.float32, "cuda", 128)
    assert not flash_varlen_available(torch.bfloat16, "cuda", 260)
    case = _case(seed, groups, per_group)
    fast, ref = _both(case)
    assert _rel(fast, ref) < BF16_TOL
    # the fp32 math path on the same bf16 inputs lands in the same band
    q, pk, pv, lens, group_B, rk, rv, rlen = case
    math = shared_prefix_decode_attention(q, pk, pv, lens, group_B, rk, rv, rlen, None)
    assert _rel(math, ref) < BF16_TOL
    # mutations: padding keys read (prefix length ignored), or every sample on group 0's prefix
    slot, s_max = group_slots(group_B, groups)
    idx = flash_index(torch.full_like(lens, pk.shape[1]), pk.shape[1], s_max, rlen, rk.shape[1])
    pad = flash_shared_prefix_decode_attention(q, pk, pv, group_B, slot, s_max, rk, rv, rk.shape[1], idx, None)
    assert _rel(pad, ref) > 5 * BF16_TOL
    zero = torch.zeros_like(group_B)
    slot0, s0 = group_slots(zero, groups)
    idx0 = flash_index(lens, pk.shape[1], s0, rlen, rk.shape[1])
    wrong = flash_shared_prefix_decode_attention(q, pk, pv, zero, slot0, s0, rk, rv, rk.shape[1], idx0, None)
    assert _rel(wrong, ref) > 5 * BF16_TOL


def test_flash_decode_window_bounds_the_keys_read():
    """Keys past the window are garbage in the engine's buffers; with window >= every length they are never read."""
    q, pk, pv, lens, group_B, rk, rv, rlen = _case(3, 8, 4, rm=128)
    rlen = rlen.clamp(max=64)
    rk[:, 64:], rv[:, 64:] = 1e4, float("nan")
    fast, ref = _both((q, pk, pv, lens, group_B, rk, rv, rlen), window=64)
    assert torch.isfinite(fast).all() and _rel(fast, ref) < BF16_TOL


def test_flash_decode_replays_in_a_cuda_graph():
    """Captured once, replayed on new inputs written in place: equal to the eager call on those inputs."""
    q, pk, pv, lens, group_B, rk, rv, rlen = _case(4, 16, 8)
    slot, s_max = group_slots(group_B, 16, 8)
    idx = flash_index(lens, pk.shape[1], s_max, rlen, rk.shape[1])
    run = lambda: flash_shared_prefix_decode_attention(q, pk, pv, group_B, slot, s_max, rk, rv, rk.shape[1],  # noqa: E731
                                                       idx, None)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for t in (q, pk, pv, rk, rv):
        t.copy_(torch.randn_like(t) * 3)
    rlen.copy_(torch.randint_like(rlen, 1, rk.shape[1] + 1))
    idx.resp_used.copy_(rlen.to(torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, run())


@pytest.mark.parametrize("dtype,top_p", [("bfloat16", 0.9), ("float32", 0.9), ("bfloat16", 1.0)])
def test_engine_graph_decode_equals_eager_decode(tiny_hf, dtype, top_p):
    """The captured step (model, sampling and bookkeeping) replays exactly what the eager step does:
    same tokens, log-probs and finish reasons (bf16: the Triton attention; fp32: the math path; top_p=1 on
    bf16: the fused Triton draw inside the graph)."""
    from tests import rollout_workers as W

    cfg = load_run_config(["model=tiny"])
    res = run_local(W.engine_graphs_vs_eager, 1, cfg, str(tiny_hf), SamplingParams(0.8, top_p, 0), dtype)[0]
    graph, eager = res[True], res[False]
    assert graph["graph_error"] == "" and graph["replays"] > 0 and eager["replays"] == 0
    assert graph["attention"] == ("triton" if dtype == "bfloat16" else "math")
    assert graph["sampling"] == ("triton" if top_p == 1.0 else "torch")
    assert graph["results"] == eager["results"]


@pytest.mark.parametrize("dtype,top_p", [("bfloat16", 1.0), ("float32", 0.9)])
def test_kept_decode_state_replays_graphs_captured_by_an_earlier_rollout(tiny_hf, dtype, top_p):
    """rollout.keep_decode_state on the GPU: a rollout whose shape matches the kept state's replays the graphs
    earlier rollouts captured (over the refilled cache and slot state) and captures only the batch-size buckets
    none of them reached (sampled lengths differ between rollouts, so the shrinking batch can visit another
    bucket: measured at f659cc1, 1-2 of 3-4), and every rollout's tokens, log-probs and finish reasons are a fresh
    engine's exactly (the grown cache's extra
    prefix and response splits are empty partials of the log-sum-exp merge). A rollout that fails mid-decode
    leaves no state to reuse: the next one captures its graphs again."""
    from tests import rollout_workers as W

    cfg = load_run_config(["model=tiny"])
    runs = run_local(W.engine_kept_state, 1, cfg, str(tiny_hf), SamplingParams(0.8, top_p, 0), dtype)[0]
    assert [r["reused"] for r in runs] == [0, 1, 0, 1, 0, 0]  # the last: after a failed rollout, a new state
    assert all(r["graph_error"] == "" for r in runs) and runs[5]["failed_state_dropped"]
    assert runs[0]["captured"] > 0 and runs[2]["captured"] > 0 and runs[5]["captured"] > 0
    for i, r in enumerate(runs[:5]):  # a fresh state captures every bucket it visits; a reused one fewer
        if r["reused"]:
            assert r["captured"] < r["fresh_captured"] and r["replays"] > 0, (i, r["captured"], r["fresh_captured"])
        else:
            assert r["captured"] == r["fresh_captured"], (i, r["captured"], r["fresh_captured"])
    for r in runs:
        assert r["kept"] == r["fresh"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: TP=2 graph decode over NCCL")
def test_engine_graph_decode_tp2_equals_eager_and_tp1(tiny_hf):
    """At TP=2 the step's all-reduces are captured too: graph == eager on each rank, ranks agree, and
    the tokens equal TP=1's (fp32; log-probs within 1e-4: the TP reduction order differs)."""
    from tests import rollout_workers as W

    params = SamplingParams(0.8, 0.9, 0)
    two = run_local(W.engine_graphs_vs_eager, 2, load_run_config(["model=tiny", "parallel.tp=2"]), str(tiny_hf),
                    params, "float32")
    one = run_local(W.engine_graphs_vs_eager, 1, load_run_config(["model=tiny"]), str(tiny_hf), params, "float32")[0]
    for rank in two:
        assert rank[True]["graph_error"] == "" and rank[True]["replays"] > 0
        assert rank[True]["results"] == rank[False]["results"]
    assert two[0][True]["results"] == two[1][True]["results"]
    for (t2, lp2, f2), (t1, lp1, f1) in zip(two[0][True]["results"], one[True]["results"]):
        assert t2 == t1 and f2 == f1
        assert max(abs(a - b) for x, y in zip(lp2, lp1) for a, b in zip(x, y)) < 1e-4


@pytest.mark.parametrize("mechanism", ["interleave", "after", "stream"])
def test_window_items_report_their_gpu_span(tiny_hf, mechanism):
    """On CUDA the window's statistics carry the items' GPU spans (timing events on the stream each ran on)
    beside their host seconds, inside and after the window; the items' K/V still equal direct work."""
    from tests import rollout_workers as W

    res = run_local(W.window_items_match, 1, load_run_config(["model=tiny"]), str(tiny_hf), SamplingParams(),
                    mechanism)[0]
    st = res["stats"]
    assert res["same_keys"] and res["max_abs_diff"] == 0.0
    assert st["window_gpu_s"] + st["after_gpu_s"] > 0
    assert (st["window_gpu_s"] > 0) == (st["items_in_window"] > 0)
    assert (st["after_gpu_s"] > 0) == (st["items_after"] > 0)


def test_fused_layer_kernels_equal_the_torch_ops_in_bf16(tmp_path, monkeypatch):
    """The decode layer path's kernels (models/triton_layer.py) compiled for this GPU, bf16: `add_rms_norm` bit-equal
    to torch's in-place add followed by the decode norm kernel; `silu_mul` bit-equal to megatron's silu(gate) *
    (up + offset) on every finite bf16 gate value (libdevice's expf and the IEEE division, as torch's silu kernel).
    Mutations: the residual add dropped; silu left unrounded before the product."""
    from rollplex_megatron.models import triton_layer as TL
    from tests import decode_layer_workers as W
    from tests.test_decode_layer import _add_norm_case, _every_bf16_gate, _megatron_glu
    from tests.test_triton_kernels import _mutant

    x, res, w, want_h, want_y = _add_norm_case(torch.bfloat16, rows=64, h=2048)
    h, y = TL.add_rms_norm(x, res, w, 1e-6)
    assert x.is_cuda and torch.equal(h, want_h) and torch.equal(y, want_y)
    fc1 = _every_bf16_gate()
    for offset in (0.0, 0.5):
        want, got = _megatron_glu(fc1, offset), TL.silu_mul(fc1, offset)
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num()), offset
    unrounded = ("    s = _r32(tl.math.div_rn(g, 1.0 + _exp(-g, PRECISE)), dt, RNE)",
                 "    s = tl.math.div_rn(g, 1.0 + _exp(-g, PRECISE))")
    monkeypatch.setattr(TL, "_add_rms_norm", _mutant(tmp_path, TL._add_rms_norm, *W.NO_ADD, W.HELPERS))
    monkeypatch.setattr(TL, "_silu_mul", _mutant(tmp_path, TL._silu_mul, *unrounded, W.HELPERS))
    assert not torch.equal(TL.add_rms_norm(x, res, w, 1e-6)[1], want_y)
    assert not torch.equal(TL.silu_mul(fc1, 0.0).nan_to_num(), _megatron_glu(fc1, 0.0).nan_to_num())


def test_graph_decode_with_the_fused_layer_path_equals_the_module_path():
    """bf16, CUDA graphs: the engine's decode through the fused layer path gives the module path's tokens, log-probs
    and finish reasons bit for bit on tiny Qwen2.5-VL and Qwen3-VL models (the path was captured and replayed);
    mutation: the add-and-norm kernel dropping the residual changes the rollout."""
    from tests import decode_layer_workers as W
    from tests.in_turn import case, in_turn

    params = SamplingParams(0.9)
    longer = 24  # steps past each batch bucket's capture, which replay its graph
    calls = {fam: (W.decode_paths, (fam, "bfloat16", params, 1, "", False, (True, False), longer))
             for fam in W.FAMILIES}
    calls["no_add"] = (W.decode_paths, ("qwen25", "bfloat16", params, 1, "no_add", False, (True,), longer))
    out = run_local(in_turn, 1, calls)[0]
    for fam in W.FAMILIES:
        res = case(out, fam)
        assert res[True]["fused_layer"] and not res[False]["fused_layer"] and res[True]["calls"]["silu_mul"] > 0
        for path in (True, False):
            assert res[path]["graph_replays"] > 0 and not res[path]["graph_error"], (fam, path, res[path])
        assert res[True]["results"] == res[False]["results"], fam
    mutant = case(out, "no_add")[True]["results"]
    assert [t for t, _, _ in mutant] != [t for t, _, _ in case(out, "qwen25")[False]["results"]]
