"""The decode window's graphed reference prefix items (mode.window_graphs, prefix/graphs.py) on CPU: what a bucket
is, the eager fallback where nothing can be captured, and the setting's refusals. The captures and replays
themselves are tested on GPU (`test_gpu_prefix_graphs.py`)."""
import random

import pytest
import torch

from rollplex_megatron.dist import run_local
from rollplex_megatron.prefix.batch import Prompt
from rollplex_megatron.prefix.graphs import bucket_key
from rollplex_megatron.recipes import load_run_config
from rollplex_megatron.runtime import host_constant
from tests import graph_workers as W


def _p(n, video=None, image=None):
    return Prompt(torch.zeros(n + 1, dtype=torch.long), video_grid_thw=None if video is None else torch.tensor(video),
                  image_grid_thw=None if image is None else torch.tensor(image))


def test_bucket_is_each_prompts_prefix_length_and_grids():
    a = bucket_key([_p(9, video=[[2, 8, 12]])])
    assert a == ((9, (), ((2, 8, 12),)),)
    assert bucket_key([_p(9, video=[[2, 8, 12]])]) == a  # other ids and pixels: the same graph
    for other in ([_p(10, video=[[2, 8, 12]])], [_p(9, video=[[2, 12, 8]])], [_p(9, image=[[2, 8, 12]])],
                  [_p(9, video=[[2, 8, 12]]), _p(9, video=[[2, 8, 12]])]):
        assert bucket_key(other) != a, other


def test_without_cuda_items_run_eagerly_and_say_why():
    res = run_local(W.eager_without_cuda, 1, random.randrange(1 << 30))[0]
    assert res["diff"] == 0.0 and res["groups"] == [1, 3], res
    assert res["reason"] == "no CUDA device", res
    assert res["spare_bytes"] == 0, res  # the reference K/V are stored compact
    assert (res["stats"]["prefix_graph_eager"], res["stats"]["prefix_graphs_captured"]) == (1, 0), res


def test_host_constant_off_capture_is_a_plain_copy():
    t = torch.arange(6).reshape(2, 3)
    assert torch.equal(host_constant(t, "cpu"), t) and host_constant(t, None) is t  # None: where it is


@pytest.mark.parametrize("mode", ["serial", "prefix_shared"])
def test_window_graphs_outside_rollplex_is_refused(mode):
    with pytest.raises(ValueError, match=r"mode.window_graphs=true has no effect without mode.name=rollplex"):
        load_run_config([f"mode={mode}", "mode.window_graphs=true"])
    assert load_run_config(["mode=rollplex", "mode.window_graphs=true", "train.reference=always"]).mode.window_graphs


def test_window_graphs_without_a_reference_is_refused():
    with pytest.raises(ValueError, match=r"^mode.window_graphs=true has no effect without a reference"):
        load_run_config(["mode=rollplex", "mode.window_graphs=true"])  # kl_coef 0: no reference, no items
    assert load_run_config(["mode.window_graphs=true", "train.kl_coef=0.01"]).train.uses_reference


def test_window_graphs_with_sglang_is_refused():
    with pytest.raises(ValueError, match=r"^mode.window_graphs=true: rollout.engine=sglang runs the decode window"):
        load_run_config(["rollout.engine=sglang", "rollout.sglang.model_path=/ckpt/qwen", "mode.window_graphs=true",
                         "train.reference=always"])
    assert not load_run_config(["rollout.engine=sglang", "rollout.sglang.model_path=/ckpt/qwen"]).mode.window_graphs


def test_window_graphs_need_the_reference_resident_where_graphs_are_captured():
    from rollplex_megatron.trainer.runtime import check_window_graphs

    on = load_run_config(["mode=rollplex", "mode.window_graphs=true", "train.reference=always", "memory.plan=phase"])
    with pytest.raises(ValueError, match=r"^mode.window_graphs=true: memory.plan=phase releases the reference's "):
        check_window_graphs(on, ["optimizer_states", "reference_weights"], cuda=True)
    check_window_graphs(on, ["optimizer_states", "main_weights"], cuda=True)  # the reference stays: its graphs too
    check_window_graphs(on, ["reference_weights"], cuda=False)  # nothing is captured without CUDA
    check_window_graphs(load_run_config(["mode=rollplex"]), ["reference_weights"], cuda=True)  # the setting off


@pytest.mark.parametrize("max_buckets,captured,eager", [(1, 0, 1), (2, 1, 0)])
def test_buckets_past_the_cap_run_eagerly(max_buckets, captured, eager):
    res = run_local(W.bucket_cap, 1, random.randrange(1 << 30), max_buckets)[0]
    assert res["diff"] == 0.0 and res["captured"] == captured, res
    assert res["stats"]["prefix_graph_eager"] == eager, res


def test_a_capture_that_fails_sends_the_items_later_packs_to_the_plain_path():
    res = run_local(W.capture_fails_mid_item, 1, random.randrange(1 << 30))[0]
    assert res["diff"] == 0.0 and res["error"].startswith("capture failed"), res
    assert res["stats"]["prefix_graph_eager"] == 1 and res["stats"]["prefix_graph_replays"] == 0, res


def test_window_graph_buckets_needs_window_graphs():
    with pytest.raises(ValueError, match=r"^mode.window_graph_buckets=2 has no effect without mode.window_graphs"):
        load_run_config(["mode.window_graph_buckets=2"])
    with pytest.raises(ValueError, match=r"^mode.window_graph_buckets must be >= 1, got 0$"):
        load_run_config(["mode.window_graphs=true", "mode.window_graph_buckets=0"])


@pytest.mark.parametrize("layout", [["parallel.tp=2"], ["parallel.pp=2"]])
def test_window_graphs_across_ranks_is_refused(layout):
    with pytest.raises(ValueError, match=r"^mode.window_graphs=true captures the reference's window items on one "):
        load_run_config(["mode.window_graphs=true", "train.reference=always", *layout])
    load_run_config(layout)  # the layout alone is fine
