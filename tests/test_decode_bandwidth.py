"""benchmarks/decode_bandwidth.py: the recorded analysis is what the recorded profile gives, every profiled kernel
time lands in exactly one class, and the bytes are the model's (the planner's parameter counts, checked against
built models in tests/test_memory_plan.py)."""
import importlib.util
import json
from pathlib import Path

import pytest

from rollplex_megatron.recipes import load_run_config

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
spec = importlib.util.spec_from_file_location("decode_bandwidth", ROOT / "benchmarks" / "decode_bandwidth.py")
DB = importlib.util.module_from_spec(spec)
spec.loader.exec_module(DB)


@pytest.fixture(scope="module",
                params=["decode_bandwidth_h100_1198c06.json", "decode_bandwidth_gemm_h100_d21eb1e.json"])
def recorded(request):
    out = json.loads((RESULTS / request.param).read_text())
    return out, json.loads((RESULTS / out["profile"]).read_text())


def test_the_recorded_analysis_is_the_profiles(recorded):
    out, profile = recorded
    model = load_run_config(["model=qwen2_5_vl_3b"]).model
    assert DB.analyse(profile, model, out["tbps"])["rows"] == out["rows"]


def test_every_kernel_lands_in_one_class_and_the_bytes_are_the_models(recorded):
    _, profile = recorded
    model = load_run_config(["model=qwen2_5_vl_3b"]).model
    res = DB.analyse(profile, model, 3.35)
    h, f, d = model.hidden_size, model.ffn_hidden_size, model.head_dim
    linears = h * (model.num_attention_heads + 2 * model.num_query_groups) * d + model.num_attention_heads * d * h \
        + 3 * f * h  # q/k/v, output, gated fc1 and fc2
    layers = DB.weight_bytes(model)["layers"]
    assert 0 < layers - 2 * linears * model.num_layers < 1e-3 * layers  # + biases and norms
    for name, row in res["rows"].items():
        prof = profile["rows"][name]["top_kernels_ms_per_step"]
        assert sum(c["ms"] for c in row["classes"].values()) == pytest.approx(sum(prof.values()), abs=1e-6)
        att = row["classes"]["attention"]
        assert att["bytes"] == profile["rows"][name]["groups"] * profile["prompt_tokens"] * model.num_layers * 2 \
            * model.num_query_groups * d * 2
    assert [DB.kernel_class(k) for k in ("nvjet_sm90_tst_256x8", "_prefix_kernel", "_add_rms_norm", "x")] == \
        ["gemm", "attention", "norm_glue", "other"]
    # mutation: a class pattern that misses the GEMMs moves their time to `other`
    DB.CLASSES, own = DB.CLASSES[1:], DB.CLASSES
    try:
        assert "gemm" not in DB.analyse(profile, model, 3.35)["rows"][name]["classes"]
    finally:
        DB.CLASSES = own
