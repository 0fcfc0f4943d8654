"""CUDA graphs of the reference prefix stage as the decode window runs it (`mode.window_graphs`).

Issued eagerly, one reference prefix item (a group's prefix, vision tower included) is about 4000 kernel launches
from a host thread: at 3B and 1040 prefix tokens the host needs 0.16-0.19 s for 0.055 s of GPU work
(`benchmarks/results/window_item_graph_probe_*.json`), so beside decode the item runs at the host's pace and its
issuing takes the GIL from the decode thread. Here each bucket of items is captured once and replayed: a replay
is a few copies into the graph's input tensors, one graph launch and a copy of the K/V out.

A bucket is what a capture bakes in besides its inputs' values: per prompt of the pack, its prefix length and
its vision grids (the vision tower's window plan, the packed attention's segments and the merge order are planned
on the host from them; `runtime.host_constant` records those copies into the graph). At most
`mode.window_graph_buckets` are captured; items of other buckets run eagerly, since prompts of many lengths would
capture, and keep the outputs of, a graph each. Token ids, M-RoPE
positions and pixels are the graph's inputs, copied in before each replay. A replay runs the same kernels on the
same shapes as the eager forward, so its K/V equal the eager forward's (the GPU test compares them exactly).

Graphs read the weights by address: they are kept while the model's parameters and buffers stay where they were
captured (`runtime.tensors_key`); a reference offloaded and brought back (memory.plan=phase) lands elsewhere, so
its next rollout would capture again (the trainer refuses that plan with this setting on CUDA,
`trainer.runtime.check_window_graphs`; weights moved for another reason are still caught here and counted in
`prefix_graphs_captured`). The first item of a bucket runs eagerly
(its result is the item's, and it is the warm-up capture needs), then the bucket is captured. Captures
synchronise the device (torch.cuda.graph does), so they are counted and timed apart. Graph memory (one pool for
every bucket of a run) stays on the device while the graphs are kept; `prefix_graph_pool_gib` reports it (the
static inputs and the pinned constants besides it are small: ids, positions, pixels, index tables).
Only a single-rank model layout on CUDA is captured (no TP or PP collectives in the item; the config refuses the
setting at TP or PP > 1); without CUDA the items take the plain path, and a capture that fails sends the rest of
the run's items there too, with the reason in `prefix_graph_error`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from megatron.core import parallel_state as ps

from rollplex_megatron.attention.kv_store import KVStore
from rollplex_megatron.prefix.execution import record_context
from rollplex_megatron.runtime import capture_constants, tensors_key


def _grids(grid) -> tuple:
    return () if grid is None else tuple(tuple(int(x) for x in row) for row in grid.reshape(-1, 3).tolist())


def bucket_key(prompts) -> tuple:
    """Per prompt of a pack: (prefix length, image grids, video grids), what a captured prefix forward bakes in."""
    return tuple((p.input_ids.numel() - 1, _grids(p.image_grid_thw), _grids(p.video_grid_thw)) for p in prompts)


def _pool_bytes(pool) -> int:
    """Device memory held by the segments of the graphs' private pool (the allocator's snapshot; captures are
    rare, so its cost does not matter)."""
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
               if tuple(seg.get("segment_pool_id", ())) == tuple(pool))


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: dict  # the graph's input tensors (ids, positions, pixels on the device; grids on the host)
    store: KVStore  # the graph's K/V outputs, under the pack's local ids 0..n-1
    constants: list  # pinned host tensors its host-to-device copies read


@dataclass
class PrefixGraphs:
    """One run's captured reference prefix items, by bucket (see the module docstring)."""

    max_buckets: int = 4  # mode.window_graph_buckets: an item of a bucket past these runs eagerly
    graphs: dict = field(default_factory=dict)
    stats: dict = field(default_factory=lambda: {"prefix_graphs_captured": 0, "prefix_graph_replays": 0,
                                                 "prefix_graph_eager": 0, "prefix_graph_capture_s": 0.0})
    error: str = ""
    _pool: object = None
    _weights: tuple = ()
    _pool_bytes: int = 0
    _stream: object = None  # the stream captures run on (see `_capture`)

    def ran_plain(self, packs: int) -> None:
        """Count items that took the plain path because nothing can be captured here (`why_plain`)."""
        self.stats["prefix_graph_eager"] += packs

    def why_plain(self, m) -> str:
        """Why `m`'s prefix items cannot be captured here ('' when they can); where they cannot, the items run on
        the plain path (`trainer.modes.rollplex.reference_prefix_item`, which handles pipeline stages)."""
        if self.error:
            return self.error
        if not torch.cuda.is_available():
            return "no CUDA device"
        if ps.get_tensor_model_parallel_world_size() > 1 or ps.get_pipeline_model_parallel_world_size() > 1:
            return "the model is split over ranks (TP or PP): its items hold collectives"
        if not hasattr(m, "prefix_inputs"):
            return f"{type(m).__name__} has no prefix_inputs (the graph's inputs)"
        return ""

    def record(self, m, prompts: list, store: KVStore, groups: list[int]) -> None:
        """The reference prefix stage of one pack of `prompts` (no grad) into `store` under `groups`: a replay of
        its bucket's graph, or an eager forward (then captured) where the bucket is new or the weights moved."""
        reason = self.why_plain(m)
        if reason:  # the caller runs such items on the plain path (`reference_prefix_item`)
            raise RuntimeError(f"PrefixGraphs.record: {reason}")
        weights = tensors_key(m)
        if weights != self._weights:  # the graphs read the old addresses: drop them (their pool goes with them)
            if self.graphs:  # after their replays in flight (their pinned constants are freed with them)
                torch.cuda.current_stream().synchronize()
            self.graphs.clear()
            self._pool, self._weights, self._pool_bytes = None, weights, 0
        key = bucket_key(prompts)
        c = self.graphs.get(key)
        if c is None:
            self._eager(m, prompts, store, groups)
            if len(self.graphs) < self.max_buckets:
                self._capture(m, prompts, key)
            else:
                self.stats["prefix_graph_eager"] += 1
            return
        self._fill(c, m, prompts)
        c.graph.replay()
        for (layer, j), (k, v) in c.store.leaves.items():
            store.record(layer, groups[j], k.clone(), v.clone(), keep_graph=False)
        self.stats["prefix_graph_replays"] += 1

    @staticmethod
    def _fill(c: _Captured, m, prompts) -> None:
        """Copy the prompts' ids, positions and pixels into the graph's input tensors (host ones through pinned
        staging, so the copy does not wait for the stream)."""
        for name, t in m.prefix_inputs(prompts, None).items():
            if isinstance(t, torch.Tensor) and c.inputs[name].is_cuda:
                c.inputs[name].copy_(t if t.is_cuda else t.pin_memory(), non_blocking=True)

    def _eager(self, m, prompts, store, groups) -> None:
        lens = [p.input_ids.numel() - 1 for p in prompts]
        with torch.no_grad():
            m.prefix_stage(prompts, record_context(store, groups, lens, keep_graph=False), None)

    def _capture(self, m, prompts, key) -> None:
        t0 = time.perf_counter()
        dev = torch.cuda.current_device()
        # the graph's own input tensors (a copy even of pixels already on the device: replays overwrite them)
        inputs = {k: t.to(dev, copy=True) if isinstance(t, torch.Tensor) and k != "image_grid_thw"
                  and k != "video_grid_thw" else t for k, t in m.prefix_inputs(prompts, None).items()}
        lens = [n for n, _, _ in key]
        local = list(range(len(lens)))  # the pack's groups in the graph's own store
        out = KVStore()
        graph = torch.cuda.CUDAGraph()
        self._pool = self._pool or torch.cuda.graph_pool_handle()
        # captures run on a stream of their own, warmed up there first: cuBLAS keeps a workspace per stream, and
        # a graph captured on torch's shared default capture stream would bake in the workspace of every other
        # graph captured there (the engine's decode steps); two graphs sharing a workspace must never run at once,
        # and the window replays these beside decode (on the H100 that hung the device)
        self._stream = self._stream or torch.cuda.Stream()
        try:
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream), torch.no_grad():
                m.forward_prefix(attention_context=record_context(KVStore(), local, lens, False), check=False, **inputs)
            torch.cuda.current_stream().wait_stream(self._stream)
            with capture_constants() as constants, torch.no_grad(), \
                    torch.cuda.graph(graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"):
                m.forward_prefix(attention_context=record_context(out, local, lens, False), check=False, **inputs)
        except Exception as e:  # the rest of the run's items take the plain path, and say why
            torch.cuda.current_stream().synchronize()  # the kept graphs' replays in flight end before they go
            self.graphs.clear()
            self._pool = None
            self.error = f"capture failed: {type(e).__name__}: {e}"[:500]
            return
        self.graphs[key] = _Captured(graph, inputs, out, constants)
        self._pool_bytes = _pool_bytes(self._pool)
        self.stats["prefix_graphs_captured"] += 1
        self.stats["prefix_graph_capture_s"] += time.perf_counter() - t0

    def take_stats(self) -> dict:
        """The counters since the last call (a step's), the device memory of the kept graphs' pool (GiB) and, if
        captures stopped, why."""
        out = {**self.stats, "prefix_graph_pool_gib": self._pool_bytes / 2**30 if self.graphs else 0.0}
        if self.error:
            out["prefix_graph_error"] = self.error
        self.stats = {k: type(v)() for k, v in self.stats.items()}
        return out
