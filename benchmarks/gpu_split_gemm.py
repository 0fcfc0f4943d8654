"""GPU machine, one GPU: one GEMM on a materialised rollout weight vs split GEMMs over
[local view | received piece], Qwen2.5-VL-3B LLM shapes, train TP=2 -> rollout TP=1 (bf16).

Per layer type the rollout weight is the union of the local training half and a remote half:
qkv (column-parallel: 2 row runs), fc1 (column-parallel [gate; up]: 4 row runs), fc2 and proj
(row-parallel: 2 column runs). Times are medians of CUDA-event-timed repeats. Usage:
  python3 benchmarks/gpu_split_gemm.py OUT_JSON
"""
import json
import statistics
import sys

import torch
import torch.nn.functional as F

H, FFN, NQ, NKV, HD = 2048, 11008, 16, 2, 128


def bench(fn, reps=50):
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def case(name, rows, cols, row_runs, col_runs, tokens):
    dev, dt = "cuda", torch.bfloat16
    full = torch.randn(rows, cols, device=dev, dtype=dt) / cols**0.5
    x = torch.randn(tokens, cols, device=dev, dtype=dt)
    if row_runs:
        pieces = [full[a:a + n] for a, n in row_runs]
        split = lambda: torch.cat([F.linear(x, w) for w in pieces], dim=-1)  # noqa: E731
    else:
        pieces = [(a, full[:, a:a + n]) for a, n in col_runs]
        split = lambda: sum(F.linear(x[:, a:a + w.shape[1]], w) for a, w in pieces)  # noqa: E731
    one = lambda: F.linear(x, full)  # noqa: E731
    err = ((split().float() - one().float()).norm() / one().float().norm()).item()
    t1, ts = bench(one), bench(split)
    return {"layer": name, "tokens": tokens, "weight": [rows, cols], "single_gemm_s": t1, "split_gemm_s": ts,
            "split_over_single": ts / t1, "rel_diff": err}


def main():
    qkv_rows = (NQ + 2 * NKV) * HD
    out = []
    for tokens in (64, 256, 1024, 4096):
        out.append(case("linear_qkv", qkv_rows, H, [(0, qkv_rows // 2), (qkv_rows // 2, qkv_rows // 2)], None, tokens))
        out.append(case("linear_fc1", 2 * FFN, H, [(i * FFN // 2, FFN // 2) for i in range(4)], None, tokens))
        out.append(case("linear_fc2", H, FFN, None, [(0, FFN // 2), (FFN // 2, FFN // 2)], tokens))
        out.append(case("linear_proj", H, H, None, [(0, H // 2), (H // 2, H // 2)], tokens))
    from rollplex_megatron.runtime import environment_record

    json.dump({"command": "python3 benchmarks/gpu_split_gemm.py", "results": out,
               "environment": environment_record()}, open(sys.argv[1], "w"), indent=2)
    for r in out:
        print(f"{r['layer']:12s} tokens {r['tokens']:5d}: single {r['single_gemm_s'] * 1e6:8.1f} us, "
              f"split {r['split_gemm_s'] * 1e6:8.1f} us, ratio {r['split_over_single']:.3f}, diff {r['rel_diff']:.1e}")


if __name__ == "__main__":
    main()
