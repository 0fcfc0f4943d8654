"""`verify-hf`: the megatron model against its family's transformers class on the same checkpoint.

A fixed prompt per batch row with one image and one video (pixels from a fixed seed), in the family's prompt
format (a video as one placeholder run, or one run per frame); the megatron logits, gathered over TP, are compared
with transformers' logits in fp32 on the CPU.
"""
from __future__ import annotations

import inspect

import torch
from megatron.core import parallel_state as ps

from rollplex_megatron.config import ModelConfig, ParallelConfig, check_model_parallel
from rollplex_megatron.dist import init_parallel
from rollplex_megatron.models.registry import model_spec, open_hf

TOLERANCE = 1e-4  # max abs logit difference accepted (fp32)


def synthetic_inputs(cfg: ModelConfig, seed: int, batch: int, image_thw: tuple[int, int, int],
                     video_thw: tuple[int, int, int], text_tokens: int,
                     second_per_grid_t: float = 1.5) -> dict:
    """Rows `text <vs> image <ve> text <vs> video <ve> text` with random pixels; grids in patches."""
    g = torch.Generator().manual_seed(seed)
    v = cfg.vision
    m = v.spatial_merge_size
    n_img = image_thw[0] * image_thw[1] * image_thw[2]
    n_vid = video_thw[0] * video_thw[1] * video_thw[2]
    patch = v.in_channels * v.temporal_patch_size * v.patch_size**2
    text_hi = min(cfg.vocab_size, cfg.image_token_id, cfg.video_token_id,
                  cfg.vision_start_token_id, cfg.vision_end_token_id)
    a, b = text_tokens // 3, text_tokens // 4
    runs = video_thw[0] if model_spec(cfg).processor.video_run_per_frame else 1  # Qwen3-VL: a run per frame

    def run(n: int, token: int) -> list[torch.Tensor]:
        start, end = torch.tensor([cfg.vision_start_token_id]), torch.tensor([cfg.vision_end_token_id])
        return [start, torch.full((n,), token), end]

    rows = []
    for _ in range(batch):
        t = lambda n: torch.randint(0, text_hi, (n,), generator=g)  # noqa: E731
        video = [x for _ in range(runs) for x in run(n_vid // m**2 // runs, cfg.video_token_id)]
        rows.append(torch.cat([t(a), *run(n_img // m**2, cfg.image_token_id), t(b), *video,
                               t(text_tokens - a - b)]))
    return {
        "input_ids": torch.stack(rows),
        "pixel_values": torch.randn(batch * n_img, patch, generator=g),
        "image_grid_thw": torch.tensor([list(image_thw)] * batch),
        "pixel_values_videos": torch.randn(batch * n_vid, patch, generator=g),
        "video_grid_thw": torch.tensor([list(video_thw)] * batch),
        "second_per_grid_ts": torch.tensor([second_per_grid_t] * batch),
    }


def sample_inputs(cfg: ModelConfig, seed: int = 0, batch: int = 2) -> dict:
    """The fixed parity prompt: a 3x5-unit image (partial windows) and a 2-frame video per row.

    Video time steps of `tokens_per_second * 1.5` exceed the spatial extent, so the text after the
    video checks the M-RoPE position-advance convention too.
    """
    m = cfg.vision.spatial_merge_size
    return synthetic_inputs(cfg, seed, batch, (1, 3 * m, 5 * m), (4, 2 * m, 2 * m), 15)


def position_ids_for(cfg: ModelConfig, inputs: dict) -> torch.Tensor:
    """M-RoPE position ids [3,B,S] of `inputs`."""
    pos, _ = model_spec(cfg).positions.sequence(cfg, inputs["input_ids"], inputs.get("image_grid_thw"),
                                                inputs.get("video_grid_thw"), inputs.get("second_per_grid_ts"))
    return pos


def hf_logits(hf_dir: str, inputs: dict, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    """The family's transformers logits [B,S,V] as fp32 on the CPU (the model run in `dtype` on `device`)."""
    reference = model_spec(open_hf(hf_dir).model_config()).hf.reference_model
    model = reference.from_pretrained(hf_dir, dtype=dtype, attn_implementation="sdpa").to(device)
    model.eval()
    inputs = {k: v.to(device, dtype) if k.startswith("pixel") else v.to(device) for k, v in inputs.items()}
    cfg = model.config
    ids = inputs["input_ids"]
    mm = (ids == cfg.image_token_id).int() + 2 * (ids == cfg.video_token_id).int()
    # Qwen2.5-VL's forward reads the video's seconds per grid step; Qwen3-VL's has no such argument
    timing = ({"second_per_grid_ts": inputs["second_per_grid_ts"]}
              if "second_per_grid_ts" in inspect.signature(model.forward).parameters else {})
    with torch.no_grad():
        out = model(input_ids=ids, pixel_values=inputs["pixel_values"],
                    image_grid_thw=inputs["image_grid_thw"],
                    pixel_values_videos=inputs["pixel_values_videos"],
                    video_grid_thw=inputs["video_grid_thw"], mm_token_type_ids=mm, **timing)
    return out.logits.float().cpu()


def megatron_logits(hf_dir: str, inputs: dict, tp: int, dtype: str = "float32", after_load=None) -> torch.Tensor:
    """The megatron model's logits [B,S,V] (TP-gathered) as fp32 on the CPU after loading `hf_dir` (PP=1), the
    model built in `dtype` on this process's device; `after_load(model)` runs once the weights are in."""
    ckpt = open_hf(hf_dir)
    cfg = ckpt.model_config()
    spec = model_spec(cfg)
    check_model_parallel(cfg, ParallelConfig(tp=tp))
    init_parallel(tp=tp, pp=1)
    model = spec.build(cfg, dtype)
    spec.hf.load(model, ckpt, cfg, ps.get_tensor_model_parallel_rank(), tp, 0, 1)
    if after_load is not None:
        after_load(model)
    model.eval()
    device = next(model.parameters()).device
    position_ids = position_ids_for(cfg, inputs).to(device)
    inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}
    with torch.no_grad():
        logits = model(input_ids=inputs["input_ids"], position_ids=position_ids,
                       pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                       pixel_values_videos=inputs["pixel_values_videos"],
                       video_grid_thw=inputs["video_grid_thw"])
        return spec.decode.gather_logits(logits, cfg.vocab_size).float().cpu()


def verify_rank(hf_dir: str, tp: int, seed: int = 0) -> dict:
    """Run on every rank of a TP group: the comparison summary (identical on all ranks)."""
    cfg = open_hf(hf_dir).model_config()
    inputs = sample_inputs(cfg, seed)
    ours = megatron_logits(hf_dir, inputs, tp)
    ref = hf_logits(hf_dir, inputs)
    diff = (ours - ref).abs().max().item()
    return {"max_abs_logit_diff": diff, "tp": tp, "tolerance": TOLERANCE, "ok": diff <= TOLERANCE,
            "logit_abs_max": ref.abs().max().item(), "shape": list(ref.shape)}
