"""verl's M-RoPE `position_ids` as the rollplex engine reads them (`batch.position_rows`, `check_verl_positions`,
`loss_rows`), in the layouts verl 0.9.1's v1 driver hands an engine, built with verl's and TransferQueue's own code;
and the plugin's fix of verl issue #7899 (`positions.py`) that makes verl's own readers take them.

A worker's batch comes from TransferQueue (`AsyncSimpleStorageManager._pack_field_values`: torch's
`as_nested_tensor` of the per-sample [4, S] rows), then verl's `maybe_fix_3d_position_ids` (its `infer_batch`,
`train_batch`, `train_mini_batch`). When every sample has one length, torch makes the axes the ragged dim and
verl 0.9.1's fix relabels it, so `unbind()` fails (verl issue #7899): the driver crashed in the actor update. The
plugin replaces that fix by one that rebuilds the layout ragged over the tokens; the engine-side tests below run
verl's own fix (`VERL_FIX`), the layouts an engine gets from a verl without the plugin's.
An update's mini-batches come from verl's `index_select_tensor_dict` (`nested_tensor_from_tensor_list`,
`ragged_idx=2`). Each layout, equal and ragged lengths: the rows read are the stored ones, the check passes, and a
position moved by one (mutation) is refused at its sample.
"""
import pickle
import sys

import pytest
import torch
from tensordict import TensorDict
from transfer_queue.storage.managers.simple_storage_manager import AsyncSimpleStorageManager
from verl.utils import tensordict_utils as tu

from rollplex_megatron.integrations.verl import positions
from rollplex_megatron.integrations.verl.batch import (check_verl_positions, loss_rows, position_rows,
                                                       verl_groups)
from rollplex_megatron.models.registry import model_spec
from rollplex_megatron.prefix.batch import Prompt
from rollplex_megatron.recipes import load_run_config
from rollplex_megatron.verify.parity import synthetic_inputs

# verl 0.9.1's own fix, which the plugin (loaded by `import verl`) replaced
VERL_FIX = tu.maybe_fix_3d_position_ids.__wrapped__
MM = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


@pytest.fixture(scope="module")
def cfg():
    return load_run_config([]).model


def samples(cfg, response_lens: list[int], g: int = 2) -> list[dict]:
    """Per-sample dicts as verl's agent loop stores them: groups of `g` rows sharing an image + video prompt (all
    prompts one length), and verl's [4, S] positions (a text row, then the family's M-RoPE rows)."""
    spec, gen = model_spec(cfg), torch.Generator().manual_seed(0)
    rows = []
    for i, n in enumerate(response_lens):
        x = synthetic_inputs(cfg, 10 + i // g, 1, (1, 4, 4), (2, 4, 4), 6)
        mm = {k: x[k] for k in MM}
        prompt = x["input_ids"][0]
        resp = torch.randint(0, 100, (n,), generator=gen)
        mrope = spec.positions.prompt(cfg, Prompt(prompt, **mm), n)[:, 0]
        rows.append({"prompts": prompt, "responses": resp, "input_ids": torch.cat([prompt, resp]),
                     "loss_mask": torch.ones(n, dtype=torch.int64), "multi_modal_inputs": mm,
                     "uid": f"prompt-{i // g}",
                     "position_ids": torch.cat([torch.arange(prompt.numel() + n)[None], mrope])})
    return rows


def packed(rows: list[dict]) -> TensorDict:
    """The batch a worker gets from TransferQueue, before verl's `maybe_fix_3d_position_ids`."""
    pack = AsyncSimpleStorageManager._pack_field_values
    return TensorDict({k: pack([r[k] for r in rows]) for k in rows[0]}, batch_size=len(rows))


def stored(rows: list[dict]) -> TensorDict:
    """The batch a worker gets from TransferQueue, after verl 0.9.1's own `maybe_fix_3d_position_ids`."""
    data = packed(rows)
    VERL_FIX(data)
    return data


def selected(rows: list[dict]) -> TensorDict:
    """An update's mini-batch: verl's `index_select_tensor_dict` rebuild of the positions, after its fix."""
    data = stored(rows)
    pos = [r["position_ids"] for r in rows]
    data["position_ids"] = tu.nested_tensor_from_tensor_list(pos, ragged_idx=2)
    VERL_FIX(data)
    return data


@pytest.mark.parametrize("build", [stored, selected])
@pytest.mark.parametrize("response_lens", [[3, 3, 3, 3], [2, 5, 3, 4]], ids=["equal", "ragged"])
def test_verl_positions_are_read_and_checked_in_every_layout(cfg, build, response_lens):
    rows = samples(cfg, response_lens)
    data = build(rows)
    if build is stored and len(set(response_lens)) == 1:  # the layout the driver crashed on
        with pytest.raises(RuntimeError):
            data["position_ids"].unbind()
    vg = verl_groups(data)
    assert [len(r) for r in vg.rows] == [2, 2] and not vg.full
    got = position_rows(data["position_ids"], [p + r for p, r in zip(vg.prompt_lens, vg.response_lens)])
    assert len(got) == len(rows) and all(torch.equal(a, r["position_ids"]) for a, r in zip(got, rows))
    check_verl_positions(data, vg, cfg)
    # mutation: one M-RoPE position of the second group's first sample moved; the check must see it
    rows[2]["position_ids"] = rows[2]["position_ids"].clone()
    rows[2]["position_ids"][2, 5] += 1
    with pytest.raises(ValueError, match="sample 2: verl's position_ids differ .* at token 5"):
        check_verl_positions(build(rows), vg, cfg)


def test_the_loss_selects_rows_of_an_equal_length_batch(cfg):
    """verl's loss gets its micro-batch's rows (verl's index_select, which unbinds every nested tensor) without the
    positions it does not read."""
    rows = samples(cfg, [3, 3, 3, 3])
    sel = loss_rows(stored(rows), [1, 2])
    assert "position_ids" not in sel.keys() and sel.batch_size == torch.Size([2])
    assert torch.equal(sel["loss_mask"].values(), torch.ones(6, dtype=torch.int64))


def test_positions_that_fit_no_layout_are_refused(cfg):
    """verl's `chunk_tensordict` falls back to `to_padded_tensor` when unbind fails, and on the mislabelled
    equal-length tensor that yields [4, 4] rows of the wrong numbers: refused, not read."""
    data = stored(samples(cfg, [3, 3, 3, 3]))
    data["position_ids"] = tu.chunk_tensordict(data.select("position_ids"), 1)[0]["position_ids"]
    with pytest.raises(ValueError, match=r"position_ids \(values \(4, 16\).* hold no \[axes, tokens\] row"):
        check_verl_positions(data, verl_groups(data), cfg)


def test_the_plugin_replaced_verls_fix_under_every_callers_name():
    """`import verl` loaded the plugin, which found verl 0.9.1's fix mislabelling an equal-length batch (a probe on
    a tiny one) and put the layout-checking one under the names verl's callers import; a second install is a no-op,
    and a verl whose own fix reads the batch right (the fixed one standing in for it) keeps its own."""
    import verl.workers.engine.base  # noqa: F401 (the callers: infer_batch, train_batch; train_mini_batch)
    import verl.workers.engine_workers  # noqa: F401

    fixed = tu.maybe_fix_3d_position_ids
    assert positions.mislabels_equal_lengths(VERL_FIX) and not positions.mislabels_equal_lengths(fixed)
    for name in ("verl.utils.tensordict_utils", "verl.workers.engine.base", "verl.workers.engine_workers"):
        assert sys.modules[name].maybe_fix_3d_position_ids is fixed, name
    assert not positions.install() and tu.maybe_fix_3d_position_ids is fixed


def through_verl(data: TensorDict, fix) -> list[list[torch.Tensor]]:
    """The position rows verl's readers give after `fix`: `index_select_tensor_dict` of samples 2, 0, 3, both
    halves of `chunk_tensordict`, and the batch after a consolidate + pickle (Ray's transport) and `fix` again."""
    fix(data)
    sent = pickle.loads(pickle.dumps(data.consolidate()))
    fix(sent)
    parts = [tu.index_select_tensor_dict(data, [2, 0, 3]), *tu.chunk_tensordict(data, 2), sent]
    return [list(part["position_ids"].unbind()) for part in parts]


@pytest.mark.parametrize("response_lens", [[3, 3, 3, 3], [2, 5, 3, 4]], ids=["equal", "ragged"])
def test_verls_readers_give_the_stored_rows_with_the_plugins_fix(cfg, response_lens):
    """TransferQueue's packing, then verl's fix as its workers call it, `index_select_tensor_dict` and
    `chunk_tensordict`: every reader gives the stored [4, S] rows. Without the plugin (verl's own fix) the
    equal-length batch fails in verl's unbind (the driver's crash); a ragged batch comes out as verl's fix left it."""
    rows = samples(cfg, response_lens)
    pos = [r["position_ids"] for r in rows]
    want = [[pos[2], pos[0], pos[3]], pos[:2], pos[2:], pos]
    got = through_verl(packed(rows), tu.maybe_fix_3d_position_ids)
    assert all(len(g) == len(w) and all(torch.equal(a, b) for a, b in zip(g, w)) for g, w in zip(got, want))
    if len(set(response_lens)) == 1:
        with pytest.raises(RuntimeError, match="split_with_sizes"):
            through_verl(packed(rows), VERL_FIX)
    else:
        ours, theirs = packed(rows), packed(rows)
        tu.maybe_fix_3d_position_ids(ours)
        VERL_FIX(theirs)
        a, b = ours["position_ids"], theirs["position_ids"]
        assert a._ragged_idx == b._ragged_idx == 2
        assert torch.equal(a.values(), b.values()) and torch.equal(a.offsets(), b.offsets())


def test_a_square_batch_is_read_by_the_input_ids_lengths():
    """Values [8, 8] with offsets 0, 4, 8 read both ways: two [4, 8] rows ragged over the axes (TransferQueue's
    packing), or two [8, 4] rows ragged over the tokens (labelled ragged at dim 1 after a consolidate + pickle). The
    input_ids' lengths tell them apart; without input_ids, torch's label (dim 1) is read as the axes."""
    gen = torch.Generator().manual_seed(1)
    axes = [torch.randint(0, 50, (4, 8), generator=gen) for _ in range(2)]
    tokens = [torch.randint(0, 50, (8, 4), generator=gen) for _ in range(2)]
    for rows, nested, with_ids in ((axes, torch.nested.as_nested_tensor(axes, layout=torch.jagged), True),
                                   (axes, torch.nested.as_nested_tensor(axes, layout=torch.jagged), False),
                                   (tokens, tu.nested_tensor_from_tensor_list(tokens, ragged_idx=2), True)):
        ids = torch.nested.as_nested_tensor([torch.zeros(r.shape[1]) for r in rows], layout=torch.jagged)
        data = TensorDict({"position_ids": nested, **({"input_ids": ids} if with_ids else {})}, batch_size=2)
        data = pickle.loads(pickle.dumps(data.consolidate()))
        assert data["position_ids"]._ragged_idx == 1 and data["position_ids"].values().shape == (8, 8)
        tu.maybe_fix_3d_position_ids(data)
        assert all(torch.equal(a, b) for a, b in zip(data["position_ids"].unbind(), rows, strict=True))
