"""Worker for the GPU test of the decode window's graphed reference prefix items (importable for spawn)."""
from __future__ import annotations

import torch

from rollplex_megatron.attention.kv_store import KVStore
from rollplex_megatron.dist import init_parallel
from rollplex_megatron.models.qwen25vl import build_model
from rollplex_megatron.prefix.batch import Prompt
from rollplex_megatron.prefix.graphs import PrefixGraphs
from rollplex_megatron.recipes import load_run_config
from rollplex_megatron.trainer.modes.rollplex import reference_prefix_item


def _prompt(cfg, g, grid, text_tokens, image: bool, dev="cuda", dtype=torch.bfloat16, lead: int = 2,
            seconds: float = 1.0):
    """A random prompt with one video (or image) of `grid` after `lead` of its `text_tokens` text tokens (a video
    `seconds` per grid step); pixels on `dev`."""
    v = cfg.vision
    n_patch, n_tok = grid[0] * grid[1] * grid[2], grid[0] * grid[1] * grid[2] // v.spatial_merge_size ** 2
    width = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
    tok = cfg.image_token_id if image else cfg.video_token_id
    text = torch.randint(0, cfg.image_token_id, (text_tokens,), generator=g)
    ids = torch.cat([text[:lead], torch.tensor([cfg.vision_start_token_id]), torch.full((n_tok,), tok),
                     torch.tensor([cfg.vision_end_token_id]), text[lead:]])
    pix = (torch.randn(n_patch, width, generator=g) * 3).to(dev, dtype)
    grid_t = torch.tensor([list(grid)])
    if image:
        return Prompt(ids, pixel_values=pix, image_grid_thw=grid_t)
    return Prompt(ids, pixel_values_videos=pix, video_grid_thw=grid_t, second_per_grid_ts=torch.tensor([seconds]))


def _diff(a: KVStore, b: KVStore) -> float:
    assert a.leaves.keys() == b.leaves.keys(), (sorted(a.leaves), sorted(b.leaves))
    return max(float((a.leaves[k][i].float() - b.leaves[k][i].float()).abs().max()) for k in b.leaves for i in (0, 1))


def graphs_vs_eager(seed: int, stale_inputs: bool = False) -> dict:
    """Replays of captured reference prefix items against eager forwards, on fresh random prompts: per case the
    largest K/V difference, plus the stats. `stale_inputs` (the mutation): replays skip copying the new prompt in."""
    init_parallel(1, 1, seed, "nccl")
    cfg = load_run_config(["model=tiny"]).model
    torch.manual_seed(seed)
    model = build_model(cfg, "bfloat16").eval()
    g = torch.Generator().manual_seed(seed)
    a1, a2, a3 = (_prompt(cfg, g, (2, 8, 12), 9, False) for _ in range(3))  # bucket A: same length and grid
    b1 = _prompt(cfg, g, (1, 12, 8), 5, True)  # an image of another grid: bucket B
    # bucket A again, the video elsewhere in the text and at another pace: its positions differ, not its key
    a4 = _prompt(cfg, g, (2, 8, 12), 9, False, lead=6, seconds=2.0)
    graphs = PrefixGraphs()
    if stale_inputs:
        PrefixGraphs._fill = staticmethod(lambda c, m, prompts: None)
    out = {"diff": {}}
    # first of each bucket: eager then captured; then replays on other prompts, alone and as packs
    cases = [("capture_a", [a1], [0]), ("replay_a", [a2], [3]), ("capture_b", [b1], [1]),
             ("replay_a_again", [a3], [2]), ("replay_a_other_layout", [a4], [6]), ("capture_pack", [a1, b1], [0, 1]),
             ("replay_pack", [a3, b1], [4, 5])]
    for name, prompts, groups in cases:
        got, want = KVStore(), KVStore()
        reference_prefix_item(model, prompts, got, groups, pack_tokens=1 << 20, graphs=graphs)
        reference_prefix_item(model, prompts, want, groups, pack_tokens=1 << 20)
        out["diff"][name] = _diff(got, want)
    out["stats"] = graphs.take_stats()
    # the weights move (as an offloaded reference comes back elsewhere): the graphs are dropped and captured again
    for p in model.parameters():
        p.data = p.data.clone()
    got, want = KVStore(), KVStore()
    reference_prefix_item(model, [a2], got, [0], graphs=graphs)
    reference_prefix_item(model, [a2], want, [0])
    out["diff"]["after_weights_moved"] = _diff(got, want)
    got = KVStore()
    reference_prefix_item(model, [a1], got, [0], graphs=graphs)
    want = KVStore()
    reference_prefix_item(model, [a1], want, [0])
    out["diff"]["replay_after_recapture"] = _diff(got, want)
    out["stats_after_move"] = graphs.take_stats()
    return out


def eager_without_cuda(seed: int) -> dict:
    """CPU: graphed items fall back to the eager forward (the reason recorded); their K/V against the plain item."""
    init_parallel(1, 1, seed, "gloo")
    cfg = load_run_config(["model=tiny"]).model
    torch.manual_seed(seed)
    model = build_model(cfg, "float32").eval()
    g = torch.Generator().manual_seed(seed)
    prompts = [_prompt(cfg, g, (2, 8, 12), 9, False, "cpu", torch.float32), _prompt(cfg, g, (1, 12, 8), 5, True,
                                                                                     "cpu", torch.float32)]
    graphs, got, want = PrefixGraphs(), KVStore(), KVStore()
    reference_prefix_item(model, prompts, got, [3, 1], pack_tokens=1 << 20, graphs=graphs)
    reference_prefix_item(model, prompts, want, [3, 1], pack_tokens=1 << 20)
    # the stored K and V hold no more memory than themselves (megatron's V is a view of the fused QKV projection:
    # a view would keep the projection alive); a pack's groups may share one tensor
    leaves = [t for kv in want.leaves.values() for t in kv]
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in leaves}
    spare = sum(held.values()) - sum(t.numel() * t.element_size() for t in leaves)
    return {"diff": _diff(got, want), "groups": sorted({gr for _, gr in got.leaves}), "reason": graphs.why_plain(model),
            "stats": graphs.take_stats(), "spare_bytes": spare}


def bucket_cap(seed: int, max_buckets: int) -> dict:
    """CPU: PrefixGraphs as if it could capture (its `why_plain` and `_capture` stood in for), one bucket already
    held: with `max_buckets` 1 a new bucket runs eagerly and nothing is captured; with 2 it is captured."""
    from rollplex_megatron.runtime import tensors_key

    init_parallel(1, 1, seed, "gloo")
    cfg = load_run_config(["model=tiny"]).model
    torch.manual_seed(seed)
    model = build_model(cfg, "float32").eval()
    g = torch.Generator().manual_seed(seed)
    prompt = _prompt(cfg, g, (2, 8, 12), 9, False, "cpu", torch.float32)
    graphs, captured = PrefixGraphs(max_buckets), []
    graphs.why_plain = lambda m: ""
    graphs._capture = lambda m, prompts, key: captured.append(key)
    graphs._weights = tensors_key(model)
    graphs.graphs[("another bucket",)] = None
    got, want = KVStore(), KVStore()
    reference_prefix_item(model, [prompt], got, [2], graphs=graphs)
    reference_prefix_item(model, [prompt], want, [2])
    return {"diff": _diff(got, want), "captured": len(captured), "stats": graphs.take_stats()}


def capture_fails_mid_item(seed: int) -> dict:
    """CPU: PrefixGraphs as if it could capture, whose first capture fails: the item's later pack takes the plain
    path (it must not ask `record` to replay after the failure); the item's K/V against the plain item's."""
    from rollplex_megatron.runtime import tensors_key

    init_parallel(1, 1, seed, "gloo")
    cfg = load_run_config(["model=tiny"]).model
    torch.manual_seed(seed)
    model = build_model(cfg, "float32").eval()
    g = torch.Generator().manual_seed(seed)
    prompts = [_prompt(cfg, g, (2, 8, 12), 9, False, "cpu", torch.float32) for _ in range(2)]
    pack = prompts[0].input_ids.numel() - 1  # one prompt a pack: two packs in the item
    graphs = PrefixGraphs()
    graphs.why_plain = lambda m: graphs.error

    def fail(m, prompts, key):
        graphs.error = "capture failed: RuntimeError: stood in"
    graphs._capture = fail
    graphs._weights = tensors_key(model)
    got, want = KVStore(), KVStore()
    reference_prefix_item(model, prompts, got, [4, 7], pack_tokens=pack, graphs=graphs)
    reference_prefix_item(model, prompts, want, [4, 7], pack_tokens=pack)
    return {"diff": _diff(got, want), "stats": graphs.take_stats(), "error": graphs.error}
