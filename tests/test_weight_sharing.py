"""Rollout weights on the training storage: logits equal a full independent copy, views alias the
training storage (checked by data pointer and offset), and an optimizer step reaches rollout."""
import pytest

from rollplex_megatron.dist import run_local
from rollplex_megatron.recipes import load_run_config
from rollplex_megatron.weights.plan import plan_weights
from tests.weight_workers import shared_vs_full

_UNSPLIT: dict = {}  # (t, r) -> the unsplit runs' results, reused by the split-GEMM test (same inputs, same seed)


def _unsplit(request, t: int, r: int) -> list:
    if (t, r) not in _UNSPLIT:
        hf = request.getfixturevalue("tiny_hf_tp4" if 4 in (t, r) else "tiny_hf")
        _UNSPLIT[(t, r)] = run_local(shared_vs_full, max(t, r), hf, t, r)
    return _UNSPLIT[(t, r)]


@pytest.mark.parametrize("t,r", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (2, 4)])
def test_shared_rollout_weights_match_a_full_copy(request, t, r):
    for res in _unsplit(request, t, r):
        assert res["before"] == 0.0, res["before"]  # same weights, same arithmetic: bitwise equal
        assert res["changed"] > 1e-2, "the optimizer step did not change the logits"
        assert res["after"] == 0.0, res["after"]
        assert all(ok for _, ok in res["aliasing"].values()), {k: v for k, v in res["aliasing"].items() if not v[1]}
        if t == r:
            assert res["allocated"] == 0 and res["classes"] == ["view"]


@pytest.mark.parametrize("t,r", [(2, 1), (4, 2), (1, 2), (2, 4)])
def test_split_gemm_over_local_views_and_remote_pieces(request, t, r):
    """Gathered linears run as several GEMMs over [local views | received pieces], and locally permuted
    ones (the gated fc1 at rollout TP > training TP: two row blocks) over views alone: same logits (up
    to fp32 summation order), and only the remote pieces are allocated."""
    hf = request.getfixturevalue("tiny_hf_tp4" if 4 in (t, r) else "tiny_hf")
    full = _unsplit(request, t, r)
    split = run_local(shared_vs_full, max(t, r), hf, t, r, False, True)
    for a, b in zip(full, split):
        assert b["before"] <= 1e-4 and b["after"] <= 1e-4, (b["before"], b["after"])
        assert b["allocated"] < 0.7 * a["allocated"]
        assert all(ok for _, ok in b["aliasing"].values())


def test_stale_rebuilt_weights_are_detected(tiny_hf):
    """Mutation: skip the refresh after the optimizer step; rebuilt tensors go stale."""
    res = run_local(shared_vs_full, 2, tiny_hf, 2, 1, True)
    assert all(x["after"] > 1e-3 for x in res)


def _kinds(model, t, r, layout):
    cfg = load_run_config([f"model={model}"]).model
    return {k: v["class"] for k, v in plan_weights(cfg, t, r, layout).summary()["by_kind"].items()}


def test_sglang_rules_on_7b_shapes():
    """28 heads, 4 KV heads: qkv is a view at TP=4, a local permutation at TP=2, invalid at TP=8."""
    assert _kinds("qwen2_5_vl_7b", 4, 4, "sglang")["llm.self_attention.linear_qkv.weight"] == "view"
    assert _kinds("qwen2_5_vl_7b", 2, 2, "sglang")["llm.self_attention.linear_qkv.weight"] == "local_permute"
    with pytest.raises(ValueError, match=r"SGLang needs attention heads \(28\) divisible by TP=8"):
        plan_weights(load_run_config(["model=qwen2_5_vl_7b"]).model, 8, 8, "sglang")


def test_sglang_rules_on_3b_and_32b_shapes():
    k3 = _kinds("qwen2_5_vl_3b", 2, 2, "sglang")  # 16 heads, 2 KV heads: one group per rank
    assert k3["llm.self_attention.linear_qkv.weight"] == "view"
    assert k3["vision.self_attention.linear_qkv.weight"] == "local_permute"  # MHA: [q;k;v] vs per-head
    assert k3["llm.mlp.linear_fc1.weight"] == "view" and k3["llm.mlp.linear_fc2.weight"] == "view"
    # 3420 -> 3424 (SGLang) vs 3420 (megatron): rank 0 needs two rows of rank 1 (gather), rank 1 reorders
    # and pads locally
    assert k3["vision.mlp.linear_fc1.weight"] == "mixed"
    k32 = _kinds("qwen2_5_vl_32b", 8, 8, "sglang")  # 40 heads, 8 KV heads
    assert k32["llm.self_attention.linear_qkv.weight"] == "view"
    assert _kinds("qwen2_5_vl_32b", 4, 4, "sglang")["llm.self_attention.linear_qkv.weight"] == "local_permute"


def test_sglang_kv_replication_and_vocab_padding():
    from rollplex_megatron.models.qwen25vl import hf_layout as CL
    from rollplex_megatron.weights import layout as WL

    cfg = load_run_config(["model=qwen2_5_vl_3b"]).model
    rules = {x.mcore: x for x in CL.model_rules(cfg, 4, 1)}
    qkv = rules["language_model.decoder.layers.0.self_attention.linear_qkv.weight"]
    hd, nh = 128, 16
    # TP=4 > 2 KV heads: ranks 0,1 hold KV head 0, ranks 2,3 KV head 1
    for rank, head in [(0, 0), (1, 0), (2, 1), (3, 1)]:
        idx = WL.sglang_index(qkv, [(nh * hd, 2048), (256, 2048), (256, 2048)], 4, rank, cfg).index
        assert idx[4 * hd] == nh * hd + head * hd and idx[5 * hd] == nh * hd + 2 * hd + head * hd
    emb = rules["language_model.embedding.word_embeddings.weight"]
    # 151936 = 64 * 2374 splits evenly over TP=2 and 4; over TP=3 it is padded to a multiple of 64*3
    assert WL.sglang_index(emb, [(151936, 2048)], 2, 1, cfg).index.numel() == 151936 // 2
    assert WL.sglang_index(emb, [(151936, 2048)], 4, 3, cfg).index.numel() == 151936 // 4
    last = WL.sglang_index(emb, [(151936, 2048)], 3, 2, cfg).index
    assert last.numel() == 152064 // 3 and int((last < 0).sum()) == 152064 - 151936


def test_plan_totals_by_hand_on_3b():
    cfg = load_run_config(["model=qwen2_5_vl_3b"]).model
    s = plan_weights(cfg, 2, 2).summary()
    assert s["allocated_bytes"] == 0 and s["saved_fraction"] == 1.0
    s = plan_weights(cfg, 1, 2).summary()
    # r > t: the gated fc1 weights and vision fc1 biases (two row blocks each) are copied; on GPU 1
    # the embedding too: rollout pads the vocabulary to 152064 (128*2), training only to 151936.
    fc1 = 2 * (2 * 11008 // 2) * 2048 * 36 + 2 * (2 * 3420 // 2) * 1280 * 32 + 2 * (2 * 3420 // 2) * 32
    assert s["per_gpu"][0]["allocated_bytes"] == fc1
    assert s["allocated_bytes"] == fc1 + 2 * (152064 // 2) * 2048


def test_plan_weights_cli_json():
    import json
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "rollplex_megatron", "plan-weights", "model=qwen2_5_vl_7b",
                        "parallel.tp=4", "rollout.tp=4", "layout=sglang", "--json"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout.strip().splitlines()[-1])
    assert {"full_copy_bytes", "allocated_bytes", "by_kind"} <= set(s)
    assert s["by_kind"]["llm.self_attention.linear_qkv.weight"]["class"] == "view"
    assert 0 < s["allocated_bytes"] < s["full_copy_bytes"]


def test_plan_weights_cli_refuses_a_bad_element_size(capsys):
    from rollplex_megatron.cli import main

    for bad in ("0", "x", "3"):
        assert main(["plan-weights", f"dtype_bytes={bad}"]) == 1
        err = capsys.readouterr().err
        assert f"dtype_bytes={bad} is the rollout weights' bytes per element" in err and err.count("\n") == 1, err
    assert main(["plan-weights", "dtype_bytes=4"]) == 0  # fp32 rollout weights are a plan, not an error
    capsys.readouterr()
    assert main(["plan-weights", "train_tp=2"]) == 1  # not an argument: the run's own parallel.tp is
    err = capsys.readouterr().err
    assert err.startswith("error: plan-weights: train_tp= is not an argument") and err.count("\n") == 1, err
