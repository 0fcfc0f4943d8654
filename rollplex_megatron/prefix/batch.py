"""Rollout batches (groups of responses to one prompt) and their packed micro-batches.

Legend: P = prompt tokens, R = response tokens, T = packed tokens of one micro-batch (B=1).
Prefix = prompt[:-1]. The response stage input of a response is [prompt[-1], response[:-1]] with
labels `response`; the full-sequence input is [prompt, response[:-1]] with the same labels at its
last R positions. Both micro-batch kinds carry the same responses in the same order, so their
per-token log-probs line up one to one.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch

from rollplex_megatron.attention.prefix import PackedLayout
from rollplex_megatron.config import ModelConfig
from rollplex_megatron.models.registry import model_spec


@dataclass
class Prompt:
    """One prompt with its images and videos (the processor's tensors)."""

    input_ids: torch.Tensor  # [P] long
    pixel_values: torch.Tensor | None = None  # [N_img, C*T*p*p]
    image_grid_thw: torch.Tensor | None = None  # [n_images, 3]
    pixel_values_videos: torch.Tensor | None = None  # [N_vid, C*T*p*p]
    video_grid_thw: torch.Tensor | None = None  # [n_videos, 3]
    second_per_grid_ts: torch.Tensor | None = None  # [n_videos]

    def to(self, device) -> "Prompt":
        """A copy with every tensor on `device`."""
        return Prompt(*(t.to(device) if torch.is_tensor(t) else t for t in (
            self.input_ids, self.pixel_values, self.image_grid_thw, self.pixel_values_videos, self.video_grid_thw,
            self.second_per_grid_ts)))


@dataclass
class Group:
    """A GRPO group: G responses sampled for one prompt, with their advantages."""

    prompt: Prompt
    responses: list[torch.Tensor]  # G tensors [R_i] long
    advantages: torch.Tensor  # [G] float


@dataclass
class MicroBatch:
    """One packed micro-batch (B=1) for megatron's schedule."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [3, 1, T]
    labels: torch.Tensor  # [1, T] (0 where no loss)
    weight: torch.Tensor  # [1, T] loss weight: advantage / global token count (0 where no loss)
    label_mask: torch.Tensor  # [1, T] bool, True on response-token predictions
    layout: PackedLayout
    vision: dict = field(default_factory=dict)  # pixel inputs (full-sequence micro-batches only)
    responses: list[tuple[int, int]] = field(default_factory=list)  # (group, response) in order
    token_data: dict = field(default_factory=dict)  # per-token [1, T] tensors for losses (see attach_token_data)
    # [n] long: the flat positions where label_mask is True, found on the host where the mask is built
    # (None for a mask built on a device). The losses select with it (`rl.grpo.rows_at(t, mb.label_at)`):
    # indexing by a mask on CUDA waits for the device to count the positions.
    label_index: torch.Tensor | None = None

    def __post_init__(self):
        if self.label_index is None and self.label_mask.device.type == "cpu":
            self.label_index = self.label_mask.reshape(-1).nonzero().squeeze(1)

    @property
    def label_at(self) -> torch.Tensor:
        """The loss positions for `rl.grpo.rows_at`: `label_index`, else `label_mask`."""
        return self.label_mask if self.label_index is None else self.label_index

    def to(self, device) -> "MicroBatch":
        """A copy on `device` (layout and pixels included)."""
        mv = lambda t: t.to(device) if torch.is_tensor(t) else t  # noqa: E731
        lay = self.layout
        return MicroBatch(mv(self.input_ids), mv(self.position_ids), mv(self.labels), mv(self.weight),
                          mv(self.label_mask),
                          PackedLayout(mv(lay.seg_T), mv(lay.pos_T), mv(lay.group_T), lay.prefix_groups,
                                       lay.prefix_lens, lay.seg_lens, lay.seg_groups),
                          {k: mv(v) for k, v in self.vision.items()}, self.responses,
                          {k: mv(v) for k, v in self.token_data.items()}, mv(self.label_index))


def validate_groups(cfg: ModelConfig, groups: list[Group], max_response_len: int) -> None:
    """Bad input fails here, naming the group and response, before any model work."""
    vision_ids = {cfg.image_token_id, cfg.video_token_id}
    for gi, g in enumerate(groups):
        ids = g.prompt.input_ids
        if ids.dim() != 1 or ids.numel() < 2:
            raise ValueError(f"group {gi}: prompt must be a 1-D tensor of at least 2 tokens")
        if int(ids[-1]) in vision_ids:
            raise ValueError(f"group {gi}: the prompt's last token is a vision placeholder; prompts end in text")
        if len(g.advantages) != len(g.responses):
            raise ValueError(f"group {gi}: {len(g.responses)} responses but {len(g.advantages)} advantages")
        for ri, r in enumerate(g.responses):
            if r.numel() == 0:
                raise ValueError(f"group {gi} response {ri}: empty response (drop it or give it one token)")
            if r.numel() > max_response_len:
                raise ValueError(f"group {gi} response {ri}: {r.numel()} tokens exceed "
                                 f"rollout.max_response_len={max_response_len}")
            bad = [int(t) for t in r if int(t) in vision_ids]
            if bad:
                raise ValueError(f"group {gi} response {ri}: contains vision placeholder token(s) {bad[:3]}")


def check_group_prompts(groups: list[Group], group_ids: list[list[int]]) -> None:
    """Responses declared as one group must share one prompt (same tokens)."""
    for members in group_ids:
        first = groups[members[0]].prompt.input_ids
        for m in members[1:]:
            if not torch.equal(groups[m].prompt.input_ids, first):
                raise ValueError(f"samples {members[0]} and {m} are in one group but have different prompts")


def pack_responses(lens: list[int], per_mb: int, max_tokens: int = 0) -> list[list[int]]:
    """Consecutive runs of response indices, one per micro-batch, in order: `per_mb` responses each, or
    with `max_tokens` > 0 (the count then ignored) as many as fit `max_tokens` response tokens, filled
    greedily; a response longer than the budget goes alone."""
    if max_tokens <= 0:
        return [list(range(i, min(i + per_mb, len(lens)))) for i in range(0, len(lens), per_mb)]
    out: list[list[int]] = []
    used = 0
    for i, n in enumerate(lens):
        if not out or used + n > max_tokens:
            out.append([])
            used = 0
        out[-1].append(i)
        used += n
    return out


def _check_packing(who: str, groups: list[Group], per_mb: int, total_tokens: int, select: list[int] | None,
                   max_tokens: int) -> None:
    """A micro-batch builder's arguments, each refusal naming the argument (the builders are public: api.py)."""
    if max_tokens <= 0 and (isinstance(per_mb, bool) or not isinstance(per_mb, int) or per_mb < 1):
        raise ValueError(f"{who}: per_mb={per_mb!r}; give the responses a micro-batch holds, an int >= 1")
    if not total_tokens > 0:
        raise ValueError(f"{who}: total_tokens={total_tokens!r}; give the loss's normaliser, the response tokens "
                         f"over every rank (> 0)")
    if select is not None:
        def index(i) -> int:  # an int, numpy's or a 0-d integer tensor; -1 where it is none
            try:
                return operator.index(i)
            except TypeError:
                return -1
        picked = [index(i) for i in select]
        if any(not 0 <= i < len(groups) for i in picked) or len(set(picked)) != len(picked):
            raise ValueError(f"{who}: select={list(select)} must name distinct groups in 0..{len(groups) - 1}")


def _chunks(groups: list[Group], per_mb: int, select: list[int] | None,
            max_tokens: int = 0) -> list[list[tuple[int, int]]]:
    ids = range(len(groups)) if select is None else select
    flat = [(gi, ri) for gi in ids for ri in range(len(groups[gi].responses))]
    lens = [groups[gi].responses[ri].numel() for gi, ri in flat]
    return [[flat[i] for i in run] for run in pack_responses(lens, per_mb, max_tokens)]


def prompt_positions(cfg: ModelConfig, prompt: Prompt, extra_text: int = 0) -> torch.Tensor:
    """Rotary positions [R,1,P+extra_text] of a prompt followed by `extra_text` text tokens (its family's ids)."""
    return model_spec(cfg).positions.prompt(cfg, prompt, extra_text)


def response_micro_batches(
cfg: ModelConfig, groups: list[Group], per_mb: int, total_tokens: int,
                           position_offset: int = 0, select: list[int] | None = None,
                           max_tokens: int = 0) -> list[MicroBatch]:
    """Response-stage micro-batches: [prompt[-1], response[:-1]] packed, positions after the prefix.

    `select`: only these groups' responses (a PPO mini-batch), still named by their index in `groups`.
    `max_tokens` > 0: packed up to that many response tokens instead of `per_mb` responses (`pack_responses`).
    `position_offset` exists only for mutation tests (a wrong offset must be detected).
    """
    _check_packing("response_micro_batches", groups, per_mb, total_tokens, select, max_tokens)
    ids = range(len(groups)) if select is None else select
    positions = model_spec(cfg).positions
    last_pos = {gi: positions.prompt(cfg, groups[gi].prompt)[:, :, -1:] for gi in ids}  # [3,1,1]
    out = []
    for members in _chunks(groups, per_mb, select, max_tokens):
        ids, pos, lab, w, seg, p, grp = [], [], [], [], [], [], []
        for s, (gi, ri) in enumerate(members):
            r = groups[gi].responses[ri]
            n = r.numel()
            ids.append(torch.cat([groups[gi].prompt.input_ids[-1:], r[:-1]]))
            pos.append(positions.response(last_pos[gi] + position_offset, n))
            lab.append(r)
            w.append(torch.full((n,), float(groups[gi].advantages[ri]) / total_tokens))
            seg.append(torch.full((n,), s))
            p.append(torch.arange(n))
            grp.append(torch.full((n,), gi))
        present = sorted({gi for gi, _ in members})
        layout = PackedLayout(torch.cat(seg), torch.cat(p), torch.cat(grp), present,
                              [groups[g].prompt.input_ids.numel() - 1 for g in present],
                              [x.numel() for x in ids], [gi for gi, _ in members])
        t = sum(x.numel() for x in ids)
        out.append(MicroBatch(torch.cat(ids)[None], torch.cat(pos, dim=2), torch.cat(lab)[None],
                              torch.cat(w)[None], torch.ones(1, t, dtype=torch.bool), layout,
                              responses=list(members)))
    return out


def full_micro_batches(cfg: ModelConfig, groups: list[Group], per_mb: int, total_tokens: int,
                       select: list[int] | None = None, max_tokens: int = 0) -> list[MicroBatch]:
    """Full-sequence micro-batches: each response with its whole prompt (the serial baseline);
    `select` and `max_tokens` as in `response_micro_batches` (the budget counts response tokens only, so
    both kinds hold the same responses)."""
    _check_packing("full_micro_batches", groups, per_mb, total_tokens, select, max_tokens)
    out = []
    for members in _chunks(groups, per_mb, select, max_tokens):
        ids, pos, lab, w, msk, seg, p = [], [], [], [], [], [], []
        vis: dict[str, list] = {}
        for s, (gi, ri) in enumerate(members):
            g, r = groups[gi], groups[gi].responses[ri]
            n_p, n = g.prompt.input_ids.numel(), r.numel()
            seq = torch.cat([g.prompt.input_ids, r[:-1]])
            full_pos, _ = model_spec(cfg).positions.sequence(cfg, seq[None], g.prompt.image_grid_thw,
                                                             g.prompt.video_grid_thw, g.prompt.second_per_grid_ts)
            ids.append(seq)
            pos.append(full_pos)
            lab.append(torch.cat([torch.zeros(n_p - 1, dtype=r.dtype), r]))
            w.append(torch.cat([torch.zeros(n_p - 1), torch.full((n,), float(g.advantages[ri]) / total_tokens)]))
            msk.append(torch.cat([torch.zeros(n_p - 1, dtype=torch.bool), torch.ones(n, dtype=torch.bool)]))
            seg.append(torch.full((seq.numel(),), s))
            p.append(torch.arange(seq.numel()))
            for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
                if getattr(g.prompt, k) is not None:
                    vis.setdefault(k, []).append(getattr(g.prompt, k))
        t = sum(x.numel() for x in ids)
        layout = PackedLayout(torch.cat(seg), torch.cat(p), torch.full((t,), -1), seg_lens=[x.numel() for x in ids],
                              seg_groups=[-1] * len(ids))
        out.append(MicroBatch(torch.cat(ids)[None], torch.cat(pos, dim=2), torch.cat(lab)[None],
                              torch.cat(w)[None], torch.cat(msk)[None], layout,
                              {k: torch.cat(v) for k, v in vis.items()}, list(members)))
    return out


def attach_token_data(mbs: list[MicroBatch], name: str, per_response: dict | None) -> None:
    """Lay per-response values ({(group, response): [R]}) on each micro-batch's loss positions.

    None (a pipeline stage before the last, which computes no log-probs and no loss): nothing."""
    if per_response is None:
        return
    for mb in mbs:
        vals = torch.cat([per_response[key].float().cpu() for key in mb.responses])
        out = torch.zeros(mb.label_mask.shape, dtype=torch.float32)
        out[mb.label_mask] = vals
        mb.token_data[name] = out


def split_token_values(results: list[dict], mbs: list[MicroBatch], groups: list[Group], key: str = "logp") -> dict:
    """Per-response tensors {(group, response): [R]} from per-micro-batch flat loss-position values."""
    out = {}
    for res, mb in zip(results, mbs):
        lens = [groups[g].responses[r].numel() for g, r in mb.responses]
        for k, part in zip(mb.responses, torch.split(res[key].float().cpu(), lens)):
            out[k] = part
    return out
