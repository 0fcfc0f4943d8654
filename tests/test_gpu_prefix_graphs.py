"""GPU-only: the decode window's reference prefix items as CUDA graphs (mode.window_graphs, prefix/graphs.py)
against the eager items they replace, on fresh random prompts: replays on other prompts of a bucket (one with its
video elsewhere in the text and at another pace), a second bucket, packs, and a recapture after the weights
moved. bf16 on both sides with the same kernels and shapes, so the K/V must be equal. Mutation: replays that skip
copying the new prompt in must differ.

Marked `gpu`: skipped, with a reason, without CUDA (the CPU suite tests the bucket keys and the settings,
`test_prefix_graphs.py`); these run on the device machine.
"""
import random

import pytest
import torch

from rollplex_megatron.dist import run_local
from tests import graph_workers as W

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA: CUDA graphs are captured on GPU only", allow_module_level=True)


def test_replayed_items_equal_eager_items():
    res = run_local(W.graphs_vs_eager, 1, random.randrange(1 << 30))[0]
    assert all(d == 0.0 for d in res["diff"].values()), res
    st = res["stats"]
    # buckets: one video (A), one image (B), the pack (A, B); the rest replays
    assert (st["prefix_graphs_captured"], st["prefix_graph_replays"], st["prefix_graph_eager"]) == (3, 4, 0), res
    assert "prefix_graph_error" not in st and st["prefix_graph_pool_gib"] > 0, res
    # after the weights moved: the graphs were dropped, the next item captured again, then replayed
    assert (res["stats_after_move"]["prefix_graphs_captured"], res["stats_after_move"]["prefix_graph_replays"]) == \
        (1, 1), res


def test_mutation_replays_without_the_new_inputs_differ():
    res = run_local(W.graphs_vs_eager, 1, random.randrange(1 << 30), True)[0]
    assert res["diff"]["capture_a"] == 0.0  # the first item of a bucket is eager
    assert res["diff"]["replay_a"] > 0 and res["diff"]["replay_pack"] > 0, res
