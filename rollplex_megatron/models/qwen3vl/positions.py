"""Pure tensor functions for Qwen3-VL positions: the LLM's interleaved M-RoPE, its position ids, and the vision
tower's learned-position interpolation.

Legend: N = vision patches (all images/videos packed, in the processor's merge-block order), S = text sequence,
B = batch, D = LLM head dim, grid_thw = [num_items, 3] patch grid (t, h, w) per image or video, in patches.

Against Qwen2.5-VL (models/qwen25vl/positions.py): the rotary frequencies of the three axes interleave (t h w t h
w ..., HF's `mrope_interleaved`) instead of lying in three contiguous sections; a video is positioned frame by
frame (HF's `get_rope_index` splits each video grid into t grids of one frame, because the prompt separates the
frames by timestamp text `<1.5 seconds><|vision_start|>...<|vision_end|>`), so no `tokens_per_second` scaling and
every frame's temporal position is its own start; the vision tower has no windows.
"""
from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

import torch

from rollplex_megatron.models.qwen25vl.positions import vision_cu_seqlens, vision_patch_positions, vision_rotary_freqs


def mrope_axes(half: int, mrope_section: list[int]) -> torch.Tensor:
    """[D/2] the position axis (0 T, 1 H, 2 W) each rotary frequency of interleaved M-RoPE reads.

    Frequency i takes the H axis where i % 3 == 1 and i < 3 * sections[1], the W axis where i % 3 == 2 and
    i < 3 * sections[2], else T (HF Qwen3-VL `Qwen3VLTextRotaryEmbedding.recomposition_frequencies`)."""
    idx = torch.arange(half)
    axis = torch.zeros(half, dtype=torch.long)
    axis[(idx % 3 == 1) & (idx < 3 * mrope_section[1])] = 1
    axis[(idx % 3 == 2) & (idx < 3 * mrope_section[2])] = 2
    return axis


def mrope_interleaved_freqs(position_ids_3BS: torch.Tensor, inv_freq: torch.Tensor, axis: torch.Tensor) -> torch.Tensor:
    """Rotary angles [S,B,1,D] (megatron's rotate-half layout: the D/2 angles twice) of interleaved M-RoPE, from
    the inverse frequencies [D/2] and `mrope_axes` [D/2], both on the position ids' device."""
    half = inv_freq.numel()
    angles = position_ids_3BS.float()[..., None] * inv_freq.float()  # [3,B,S,D/2]
    picked = angles.gather(0, axis.view(1, 1, 1, half).expand(1, *angles.shape[1:]))[0]
    return torch.cat([picked, picked], dim=-1).transpose(0, 1)[:, :, None, :].contiguous()


def llm_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """[D/2] inverse frequencies of the LLM rotary (HF's default rope init)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def _frame_grids(video_grid_thw: torch.Tensor | None) -> list:
    """Each video grid (t, h, w) as t grids (1, h, w): the prompt holds one placeholder run per frame."""
    if video_grid_thw is None:
        return []
    return [(1, int(h), int(w)) for t, h, w in video_grid_thw.tolist() for _ in range(int(t))]


def mrope_position_ids(input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None,
                       video_grid_thw: torch.Tensor | None, *, image_token_id: int, video_token_id: int,
                       merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE position ids [3,B,S] and deltas [B,1] of unpadded rows, as HF's Qwen3-VL `get_rope_index`.

    Text runs count up on all three axes; an image run, or one video frame's run, takes (t, h, w) grid positions
    offset by the running position (t = 0 within a frame), and the running position then advances by
    max(h, w) / merge. Images and video frames are consumed in order across the batch."""
    b, s = input_ids.shape
    pos = torch.zeros(3, b, s, dtype=torch.long)
    grids = {1: iter([tuple(int(x) for x in g) for g in (image_grid_thw.tolist() if image_grid_thw is not None
                                                          else [])]),
             2: iter(_frame_grids(video_grid_thw))}
    deltas = []
    for row in range(b):
        kinds = torch.zeros(s, dtype=torch.long)
        kinds[input_ids[row] == image_token_id] = 1
        kinds[input_ids[row] == video_token_id] = 2
        cur, start, parts = 0, 0, []
        for kind, run in itertools.groupby(kinds.tolist()):
            n = len(list(run))
            if kind == 0:
                parts.append(torch.arange(n).expand(3, -1) + cur)
                cur += n
            else:
                t, h, w = next(grids[kind], (0, 0, 0))
                gh, gw = h // merge, w // merge
                if t * gh * gw != n:
                    what = "image" if kind == 1 else "video frame"
                    raise ValueError(f"sample {row}: {n} {what} tokens at position {start} but its grid {(t, h, w)} "
                                     f"needs {t * gh * gw} (Qwen3-VL prompts hold one run per video frame)")
                hh = torch.arange(gh).view(-1, 1).expand(gh, gw).reshape(-1)
                ww = torch.arange(gw).view(1, -1).expand(gh, gw).reshape(-1)
                parts.append(torch.stack([torch.zeros_like(hh), hh, ww]) + cur)
                cur += max(h, w) // merge
            start += n
        row_pos = torch.cat(parts, dim=1)
        pos[:, row] = row_pos
        deltas.append(int(row_pos.max()) + 1 - s)
    return pos, torch.tensor(deltas, dtype=torch.long).view(b, 1)


def sequence_positions(cfg, input_ids, image_grid_thw, video_grid_thw, second_per_grid_ts=None):
    """`mrope_position_ids` of whole sequences with `cfg`'s token ids and merge size (`second_per_grid_ts`, the
    seam's argument, plays no part: a Qwen3-VL frame's time is in the prompt's timestamp text)."""
    return mrope_position_ids(input_ids, image_grid_thw, video_grid_thw, image_token_id=cfg.image_token_id,
                              video_token_id=cfg.video_token_id, merge=cfg.vision.spatial_merge_size)


def prompt_positions(cfg, prompt, extra_text: int = 0) -> torch.Tensor:
    """M-RoPE positions [3,1,P+extra_text] of a prompt (prefix.batch.Prompt) followed by `extra_text` text tokens."""
    ids = prompt.input_ids
    if extra_text:
        ids = torch.cat([ids, torch.zeros(extra_text, dtype=ids.dtype)])
    pos, _ = sequence_positions(cfg, ids[None], prompt.image_grid_thw, prompt.video_grid_thw)
    return pos


class VisionPlan(NamedTuple):
    """The Qwen3-VL tower's host index tensors for one set of grids (a function of the grids alone)."""

    cu_frames: torch.Tensor  # frame boundaries in patches: every block attends within a frame
    rotary_N: torch.Tensor  # 2D rotary angles [N, 1, 1, head_dim]
    interp_index_N4: torch.Tensor  # the 4 learned-table rows each patch's position embedding blends
    interp_weight_N4: torch.Tensor  # their bilinear weights


def pos_embed_interpolation(grid_thw: torch.Tensor, side: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear (align_corners) resampling of a side x side learned table to each grid: table rows [N,4] and
    weights [N,4], patches in the processor's merge-block order, repeated over frames."""
    idx, wts = [], []
    for t, h, w in grid_thw.tolist():
        hs, ws = torch.linspace(0, side - 1, h), torch.linspace(0, side - 1, w)
        h0, w0 = hs.long(), ws.long()
        h1, w1 = (h0 + 1).clamp(max=side - 1), (w0 + 1).clamp(max=side - 1)
        dh, dw = (hs - h0)[:, None], (ws - w0)[None, :]
        rows = [(h0, w0), (h0, w1), (h1, w0), (h1, w1)]
        ix = torch.stack([(a[:, None] * side + c[None, :]) for a, c in rows], -1)  # [h, w, 4]
        wt = torch.stack([(1 - dh) * (1 - dw), (1 - dh) * dw, dh * (1 - dw), dh * dw], -1)
        pos = vision_patch_positions(torch.tensor([[1, h, w]]), merge)  # merge-block order
        idx.append(ix[pos[:, 0], pos[:, 1]].repeat(t, 1))
        wts.append(wt[pos[:, 0], pos[:, 1]].repeat(t, 1))
    return torch.cat(idx), torch.cat(wts)


@functools.lru_cache(maxsize=16)
def _vision_plan(grids: tuple, merge: int, head_dim: int, theta: float, side: int) -> VisionPlan:
    with torch.inference_mode(False):  # kept tensors serve later callers with autograd on
        grid_thw = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
        rot = vision_rotary_freqs(vision_patch_positions(grid_thw, merge), head_dim, theta)
        index, weight = pos_embed_interpolation(grid_thw, side, merge)
        return VisionPlan(vision_cu_seqlens(grid_thw).long(), rot, index, weight)


def vision_plan(grid_thw: torch.Tensor, merge: int, head_dim: int, theta: float, side: int) -> VisionPlan:
    """The tower's frame boundaries, rotary angles and position-table blend for `grid_thw` (host [n, 3]), once per
    distinct set of grids; the tensors are shared between callers: read them, never write them."""
    return _vision_plan(tuple(map(tuple, grid_thw.tolist())), merge, head_dim, float(theta), side)
