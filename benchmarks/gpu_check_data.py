"""GPU machine (torchvision present): (1) the project's video patches (`envs/vision.video_patches`, PIL
bicubic per frame) against transformers' own `Qwen2VLVideoProcessor` (torchvision resize), and its
frame sampling against `sample_frames`; (2) the `make-example` dataset trained on the GPU with the
prompt prefetch on and off: the share of step time spent waiting for prompts.

    python3 benchmarks/gpu_check_data.py OUT_JSON
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
from transformers.video_utils import VideoMetadata

from rollplex_megatron.envs.vision import sample_frame_indices, video_patches
from rollplex_megatron.runtime import environment_record

MIN_PX, MAX_PX = 128 * 28 * 28, 768 * 28 * 28  # the video processor's defaults


def _frames(t: int, h: int, w: int, smooth: bool, g: torch.Generator) -> torch.Tensor:
    """Random uint8 frames: white noise, or smooth (upsampled coarse noise, like natural images)."""
    if not smooth:
        return torch.randint(0, 256, (t, 3, h, w), dtype=torch.uint8, generator=g)
    coarse = torch.rand(t, 3, max(2, h // 16), max(2, w // 16), generator=g)
    return (torch.nn.functional.interpolate(coarse, size=(h, w), mode="bilinear") * 255).round().to(torch.uint8)


def compare_videos() -> list[dict]:
    """Per video shape: grids equal, and the pixel rows' largest and mean absolute difference."""
    proc = Qwen2VLVideoProcessor(size={"shortest_edge": MIN_PX, "longest_edge": MAX_PX})
    g = torch.Generator().manual_seed(0)
    out = []
    for t, h, w in [(4, 100, 60), (8, 224, 224), (5, 37, 91), (6, 480, 640), (4, 720, 1280)]:
        for smooth in (False, True):
            frames = _frames(t, h, w, smooth, g)
            ref = proc(videos=[frames], do_sample_frames=False, return_tensors="pt")
            rows, grid = video_patches(frames, 14, 2, 2, MIN_PX, MAX_PX)
            same_grid = list(grid) == ref["video_grid_thw"][0].tolist()
            rec = {"frames": t, "h": h, "w": w, "content": "smooth" if smooth else "noise", "grid": list(grid),
                   "grid_equal": same_grid}
            if same_grid:
                d = (rows - ref["pixel_values_videos"].float()).abs()
                rec |= {"max_abs_diff": float(d.max()), "mean_abs_diff": float(d.mean()),
                        "rel_norm_diff": float(d.norm() / ref["pixel_values_videos"].float().norm())}
            out.append(rec)
    return out


def compare_sampling() -> dict:
    """Indices and sampled fps of the project's sampler against the processor's `sample_frames`."""
    proc = Qwen2VLVideoProcessor()
    cases, bad = 0, []
    for total in (4, 7, 16, 33, 100, 301):
        for fps in (1.0, 2.5, 24.0, 30.0):
            for target in (0.5, 1.0, 2.0, 4.0):
                for max_frames in (8, 64, 768):
                    meta = VideoMetadata(total_num_frames=total, fps=fps, duration=total / fps)
                    try:
                        ref = proc.sample_frames(meta, fps=target, min_frames=4, max_frames=max_frames)
                    except (ValueError, ZeroDivisionError):
                        continue
                    idx, _ = sample_frame_indices(total, fps, target, 4, max_frames, 2)
                    cases += 1
                    if idx.tolist() != torch.as_tensor(ref).tolist():
                        bad.append([total, fps, target, max_frames])
    return {"cases": cases, "mismatches": bad[:10], "n_mismatches": len(bad)}


def _train(example: Path, prefetch: str, steps: int, run: Path) -> dict:
    train = next(example.glob("train.*"))
    cmd = [sys.executable, "-m", "rollplex_megatron", "train", f"train.init_hf={example / 'model'}",
           f"data.train_files=[{train}]", "rollout.max_response_len=4", "reward.format_reward=0.5",
           f"train.steps={steps}", f"data.prefetch={prefetch}", "train.progress=false", "train.save_final=false",
           f"train.out={run}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        return {"command": " ".join(cmd), "rc": proc.returncode, "tail": proc.stderr[-2000:]}
    recs = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    steady = [r for r in recs if r.get("kind") != "val"][2:]  # steps 1-2: warm-up (allocator, first batch)
    return {"command": " ".join(cmd), "rc": 0, "wall_s": time.perf_counter() - t0, "steady_steps": len(steady),
            "step_time_s_median": statistics.median(r["step_time_s"] for r in steady),
            "data_time_s_median": statistics.median(r["data_time_s"] for r in steady),
            "data_share_median": statistics.median(r["data_share"] for r in steady),
            "rollout_logp_diff_max": max(r["rollout_logp_diff"] for r in steady)}


def main(out_json: str) -> None:
    rec = {"what": __doc__.splitlines()[0], "transformers": transformers.__version__,
           "env": environment_record(), "commit": os.environ.get("ROLLPLEX_COMMIT", ""),
           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    rec["video_vs_transformers"] = compare_videos()
    rec["sampling_vs_transformers"] = compare_sampling()
    with tempfile.TemporaryDirectory() as tmp:
        example = Path(tmp) / "example"
        subprocess.run([sys.executable, "-m", "rollplex_megatron", "make-example", str(example), "--train-rows",
                        "512", "--val-rows", "8"], check=True, capture_output=True)
        rec["train"] = {p: _train(example, p, 30, Path(tmp) / f"run_{p}") for p in ("off", "on")}
    Path(out_json).write_text(json.dumps(rec, indent=1))
    print(json.dumps({k: v for k, v in rec.items() if k != "env"}, indent=1)[:6000])


if __name__ == "__main__":
    main(sys.argv[1])
