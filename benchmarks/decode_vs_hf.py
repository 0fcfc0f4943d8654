"""Embedded-engine decode throughput against transformers' `generate` on the same weights and batch.

One random Qwen2.5-VL checkpoint is written with transformers and loaded by both sides. Each batch
is `groups` prompts (a video and a text question each) times G samples; every sample decodes
exactly `new_tokens` tokens (no stop token), temperature 1. Runs per batch size:
- hf: `generate` on the batch with every prompt repeated G times (DynamicCache, SDPA attention,
  no torch.compile, logits of the last position only: transformers' defaults);
- engine_shared: the embedded engine, one prefill per group and shared-prefix decode attention;
- engine_unshared: the embedded engine with every sample its own request (G=1): one prefill and
  one prefix K/V per sample, as an engine without prefix sharing holds them;
- engine_shared_eager (GPU): engine_shared without CUDA graphs.
The engine runs replay one CUDA graph per decode step on GPU; their decode time includes the
graph captures of the run (reported as capture_s).
Decode time of `generate` is its time for `new_tokens` minus its time for 1 token (the prefill);
the engine reports prefill and decode separately. One warm-up pass per run is not timed.

    python benchmarks/decode_vs_hf.py --preset qwen2_5_vl_3b --out result.json    (GPU)
    python benchmarks/decode_vs_hf.py --preset tiny --batches 8 --new-tokens 4     (CPU check)
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from functools import partial

import torch

from rollplex_megatron.runtime import sync

SHAPES = {
    "qwen2_5_vl_3b": dict(
        text=dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                  num_attention_heads=16, num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=128000,
                  rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[16, 24, 24])),
        vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                    window_size=112, fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2),
        tokens=dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                    vision_end_token_id=151653), tie=True),
}


def _tiny():
    sys.path.insert(0, ".")
    from tests.hf_models import TINY_TEXT, TINY_TOKENS, TINY_VISION

    return dict(text=TINY_TEXT, vision=TINY_VISION, tokens=TINY_TOKENS, tie=False)


def write_checkpoint(preset: str, path: str, dtype: torch.dtype) -> None:
    """A random checkpoint (transformers' own init) of the preset's shapes."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    s = _tiny() if preset == "tiny" else SHAPES[preset]
    cfg = Qwen2_5_VLConfig(text_config={**s["text"], "tie_word_embeddings": s["tie"]}, vision_config=s["vision"],
                           tie_word_embeddings=s["tie"], **s["tokens"])
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2_5_VLForConditionalGeneration(cfg).to(dtype)
    model.save_pretrained(path)
    del model


def prompts(cfg, groups: int, grid: tuple[int, int, int], text_tokens: int, seed: int = 0):
    """`groups` distinct video prompts of equal length (Prompt objects), in the family's video format (one
    placeholder run, or one run per frame)."""
    from rollplex_megatron.models.registry import model_spec
    from rollplex_megatron.prefix.batch import Prompt

    g = torch.Generator().manual_seed(seed)
    v = cfg.vision
    t, h, w = grid
    n_patch, n_tok = t * h * w, t * h * w // v.spatial_merge_size**2
    runs = t if model_spec(cfg).processor.video_run_per_frame else 1
    start, end = torch.tensor([cfg.vision_start_token_id]), torch.tensor([cfg.vision_end_token_id])
    video = [x for _ in range(runs) for x in (start, torch.full((n_tok // runs,), cfg.video_token_id), end)]
    width = v.in_channels * v.temporal_patch_size * v.patch_size**2
    out = []
    for _ in range(groups):
        hi = min(cfg.image_token_id, cfg.vision_start_token_id, cfg.vocab_size, 150000)  # ordinary text ids
        text = torch.randint(0, hi, (text_tokens,), generator=g)
        ids = torch.cat([text[:4], *video, text[4:]])
        out.append(Prompt(ids, pixel_values_videos=torch.randn(n_patch, width, generator=g),
                          video_grid_thw=torch.tensor([list(grid)]), second_per_grid_ts=torch.tensor([1.0])))
    return out


def random_model(preset: str):
    """One process's parallel state and the preset with random weights (bf16 on GPU, fp32 on CPU),
    in eval mode: (model config, model, on GPU)."""
    from rollplex_megatron.dist import init_parallel
    from rollplex_megatron.models.registry import model_spec
    from rollplex_megatron.recipes import load_run_config

    gpu = torch.cuda.is_available()
    init_parallel(1, 1, 0, "nccl" if gpu else "gloo")
    cfg = load_run_config([f"model={preset}"]).model
    return cfg, model_spec(cfg).build(cfg, "bfloat16" if gpu else "float32").eval(), gpu


def cuda_kernels(prof) -> list:
    """The CUDA kernel rows of a finished torch.profiler run's key averages."""
    return [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]


def run_hf(path: str, cfg, ps, G: int, new_tokens: int, dtype) -> dict:
    from transformers import Qwen2_5_VLForConditionalGeneration

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(dev)
    model.eval()
    ids = torch.stack([p.input_ids for p in ps for _ in range(G)]).to(dev)
    pix = torch.cat([p.pixel_values_videos for p in ps for _ in range(G)]).to(dev, dtype)
    grid = torch.cat([p.video_grid_thw for p in ps for _ in range(G)]).to(dev)
    sec = torch.cat([p.second_per_grid_ts for p in ps for _ in range(G)]).to(dev)

    def gen(n):
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values_videos=pix,
                                 video_grid_thw=grid, second_per_grid_ts=sec, do_sample=True, temperature=1.0,
                                 top_p=1.0, top_k=0, max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
                                 pad_token_id=0)
        sync()
        assert out.shape[1] == ids.shape[1] + n, out.shape
        return time.perf_counter() - t0

    gen(2)  # warm-up
    t_pre = gen(1)
    t_all = gen(new_tokens)
    model = None  # free the HF model before the next measurement (gen reads it through its closure)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    decode = t_all - t_pre
    return {"total_s": t_all, "prefill_s": t_pre, "decode_s": decode,
            "decode_tokens_per_s": ids.shape[0] * (new_tokens - 1) / decode}


def run_engine(model, cfg, ps, G: int, new_tokens: int, shared: bool, kv_gib: float, graphs: bool = True,
               attention: str = "auto", sampling: str = "auto", kept: bool = False, opts: str = "") -> dict:
    """One timed rollout after a warm-up one. `kept`: the engine keeps its decode state
    (rollout.keep_decode_state) and warms up on the same requests, so the timed rollout replays the warm-up's
    graphs (its capture_s is what a later rollout of a training run pays). `opts` (joined by +): nolayer
    (megatron's layer modules instead of the fused layer path), noskip (the Triton response kernel runs the key
    blocks past each sample's length masked instead of skipping them), gated / all (rollout.decode_gemm),
    threelaunch (the attention's two parts in kernels of their own, one_launch=False)."""
    from rollplex_megatron.attention.triton_decode import triton_shared_prefix_decode_attention
    from rollplex_megatron.rollout import embedded
    from rollplex_megatron.rollout.engine import RolloutRequest
    from rollplex_megatron.rollout.sampling import SamplingParams

    embedded.triton_shared_prefix_decode_attention = partial(triton_shared_prefix_decode_attention,
                                                             skip_empty="noskip" not in opts.split("+"),
                                                             one_launch="threelaunch" not in opts.split("+"))
    eng = embedded.EmbeddedEngine(model, cfg, max_prompt_len=max(p.input_ids.numel() for p in ps),
                                  max_response_len=new_tokens, kv_cache_gib=kv_gib, cuda_graphs=graphs,
                                  decode_attention=attention, sampling_kernel=sampling, keep_decode_state=kept,
                                  fused_layer="nolayer" not in opts,
                                  decode_gemm=next((g for g in ("gated", "all") if g in opts.split("+")), "torch"))
    if shared:
        reqs = [RolloutRequest(p, G, new_tokens, (), seed=i) for i, p in enumerate(ps)]
    else:
        reqs = [RolloutRequest(p, 1, new_tokens, (), seed=i * G + j) for i, p in enumerate(ps) for j in range(G)]
    params = SamplingParams(1.0, 1.0, 0)
    eng.generate(reqs if kept else reqs[:1], params)  # warm-up
    sync()
    t0 = time.perf_counter()
    out = eng.generate(reqs, params)
    sync()
    total = time.perf_counter() - t0
    n = sum(t.numel() for r in out.results for t in r.tokens)
    assert n == len(ps) * G * new_tokens, n
    st = out.stats
    return {"total_s": total, "prefill_s": st["prefill_s"], "decode_s": st["decode_s"], "waves": st["waves"],
            "decode_steps": st["decode_steps"], "decode_attention": eng.attention, "sampling_kernel": st["sampling"],
            "fused_rope": eng.fused_rope, "fused_norm": eng.fused_norm, "fused_layer": eng.fused_layer,
            "decode_gemm": eng.decode_gemm, "one_launch_attention": "threelaunch" not in opts.split("+"),
            "skip_empty_response_blocks": "noskip" not in opts.split("+") and eng.attention == "triton",
            "cuda_graphs": eng.cuda_graphs, "graph_error": eng.graph_error,
            "graphs_captured": st["graphs_captured"],
            "graph_replays": st["graph_replays"], "capture_s": st["capture_s"], "kept_state": kept,
            "states_reused": st["states_reused"],
            "decode_tokens_per_s": len(ps) * G * (new_tokens - 1) / st["decode_s"],
            "decode_tokens_per_s_without_capture": len(ps) * G * (new_tokens - 1) / (st["decode_s"] - st["capture_s"])}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2_5_vl_3b")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--batches", default="64,128", help="decode batch sizes (groups x G)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--grid", default="4,32,32", help="video grid t,h,w in patches")
    ap.add_argument("--text-tokens", type=int, default=64)
    ap.add_argument("--kv-gib", type=float, default=40.0)
    ap.add_argument("--paths", default="auto:auto",
                    help="engine_shared runs the first decode_attention:sampling_kernel[:opts] path; each further "
                         "one runs as engine_shared_<attention>_<sampling>[_<opts>] in the same run (e.g. "
                         "triton:triton,triton:triton:nolayer,flash:torch); opts joined by +: nolayer (megatron's "
                         "layer modules), noskip (the response kernel runs the blocks past each length masked), "
                         "gated / all (rollout.decode_gemm), threelaunch (the attention's parts in kernels of their "
                         "own)")
    ap.add_argument("--only-paths", action="store_true", help="skip the unshared, eager, math and hf runs")
    ap.add_argument("--kept", action="store_true",
                    help="also the first path with rollout.keep_decode_state (a rollout after one of the same shape)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    paths = [tuple((p + "::").split(":")[:3]) for p in a.paths.split(",")]

    from rollplex_megatron.models.qwen25vl.hf import HFCheckpoint, load_hf_into_model
    from rollplex_megatron.dist import init_parallel
    from rollplex_megatron.models.qwen25vl import build_model
    from rollplex_megatron.runtime import environment_record

    gpu = torch.cuda.is_available()
    dtype = torch.bfloat16 if gpu else torch.float32
    init_parallel(1, 1, 0, "nccl" if gpu else "gloo")
    grid = tuple(int(x) for x in a.grid.split(","))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(a.preset, tmp, dtype)
        ck = HFCheckpoint(tmp)
        cfg = ck.model_config()
        model = build_model(cfg, "bfloat16" if gpu else "float32")
        load_hf_into_model(model, ck, cfg, 0, 1, 0, 1)
        model.eval()
        for batch in (int(b) for b in a.batches.split(",")):
            ps = prompts(cfg, batch // a.group_size, grid, a.text_tokens)
            row = {"batch": batch, "groups": len(ps), "group_size": a.group_size,
                   "prompt_tokens": int(ps[0].input_ids.numel()), "new_tokens": a.new_tokens}
            row["engine_shared"] = run_engine(model, cfg, ps, a.group_size, a.new_tokens, True, a.kv_gib,
                                              attention=paths[0][0], sampling=paths[0][1], opts=paths[0][2])
            for attn, samp, opts in paths[1:]:
                name = f"{attn}_{samp}" + (f"_{opts}" if opts else "")
                other = row[f"engine_shared_{name}"] = run_engine(
                    model, cfg, ps, a.group_size, a.new_tokens, True, a.kv_gib, attention=attn, sampling=samp,
                    opts=opts)
                row[f"decode_speedup_shared_over_{name}"] = (row["engine_shared"]["decode_tokens_per_s"]
                                                            / other["decode_tokens_per_s"])
            if a.kept:
                kept = row["engine_shared_kept"] = run_engine(model, cfg, ps, a.group_size, a.new_tokens, True,
                                                              a.kv_gib, attention=paths[0][0], sampling=paths[0][1],
                                                              kept=True, opts=paths[0][2])
                row["decode_speedup_kept_over_shared"] = (kept["decode_tokens_per_s"]
                                                          / row["engine_shared"]["decode_tokens_per_s"])
            if a.only_paths:
                rows.append(row)
                print(json.dumps(row), flush=True)
                continue
            row["engine_unshared"] = run_engine(model, cfg, ps, a.group_size, a.new_tokens, False, a.kv_gib)
            if gpu:
                row["engine_shared_eager"] = run_engine(model, cfg, ps, a.group_size, a.new_tokens, True, a.kv_gib,
                                                        graphs=False)
                for shared in (True, False):  # the fp32 reference attention path, for the ratio in this run
                    row[f"engine_{'shared' if shared else 'unshared'}_math"] = run_engine(
                        model, cfg, ps, a.group_size, a.new_tokens, shared, a.kv_gib, attention="math")
            row["hf"] = run_hf(tmp, cfg, ps, a.group_size, a.new_tokens, dtype)
            hf = row["hf"]["decode_tokens_per_s"]
            for k in ("engine_shared", "engine_unshared", "engine_shared_eager", "engine_shared_math",
                      "engine_unshared_math"):
                if k in row:
                    row[f"decode_speedup_{k.removeprefix('engine_')}_over_hf"] = row[k]["decode_tokens_per_s"] / hf
            row["total_speedup_shared_over_hf"] = row["hf"]["total_s"] / row["engine_shared"]["total_s"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    res = {"command": "python " + " ".join(sys.argv), "preset": a.preset, "rows": rows,
           "settings": {"hf": "transformers generate, DynamicCache, sdpa attention, no torch.compile, "
                              "do_sample temperature 1, min_new_tokens = max_new_tokens",
                        "engine": "embedded engine: one CUDA graph per (batch bucket, samples-per-group bound, "
                                  "response window) replayed per decode step (engine_shared_eager: no graphs); "
                                  f"decode attention and sampling kernel pairs {a.paths} (auto: triton where it "
                                  "runs, else flash, else math; *_math: the fp32 torch attention); "
                                  "decode_s includes graph capture (capture_s)",
                        "dtype": str(dtype), "video_grid": list(grid), "text_tokens": a.text_tokens},
           "environment": environment_record()}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)
    print(json.dumps({"rows": [{k: v for k, v in r.items() if "speedup" in k or k == "batch"} for r in rows]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
