"""Pure tensor functions for Qwen2.5-VL positions, windows and masks.

Legend: N = vision patches (all images/videos packed), U = merge units (N / merge**2),
grid_thw = [num_items, 3] patch grid (t, h, w) per image or video, in patches.
"""
from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

import torch


def vision_patch_positions(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """[N,2] (row, col) of each patch, ordered merge-block by merge-block as the processor packs them."""
    out = []
    for t, h, w in grid_thw.tolist():
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        # [h/m, m, w/m, m] -> block-major [h/m, w/m, m, m]
        rows = rows.permute(0, 2, 1, 3).reshape(-1)
        cols = cols.permute(0, 2, 1, 3).reshape(-1)
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out, dim=0)


def vision_rotary_freqs(positions_N2: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """[N,1,1,head_dim] angles for megatron's rotate-half RoPE: (row freqs | col freqs) twice."""
    quarter = head_dim // 4
    inv_freq = 1.0 / (theta ** (torch.arange(0, quarter, dtype=torch.float32) * 2 / (head_dim // 2)))
    angles = positions_N2.float()[..., None] * inv_freq  # [N, 2, head_dim/4]
    half = angles.flatten(1)  # [N, head_dim/2] = rows then cols
    return torch.cat([half, half], dim=-1)[:, None, None, :]


def vision_cu_seqlens(grid_thw: torch.Tensor) -> torch.Tensor:
    """Cumulative patch counts per frame: full attention never crosses a temporal patch."""
    per_frame = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
    return torch.cat([per_frame.new_zeros(1), per_frame.cumsum(0)])


def vision_window_order(
    grid_thw: torch.Tensor, merge: int, window_size: int, patch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Window permutation of merge units and window boundaries in patches.

    Returns `order_U` (merge-unit indices, window by window, row-major inside each window) and
    `cu_window_N` (cumulative patch counts per non-empty window).
    """
    win = window_size // merge // patch_size  # window side in merge units
    unit = merge * merge
    order, sizes, base = [], [], 0
    for t, h, w in grid_thw.tolist():
        gh, gw = h // merge, w // merge
        idx = torch.arange(t * gh * gw).view(t, gh, gw)
        for ti, wr, wc in itertools.product(range(t), range(-(-gh // win)), range(-(-gw // win))):
            block = idx[ti, wr * win:(wr + 1) * win, wc * win:(wc + 1) * win].reshape(-1)
            order.append(block + base)
            sizes.append(block.numel() * unit)
        base += t * gh * gw
    order_U = torch.cat(order)
    cu = torch.tensor([0] + list(itertools.accumulate(sizes)), dtype=torch.long)
    return order_U, torch.unique_consecutive(cu)


class VisionPlan(NamedTuple):
    """The vision tower's index tensors for one set of grids, on the host (a function of the grids alone)."""

    order_N: torch.Tensor  # patch permutation into window order
    inverse_U: torch.Tensor  # merge units back from window order to the processor's order
    cu_full: torch.Tensor  # frame boundaries in patches (full-attention blocks)
    cu_window: torch.Tensor  # window boundaries in patches (window-attention blocks)
    rotary_N: torch.Tensor  # rotary angles [N, 1, 1, head_dim / 2 * 2] in window order


@functools.lru_cache(maxsize=16)
def _vision_plan(grids: tuple, merge: int, window_size: int, patch_size: int, head_dim: int,
                 theta: float) -> VisionPlan:
    with torch.inference_mode(False):  # kept tensors serve later callers with autograd on (an index is saved)
        grid_thw = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
        order_U, cu_window = vision_window_order(grid_thw, merge, window_size, patch_size)
        order_N = units_to_patches(order_U, merge * merge)
        rot = vision_rotary_freqs(vision_patch_positions(grid_thw, merge), head_dim, theta)[order_N]
        return VisionPlan(order_N, torch.argsort(order_U), vision_cu_seqlens(grid_thw).long(), cu_window.long(), rot)


def vision_plan(grid_thw: torch.Tensor, merge: int, window_size: int, patch_size: int, head_dim: int,
                theta: float) -> VisionPlan:
    """The tower's window order, segment boundaries and rotary angles for `grid_thw` (host [n, 3]), computed once
    per distinct set of grids and kept (a run sees few: a pack of 16 video prompts costs the host about 40 ms to
    plan, on every prefix stage, scoring pass and recomputation that runs the tower). The tensors are shared
    between callers: read them, never write them."""
    return _vision_plan(tuple(map(tuple, grid_thw.tolist())), merge, window_size, patch_size, head_dim, float(theta))


def block_diagonal_mask(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[1,1,N,N] bool in megatron's convention (True = masked) for segments given by cu_seqlens."""
    n = int(cu_seqlens[-1])
    seg = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1), cu_seqlens.diff())
    assert seg.numel() == n
    return (seg[:, None] != seg[None, :])[None, None]


def units_to_patches(order_U: torch.Tensor, unit: int) -> torch.Tensor:
    """Expand a merge-unit permutation into a patch permutation."""
    return (order_U[:, None] * unit + torch.arange(unit)).reshape(-1)


def mrope_position_ids(
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
    second_per_grid_ts: torch.Tensor | None,
    *,
    image_token_id: int,
    video_token_id: int,
    merge: int,
    tokens_per_second: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE position ids [3,B,S] and deltas [B,1] for unpadded prompts, as Qwen2.5-VL computes them.

    Text runs count up by one on all three axes. An image or video run takes (t, h, w) grid
    positions offset by the running position; video time is scaled by
    `tokens_per_second * second_per_grid_t`. After a vision run the running position advances by
    max(h, w) / merge (the convention of transformers' Qwen2.5-VL `get_rope_index` as pinned).
    Images and videos are consumed in order across the batch.
    """
    b, s = input_ids.shape
    pos = torch.zeros(3, b, s, dtype=torch.long)
    grids = {1: iter(image_grid_thw if image_grid_thw is not None else []),
             2: iter(video_grid_thw if video_grid_thw is not None else [])}
    secs = iter(second_per_grid_ts.tolist() if second_per_grid_ts is not None else [])
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
                t, h, w = (int(x) for x in next(grids[kind]))
                step = tokens_per_second * next(secs, 1.0) if kind == 2 else 1
                gt, gh, gw = t, h // merge, w // merge
                if gt * gh * gw != n:
                    raise ValueError(
                        f"sample {row}: {n} {'image' if kind == 1 else 'video'} tokens at position "
                        f"{start} but the grid {(t, h, w)} needs {gt * gh * gw}"
                    )
                tt = (torch.arange(gt) * step).long().view(-1, 1, 1).expand(gt, gh, gw)
                hh = torch.arange(gh).view(1, -1, 1).expand(gt, gh, gw)
                ww = torch.arange(gw).view(1, 1, -1).expand(gt, gh, gw)
                parts.append(torch.stack([tt, hh, ww]).reshape(3, -1) + cur)
                cur += max(h, w) // merge
            start += n
        row_pos = torch.cat(parts, dim=1)
        pos[:, row] = row_pos
        deltas.append(int(row_pos.max()) + 1 - s)
    return pos, torch.tensor(deltas, dtype=torch.long).view(b, 1)


def prompt_positions(cfg, prompt, extra_text: int = 0) -> torch.Tensor:
    """M-RoPE positions [3,1,P+extra_text] of a prompt (prefix.batch.Prompt) followed by `extra_text`
    text tokens; `cfg` is the ModelConfig (special token ids, merge size, tokens per second)."""
    ids = prompt.input_ids
    if extra_text:
        ids = torch.cat([ids, torch.zeros(extra_text, dtype=ids.dtype)])
    pos, _ = mrope_position_ids(ids[None], prompt.image_grid_thw, prompt.video_grid_thw,
                                prompt.second_per_grid_ts, image_token_id=cfg.image_token_id,
                                video_token_id=cfg.video_token_id, merge=cfg.vision.spatial_merge_size,
                                tokens_per_second=cfg.vision.tokens_per_second)
    return pos


def sequence_positions(cfg, input_ids, image_grid_thw, video_grid_thw, second_per_grid_ts):
    """`mrope_position_ids` of whole sequences with the token ids, merge size and tokens per second of `cfg`."""
    return mrope_position_ids(input_ids, image_grid_thw, video_grid_thw, second_per_grid_ts,
                              image_token_id=cfg.image_token_id, video_token_id=cfg.video_token_id,
                              merge=cfg.vision.spatial_merge_size, tokens_per_second=cfg.vision.tokens_per_second)


def response_positions(last_311: torch.Tensor, n: int) -> torch.Tensor:
    """[3,1,n] positions of n text tokens after a prompt whose last position is `last_311`: every axis counts up."""
    return last_311 + torch.arange(n).view(1, 1, n)


def decode_positions(last_n3: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """[3,n,1] positions of decode step `step` ([1], 0 = the first new token's input) after prompts ending at
    `last_n3`; device tensors in, no host read (a captured decode step replays it)."""
    return (last_n3 + step).T[:, :, None]
