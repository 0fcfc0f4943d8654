"""verl issue #7899, fixed where verl has it: a layout-checking `maybe_fix_3d_position_ids`, installed by the
plugin (`plugin.py`) in every verl process when the installed verl's own one breaks an equal-length batch.

verl's v1 workers get per-sample M-RoPE `position_ids` [C, S_i] as one jagged nested tensor [B, C, *S]. Two
layouts reach them: ragged over the tokens (values [C, sum S_i], offsets 0, S_1, ...; `_ragged_idx` 2, or 1 after a
TensorDict consolidate + pickle), which verl's fix relabels correctly; and, when every S_i is one S, ragged over
the axes (torch's `as_nested_tensor` in TransferQueue's `_pack_field_values`: values [B*C, S], offsets 0, C, 2C,
...), which verl 0.9.1's fix relabels `_ragged_idx = 2` all the same, so `unbind` (its index_select_tensor_dict,
chunk_tensordict, make_iterator) splits S by [C] * B and the actor update fails (or chunk_tensordict's fallback
reads [C, C] rows of wrong numbers). The fix here rebuilds that layout ragged over the tokens once, at verl's own
call (infer_batch, train_batch, train_mini_batch), so every later verl function reads it right; any other layout
gets verl's fix unchanged. Upstream: verl PR #7901 (open) normalises the same way and also fixes the writers.

Legend: B samples, C position axes (4: text + M-RoPE, or 3), S tokens a sample, T = B * S.
"""
from __future__ import annotations

import logging
import sys
from collections.abc import Callable

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu

log = logging.getLogger(__name__)
ISSUE = "verl issue #7899"
_installed: Callable | None = None  # the layout-checking replacement, once install() has put it in place


def axes_ragged(pos: torch.Tensor, lengths: list[int] | None = None) -> bool:
    """Whether jagged [B, C, *S] position ids hold their rows ragged over the axes (values [B*C, S], offsets
    0, C, 2C, ...); `lengths`: the samples' token counts (the input_ids'), where known."""
    values, offsets = pos.values(), pos.offsets()
    if values.dim() != 2 or pos.lengths() is not None or offsets.numel() < 2:
        return False
    steps = offsets.diff()
    if int(offsets[-1]) != values.shape[0] or not bool((steps == steps[0]).all()):
        return False
    if lengths is not None:
        return all(n == values.shape[1] for n in lengths)
    # values [T, T] with equal steps read both ways; ragged over the tokens it would mean as many tokens in the
    # whole batch as position axes, so a tensor labelled ragged at dim 1 (torch's own label) is taken as the axes
    return pos._ragged_idx == 1 or int(offsets[-1]) != values.shape[1]


def tokens_ragged(pos: torch.Tensor) -> torch.Tensor:
    """Position ids ragged over the axes (`axes_ragged`) as the same [C, S] rows ragged over the tokens: values
    [C, T], offsets 0, S, 2S, ..., ragged dim 2, the layout verl's readers take."""
    values_BCxS, offsets = pos.values(), pos.offsets()
    b, s = offsets.numel() - 1, values_BCxS.shape[1]
    values_BCS = values_BCxS.reshape(b, -1, s)
    values_CT = values_BCS.transpose(0, 1).reshape(values_BCS.shape[1], b * s)
    offsets = torch.arange(b + 1, dtype=offsets.dtype, device=offsets.device) * s
    return torch.nested.nested_tensor_from_jagged(values_CT, offsets, jagged_dim=2)


def layout_checked(verl_fix: Callable[[TensorDict], None]) -> Callable[[TensorDict], None]:
    """verl's `maybe_fix_3d_position_ids` (`verl_fix`) behind a layout check: position ids ragged over the axes are
    rebuilt ragged over the tokens; any other batch goes to `verl_fix` as before."""
    def maybe_fix_3d_position_ids(data: TensorDict) -> None:
        pos = data.get("position_ids", None)
        if isinstance(pos, torch.Tensor) and pos.is_nested and pos.dim() == 3:
            ids = data.get("input_ids", None)
            lengths = ids.offsets().diff().tolist() if isinstance(ids, torch.Tensor) and ids.is_nested else None
            if axes_ragged(pos, lengths):
                data["position_ids"] = tokens_ragged(pos)
                return
        verl_fix(data)

    maybe_fix_3d_position_ids.__wrapped__ = verl_fix
    maybe_fix_3d_position_ids.__doc__ = f"verl's fix of 3-D position ids, checking the layout first ({ISSUE})."
    return maybe_fix_3d_position_ids


def mislabels_equal_lengths(fix: Callable[[TensorDict], None]) -> bool:
    """Whether `fix` (a `maybe_fix_3d_position_ids`) leaves TransferQueue's packing of two equal-length [4, 3] rows
    unreadable or reading other rows."""
    rows = [torch.arange(12).view(4, 3), torch.arange(12, 24).view(4, 3)]
    data = TensorDict({"position_ids": torch.nested.as_nested_tensor(rows, layout=torch.jagged)}, batch_size=2)
    fix(data)
    try:
        got = data["position_ids"].unbind()
    except RuntimeError:
        return True
    return len(got) != len(rows) or not all(a.shape == r.shape and torch.equal(a, r) for a, r in zip(got, rows))


def install() -> bool:
    """Put the layout-checking fix in place of verl's, under every name verl's callers import it by, when the
    installed verl's own fix mislabels an equal-length batch (checked by behaviour, so a verl that fixed it, whatever
    its version, keeps its own); True when installed now."""
    global _installed
    verl_fix = tu.maybe_fix_3d_position_ids
    if verl_fix is _installed or not mislabels_equal_lengths(verl_fix):
        return False
    fixed = layout_checked(verl_fix)
    # callers bind the name at import (`from verl.utils.tensordict_utils import maybe_fix_3d_position_ids`): those
    # imported already get it here, those imported later read it from tensordict_utils
    for module in [m for name, m in list(sys.modules.items()) if name.split(".")[0] == "verl"]:
        if getattr(module, "maybe_fix_3d_position_ids", None) is verl_fix:
            module.maybe_fix_3d_position_ids = fixed
    _installed = fixed
    log.warning("rollplex verl plugin: verl's maybe_fix_3d_position_ids mislabels the position ids of a batch whose "
                "samples have one length (%s); replaced by one that checks the layout first", ISSUE)
    return True

