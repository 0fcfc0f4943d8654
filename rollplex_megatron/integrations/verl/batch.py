"""verl's engine batches as Rollplex groups, and the per-sample outputs back in verl's layout.

verl (0.9.x, the engine API, `pad_mode=no_padding`) hands an engine one TensorDict per call: `input_ids` as a
jagged nested tensor of prompt + response per sample, `prompts` / `responses` (nested) for the boundary,
`uid` (one string per prompt: the rows of a GRPO group share it), `multi_modal_inputs` (one dict of the
processor's tensors per sample) and the loss inputs (`old_log_probs`, `advantages`, `response_mask`, ...).
Its outputs are nested tensors of the sample's full length, `log_probs[i][t]` being the log-prob of
`input_ids[i][t + 1]` (verl's label roll). Rows of one uid become one group when their prompts are equal bit
for bit (ids and every multimodal tensor); a uid whose rows differ is run as full sequences, one group per
row, and logged. The positions are the model family's (`positions.prompt`, as verl's own Megatron engine computes
them for a vision model); verl's `position_ids` (its agent loop's M-RoPE rows from the processor's
`get_rope_index`), when the batch holds them, are checked against them (`check_verl_positions`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from rollplex_megatron.config import ModelConfig
from rollplex_megatron.models.registry import model_spec
from rollplex_megatron.prefix.batch import Group, Prompt

log = logging.getLogger(__name__)

PROMPT_FIELDS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


@dataclass
class VerlGroups:
    """One verl batch as groups: `rows[g][r]` is the sample index of group g's response r."""

    groups: list[Group]
    rows: list[list[int]]
    full: list[int]  # groups run as full sequences (their uid's prompts differ)
    prompt_lens: list[int]  # per sample
    response_lens: list[int]  # per sample
    uids: list[str] | None = None  # per group: verl's uid of its rows

    @property
    def shared(self) -> list[int]:
        """Groups whose prefix runs once."""
        skip = set(self.full)
        return [g for g in range(len(self.groups)) if g not in skip]

    def sample(self, group: int, response: int) -> int:
        return self.rows[group][response]


def _rows(t: torch.Tensor, name: str) -> list[torch.Tensor]:
    if not (isinstance(t, torch.Tensor) and t.is_nested):
        raise ValueError(f"verl batch: `{name}` must be a jagged nested tensor (pad_mode=no_padding, verl's engine "
                         f"layout); got {type(t).__name__}")
    return list(t.unbind())


def _get(data, key: str, default=None):
    from verl.utils import tensordict_utils as tu

    return tu.get(data, key, default)


def sample_prompt(ids: torch.Tensor, mm: dict | None) -> Prompt:
    """The sample's prompt; of `multi_modal_inputs` only the processor outputs the model reads (verl adds
    bookkeeping keys such as `images_seqlens`, which the model does not take)."""
    mm = mm or {}
    return Prompt(ids, **{k: mm.get(k) for k in PROMPT_FIELDS})


def multi_modal_rows(data, n: int) -> list:
    """Each sample's `multi_modal_inputs` dict (None for all when the batch has none)."""
    mms = _get(data, "multi_modal_inputs")
    return [None] * n if mms is None else list(mms)


def same_prompt(a: Prompt, b: Prompt) -> bool:
    """Bit-for-bit equality of two prompts: ids and every processor tensor (dtype and shape included)."""
    for k in ("input_ids",) + PROMPT_FIELDS:
        x, y = getattr(a, k), getattr(b, k)
        if (x is None) != (y is None):
            return False
        if x is not None and (x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y)):
            return False
    return True


def verl_groups(data, share_prefix: bool = True) -> VerlGroups:
    """Group a verl engine batch by `uid`, in order of first appearance. `share_prefix=False`: every group runs
    as full sequences (the plain path the shared one is checked against)."""
    ids = _rows(data["input_ids"], "input_ids")
    responses = _rows(data["responses"], "responses")
    if len(responses) != len(ids):
        raise ValueError(f"verl batch: {len(ids)} input_ids rows but {len(responses)} responses rows")
    uids = _get(data, "uid")
    if uids is None:
        raise ValueError("verl batch: no `uid` key; the rollplex engine groups responses by verl's per-prompt uid "
                         "(set by verl's trainer; add one string per prompt to the batch)")
    uids = list(uids) if not isinstance(uids, str) else [uids]
    if len(uids) != len(ids):
        raise ValueError(f"verl batch: {len(ids)} samples but {len(uids)} uids")
    mms = multi_modal_rows(data, len(ids))
    prompts = data.get("prompts", None)
    r_lens = [int(r.numel()) for r in responses]
    p_lens = [int(x.numel()) - n for x, n in zip(ids, r_lens)]
    if prompts is not None and prompts.is_nested:
        want = prompts.offsets().diff().tolist()
        bad = next((i for i, (p, w) in enumerate(zip(p_lens, want)) if p != w), None)
        if bad is not None:
            raise ValueError(f"verl batch: sample {bad}: input_ids is {p_lens[bad] + r_lens[bad]} tokens but prompts "
                             f"+ responses are {want[bad]} + {r_lens[bad]}")
    for i, (p, n) in enumerate(zip(p_lens, r_lens)):
        if p < 2 or n < 1:
            raise ValueError(f"verl batch: sample {i}: prompt of {p} and response of {n} tokens; the engine needs a "
                             f"prompt of at least 2 tokens and a non-empty response")
    order: dict[str, list[int]] = {}
    for i, u in enumerate(uids):
        order.setdefault(str(u), []).append(i)
    groups, rows, full, group_uids = [], [], [], []
    for uid, members in order.items():
        ps_ = [sample_prompt(ids[i][:p_lens[i]], mms[i]) for i in members]
        if share_prefix and all(same_prompt(ps_[0], p) for p in ps_[1:]):
            groups.append(Group(ps_[0], [ids[i][p_lens[i]:] for i in members], torch.zeros(len(members))))
            rows.append(members)
            group_uids.append(uid)
            continue
        if share_prefix:
            log.warning("rollplex verl engine: uid %s: its %d rows do not share one prompt bit for bit; they run as "
                        "full sequences", uid, len(members))
        for i, p in zip(members, ps_):
            full.append(len(groups))
            groups.append(Group(p, [ids[i][p_lens[i]:]], torch.zeros(1)))
            rows.append([i])
            group_uids.append(uid)
    return VerlGroups(groups, rows, full, p_lens, r_lens, group_uids)


def position_rows(pos: torch.Tensor, lengths: list[int]) -> list[torch.Tensor] | None:
    """Each sample's verl position ids, [axes, lengths[i]], read from the jagged tensor's values and offsets with
    the samples' lengths (input_ids') as the authority; None for 1-D (text) positions. Raises ValueError when the
    tensor holds neither of verl's layouts."""
    # verl 0.9.1 hands two layouts of per-sample [k, S] rows: ragged over tokens (values [k, sum S]), and, when
    # every S is equal, ragged over the axes (values [B*k, S], rows of k): torch.nested.as_nested_tensor picks
    # that dim (TransferQueue's AsyncSimpleStorageManager._pack_field_values, verl's left_right_2_no_padding), and
    # verl's maybe_fix_3d_position_ids then sets _ragged_idx=2 on it, so unbind() splits S by [k] * B (verl
    # issue #7899). Neither unbind() nor _ragged_idx can be trusted; values, offsets and the lengths can.
    values, offsets = pos.values(), pos.offsets()
    if values.dim() != 2:
        return None
    starts = offsets[:-1].tolist()
    sizes = (offsets.diff() if pos.lengths() is None else pos.lengths()).tolist()
    if len(sizes) != len(lengths):
        raise ValueError(f"verl batch: {len(sizes)} position_ids rows but {len(lengths)} input_ids rows")
    ends = [a + n for a, n in zip(starts, sizes)]
    if sizes == lengths and max(ends, default=0) <= values.shape[1]:  # ragged over tokens
        return [values[:, a:b] for a, b in zip(starts, ends)]
    if (len(set(sizes)) == 1 and all(n == values.shape[1] for n in lengths)
            and max(ends, default=0) <= values.shape[0]):  # equal lengths, ragged over the axes
        return [values[a:b] for a, b in zip(starts, ends)]
    raise ValueError(f"verl batch: position_ids (values {tuple(values.shape)}, row sizes {sizes[:4]}) hold no "
                     f"[axes, tokens] row per sample for input_ids of lengths {lengths[:4]}; verl's position_ids "
                     f"must hold one row per sample, as long as its input_ids")


def check_verl_positions(data, vg: VerlGroups, cfg: ModelConfig) -> None:
    """verl's `position_ids` against the model family's positions of each group's first sample (prompt and
    response); a group's rows share the prompt, so its first stands for all. verl's rows are [4, S] (a text row,
    then the M-RoPE axes) or [3, S], in either of verl's layouts (`position_rows`); a batch without them, or with
    1-D text positions, is not checked (the engine computes its own either way). Raises ValueError naming the
    sample and the first differing token."""
    pos = data.get("position_ids", None)
    if pos is None or not pos.is_nested:
        return
    rows = position_rows(pos, [p + r for p, r in zip(vg.prompt_lens, vg.response_lens)])
    if rows is None or rows[0].shape[0] < 3:
        return
    spec = model_spec(cfg)
    for g, group in enumerate(vg.groups):
        i = vg.rows[g][0]
        theirs = rows[i]
        ours = spec.positions.prompt(cfg, group.prompt, vg.response_lens[i])[:, 0]
        theirs = theirs[-ours.shape[0]:].to(ours.device, ours.dtype)
        if theirs.shape != ours.shape or not torch.equal(theirs, ours):
            bad = (theirs != ours).any(0).nonzero() if theirs.shape == ours.shape else torch.zeros(1, 1)
            raise ValueError(f"verl batch: sample {i}: verl's position_ids differ from model.family={cfg.family}'s "
                             f"positions at token {int(bad[0, 0])} (shapes {tuple(theirs.shape)} vs "
                             f"{tuple(ours.shape)}); the processor verl loaded must be the checkpoint's "
                             f"(actor_rollout_ref.model.path)")


def loss_rows(data, samples: list[int]):
    """The batch's rows `samples` for verl's loss, without `position_ids` (the loss reads none, and verl's
    index_select_tensor_dict unbinds every nested tensor, which fails on the equal-length layout
    `position_rows` reads)."""
    from verl.utils import tensordict_utils as tu

    return tu.index_select_tensor_dict(data.exclude("position_ids"), samples)


def full_length(vg: VerlGroups, sample: int, response_values: torch.Tensor) -> torch.Tensor:
    """A per-response value vector [R] laid out as verl's model outputs: [P + R], the value of response token j
    at position P - 1 + j (the position that predicts it), zeros elsewhere."""
    p = vg.prompt_lens[sample]
    z = response_values.new_zeros
    return torch.cat([z(p - 1), response_values, z(1)])


def as_nested(rows: list[torch.Tensor]) -> torch.Tensor:
    """Per-sample tensors as one jagged nested tensor (verl's output format)."""
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)
