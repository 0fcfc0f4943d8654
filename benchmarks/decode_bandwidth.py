"""Each kernel class's share and achieved bandwidth in a recorded decode step profile (`decode_step_profile.py`'s
JSON), against the step's memory bound. Runs on CPU: it reads the profile and the model preset only.

Classes by kernel name: GEMMs (cuBLAS, nvjet, CUTLASS, their split-K reductions, models/triton_linear.py's),
decode attention (the Triton prefix, response and merge kernels), RoPE and cache write, norms and glue (the fused
add-and-norm, the decode norm, the gated activation, torch's elementwise adds), sampling, and the rest (the step's
bookkeeping: indexing, copies, reductions). Bytes a step must read, counted for the two classes that move most of them:
- GEMMs: every weight of the language model's layers once (q/k/v, output, gated fc1, fc2, with their biases and
  norms) and the LM head, in the compute dtype (`memory/tensor_bytes.py`'s counts); activations are a few MB and
  left out;
- attention: each group's prefix K/V once per layer (the profile's step is the first response step, so the
  response keys are a handful of positions and left out).
The other classes move kilobytes to a few MB a kernel: their time is launch and latency, reported as time and
count only. The bound is the counted bytes at the device's bandwidth (`--tbps`, default the H100 SXM's 3.35 TB/s
specification; say which when quoting it).

    python benchmarks/decode_bandwidth.py benchmarks/results/decode_step_profile_layer_h100_1198c06.json \
        --out benchmarks/results/decode_bandwidth_h100_1198c06.json
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from rollplex_megatron.memory.tensor_bytes import kv_bytes_per_token, param_counts  # noqa: E402
from rollplex_megatron.recipes import load_run_config  # noqa: E402

CLASSES = (  # (class, pattern on the kernel's name), first match wins
    ("gemm", r"nvjet|gemm|cutlass|splitKreduce|^_sml_"),  # _sml_: models/triton_linear.py (decode_gemm=triton)
    ("attention", r"^_prefix_kernel|^_resp_kernel|^_merge_kernel|^_parts_kernel"),
    ("rope_cache_write", r"^_rope_write_kernel"),
    ("norm_glue", r"^_add_rms_norm|^_rms_norm|^_silu_mul|CUDAFunctor_add<c10::BFloat16>"),
    ("sampling", r"^_sample"),
)


def kernel_class(name: str) -> str:
    """The class of a profiled kernel name (`CLASSES`), else `other`."""
    return next((c for c, pat in CLASSES if re.search(pat, name)), "other")


def weight_bytes(model, elem: int = 2) -> dict:
    """Bytes of the language model's layers (their linears, with the biases and norms they hold) and of the LM head
    (the output layer, or the tied embedding), each read once a decode step (the planner's parameter counts)."""
    c = param_counts(model)
    return {"layers": c["layer"] * model.num_layers * elem, "lm_head": (c["output"] or c["embedding"]) * elem}


def prefix_kv_bytes(model, groups: int, prompt_tokens: int, elem: int = 2) -> int:
    """Each group's prefix K/V, every layer, read once a step."""
    return groups * prompt_tokens * kv_bytes_per_token(model, 1, model.num_layers, elem)


def analyse(profile: dict, model, tbps: float) -> dict:
    """Per profiled case: each class's ms, launches, share of the kernel time, and (GEMMs, attention) bytes and
    achieved TB/s; the step's counted bytes, its bound at `tbps` and the kernel time over that bound."""
    weights = weight_bytes(model)
    rows = {}
    for name, r in profile["rows"].items():
        ms, launches = {}, {}
        for k, t in r["top_kernels_ms_per_step"].items():
            c = kernel_class(k)
            ms[c] = ms.get(c, 0.0) + t
            launches[c] = launches.get(c, 0.0) + r["top_kernel_launches_per_step"].get(k, 0.0)
        counted = {"gemm": sum(weights.values()),
                   "attention": prefix_kv_bytes(model, r["groups"], profile["prompt_tokens"])}
        total = r["kernel_ms_per_step"]
        classes = {}
        for c in sorted(ms, key=lambda c: -ms[c]):
            row = {"ms": round(ms[c], 3), "launches": launches[c], "share": round(ms[c] / total, 3)}
            if c in counted:
                row |= {"bytes": counted[c], "tbps": round(counted[c] / ms[c] / 1e9, 2)}
            classes[c] = row
        need = sum(counted.values())
        bound_ms = need / tbps / 1e9
        rows[name] = {"batch": r["groups"] * r["samples_per_group"], "fused_layer": r["fused_layer"],
                      "kernel_ms": round(total, 3), "kernels": r["kernels_per_step"],
                      "profiled_ms_in_top_kernels": round(sum(ms.values()), 3), "classes": classes,
                      "counted_bytes": need, "bound_ms": round(bound_ms, 3),
                      "kernel_over_bound": round(total / bound_ms, 2)}
    return {"weights_bytes": weights, "tbps": tbps, "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("profile", help="a decode_step_profile.py JSON")
    ap.add_argument("--preset", default="qwen2_5_vl_3b", help="the model preset the profile ran (its default)")
    ap.add_argument("--tbps", type=float, default=3.35, help="device memory bandwidth, TB/s (H100 SXM: 3.35)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    profile = json.loads(Path(a.profile).read_text())
    res = {"command": "python " + " ".join(sys.argv), "profile": Path(a.profile).name,
           "profile_command": profile["command"], "profile_environment": profile["environment"],
           **analyse(profile, load_run_config([f"model={a.preset}"]).model, a.tbps)}
    text = json.dumps(res, indent=1)
    if a.out:
        Path(a.out).write_text(text + "\n")
    for name, r in res["rows"].items():
        parts = ", ".join(f"{c} {v['ms']} ms" + (f" ({v['tbps']} TB/s)" if "tbps" in v else "")
                          for c, v in r["classes"].items())
        print(f"{name}: {r['kernel_ms']} ms, bound {r['bound_ms']} ms ({r['kernel_over_bound']}x): {parts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
