"""Shared-prefix attention: packed responses attend to their group's prefix K/V plus their own K/V.

Legend: T = packed query tokens of a micro-batch (B=1), Kp = concatenated prefix K/V of the groups in
the micro-batch, Ng/Nq = KV groups / query heads per TP rank, D = head dim.

A query token of response r in group g may attend to every prefix position of g (non-causal: the
prefix precedes the whole response) and to positions 0..own of r (causal). The same rule with no
prefix is plain block-causal attention over packed sequences (the full-sequence baseline). Prefix
K/V are never repeated per response and GQA heads are never expanded.

The context travels to megatron's core attention as `packed_seq_params` (megatron passes that
argument untouched from GPTModel to core attention), so no global state is involved.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from rollplex_megatron.attention.context import AttentionContext
from rollplex_megatron.attention.core import sdpa_attention
from rollplex_megatron.attention.decode import flash_varlen_available
from rollplex_megatron.attention.kv_store import KVStore
from rollplex_megatron.attention.split import split_attention, split_index
from rollplex_megatron.runtime import host_constant


@dataclass
class PackedLayout:
    """Per-token metadata of one packed micro-batch (all int64 tensors on the compute device)."""

    seg_T: torch.Tensor  # response (segment) id of each query token
    pos_T: torch.Tensor  # position of each query token inside its segment
    group_T: torch.Tensor  # group id of each query token (-1: no shared prefix)
    prefix_groups: list[int] = field(default_factory=list)  # groups whose prefix K/V are prepended
    prefix_lens: list[int] = field(default_factory=list)  # their prefix lengths, same order
    seg_lens: list[int] = field(default_factory=list)  # host copies: tokens of each segment, in token order
    seg_groups: list[int] = field(default_factory=list)  # and its group (-1: none); empty: read from the tensors

    def segments(self) -> tuple[list[int], list[int]]:
        """Each segment's token count and group, in token order (from the host lists, else read back once)."""
        if self.seg_lens:
            return self.seg_lens, self.seg_groups
        _, counts = torch.unique_consecutive(self.seg_T, return_counts=True)
        starts = (counts.cumsum(0) - counts).tolist()
        return counts.tolist(), self.group_T[starts].tolist()

    def allowed(self) -> torch.Tensor:
        """[T, Kp+T] bool: True where the query token may attend to the key."""
        own = (self.seg_T[:, None] == self.seg_T[None, :]) & (self.pos_T[None, :] <= self.pos_T[:, None])
        if not self.prefix_groups:
            return own
        dev = self.seg_T.device
        key_group = torch.repeat_interleave(torch.tensor(self.prefix_groups, device=dev),
                                            torch.tensor(self.prefix_lens, device=dev))
        return torch.cat([self.group_T[:, None] == key_group[None, :], own], dim=1)


@dataclass
class PrefixContext(AttentionContext):
    """What core attention needs for one forward: mode, layout and the K/V store.

    mode "record": a prefix forward of `group` (causal over the prefix; K/V stored per layer), or, with
      `groups`, of several groups' prefixes packed one after another (`lens` tokens each): each group
      is causal over its own prefix alone and its K/V slice is stored under its id.
    mode "use": packed responses read the stored prefix K/V of `layout.prefix_groups`.
    mode "packed": packed full sequences, block-causal, no shared prefix.
    """

    mode: str = "packed"
    layout: PackedLayout | None = None
    store: KVStore | None = None
    group: int = -1
    keep_graph: bool = True
    trainable: bool = False  # record: trainable leaves without a graph (the prefix is recomputed later)
    # auto (split where its flash kernels run, else sdpa) | sdpa | flex | split (`attention.split`: no mask, two
    # varlen calls merged)
    backend: str = "auto"
    groups: tuple[int, ...] = ()  # record: the packed groups' ids in token order (empty: `group` alone)
    lens: tuple[int, ...] = ()  # record: their prefix lengths, same order

    def __post_init__(self) -> None:
        self.qkv_format = "sbhd"  # megatron must not treat this as THD packing (rotary, kernels)
        self._allowed = None  # [T, Kp+T] mask, built once per micro-batch and shared by all layers
        self._block = None  # FlexAttention block mask, likewise
        self._pack_index = None  # record over several groups: token indices per prefix length, on the device
        self._split = None  # split backend: the segment index, built once per micro-batch
        self._resolved = None  # the backend `auto` resolved to

    def attend(self, layer: int, query, key, value, scale):
        """Attention for core attention's inputs: query [T,1,Nq,D], key/value [T,1,Ng,D]."""
        query, key = self.rotate(query, key)
        if self.mode == "record" and self.groups:
            for g, (k, v) in zip(self.groups, zip(key.split(self.lens), value.split(self.lens))):
                self.store.record(layer, g, k, v, self.keep_graph, self.trainable)
            if self._pack_index is None:  # once per forward: a host-to-device copy per layer would stall the host
                self._pack_index = pack_index(self.lens, query.device)
            return segment_attention(query, key, value, self._pack_index, scale, causal=True)
        if self.mode == "record":
            self.store.record(layer, self.group, key, value, self.keep_graph, self.trainable)
            return sdpa_attention(query, key, value, None, True, scale)
        backend = self._backend(query)
        if backend == "split":
            return self._split_attend(layer, query, key, value, scale)
        if self._allowed is None:
            self._allowed = self.layout.allowed()
        allowed = self._allowed
        if self.mode == "use":
            pk, pv = self._prefix_kv(layer, key.dtype)
            key, value = torch.cat(pk + [key], dim=0), torch.cat(pv + [value], dim=0)
        if backend == "flex":
            if self._block is None:
                self._block = _block_mask(allowed, query.shape[0], key.shape[0], query.device)
            return _flex(query, key, value, allowed, scale, self._block)
        return shared_prefix_attention(query, key, value, allowed, scale, backend)

    def _split_attend(self, layer: int, query, key, value, scale):
        lay = self.layout
        if self._split is None:
            lens, groups = lay.segments()
            prefix = lay.prefix_groups if self.mode == "use" else []
            self._split = split_index(lens, groups, prefix, lay.prefix_lens, query.device)
        pk = pv = None
        if self.mode == "use":
            pk, pv = (torch.cat(x, dim=0) for x in self._prefix_kv(layer, key.dtype))
        return split_attention(query, key, value, pk, pv, self._split, scale)

    def _prefix_kv(self, layer: int, dtype) -> tuple[list, list]:
        """The present groups' stored prefix K and V of `layer` in `dtype`, in `layout.prefix_groups` order."""
        kv = [self.store.kv(layer, g, dtype) for g in self.layout.prefix_groups]
        return [x[0] for x in kv], [x[1] for x in kv]

    def _backend(self, query) -> str:
        """The backend this forward runs: `auto` is split where its flash kernels run (CUDA, bf16/fp16), else
        sdpa; resolved once per micro-batch."""
        if self._resolved is None:
            self._resolved = self.backend if self.backend != "auto" else resolve_backend(query.dtype, query.device,
                                                                                         query.shape[-1])
        return self._resolved


def resolve_backend(dtype, device, head_dim: int) -> str:
    """`auto`: the split attention where its flash kernels run (it scores only the allowed key blocks: 5.1x
    faster than the masked SDPA path at an 8192-token update micro-batch on the H200,
    `benchmarks/results/split_attention_h200.json`), else SDPA with the mask (CPU, fp32)."""
    return "split" if flash_varlen_available(dtype, device, head_dim) else "sdpa"


def pack_index(lens, device) -> list[torch.Tensor]:
    """Token indices [n, L] of the consecutive segments `lens`, one tensor per distinct length L, on `device`."""
    lens_t = torch.as_tensor(lens, dtype=torch.long)
    starts = lens_t.cumsum(0) - lens_t
    return [host_constant(starts[lens_t == n][:, None] + torch.arange(n)[None, :], device)
            for n in torch.unique(lens_t).tolist()]


def segment_attention(query_TBND, key_TBGD, value_TBGD, index: list[torch.Tensor], scale, causal: bool):
    """Attention inside each segment of a packed sequence (B=1), causal or not; `index`: `pack_index` of the
    segments. The segments of one length run as one batched SDPA call (each row of the batch is what the
    one-segment call computes, with the same kernel), so no [T, T] mask is built and no work crosses segments.
    Used by the packed prefix stages (causal) and the vision tower's windows and frames (SegmentContext)."""
    t, _, nq, d = query_TBND.shape
    out = query_TBND.new_empty(t, nq * d)
    for idx in index:
        q, k, v = (x[idx, 0].transpose(1, 2) for x in (query_TBND, key_TBGD, value_TBGD))  # [n, N, L, D]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                           enable_gqa=k.shape[1] != q.shape[1])
        out[idx.reshape(-1)] = o.transpose(1, 2).reshape(-1, nq * d)
    return out.reshape(t, 1, nq * d)


def shared_prefix_attention(query_TBND, key_KBGD, value_KBGD, allowed_TK, scale, backend: str = "sdpa"):
    """Masked attention in megatron layout; `allowed_TK` True = may attend. Returns [T,1,Nq*D]."""
    if backend == "sdpa":
        return sdpa_attention(query_TBND, key_KBGD, value_KBGD, allowed_TK, False, scale)
    if backend == "flex":
        return _flex(query_TBND, key_KBGD, value_KBGD, allowed_TK, scale)
    raise ValueError(f"unknown attention backend {backend!r} (sdpa or flex)")


_FLEX_COMPILED = None


def _block_mask(allowed, sq: int, sk: int, device):
    """FlexAttention block mask of a dense `allowed` [S, K] mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, qi, ki):
        return allowed[qi, ki]

    return create_block_mask(mask_mod, None, None, sq, sk, device=device)


def _flex(query, key, value, allowed, scale, block=None):
    """FlexAttention with a block mask built from `allowed` (compiled on GPU, eager elsewhere)."""
    global _FLEX_COMPILED
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    block = block if block is not None else _block_mask(allowed, q.shape[2], k.shape[2], q.device)
    fn = flex_attention
    if q.is_cuda:
        if _FLEX_COMPILED is None:
            _FLEX_COMPILED = torch.compile(flex_attention, dynamic=True)
        fn = _FLEX_COMPILED
    out = fn(q, k, v, block_mask=block, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    b, n, s, d = out.shape
    return out.permute(2, 0, 1, 3).reshape(s, b, n * d)


def dense_reference(query, key, value, allowed, scale):
    """Plain math (float64) for tests: softmax(QK^T)V with GQA expanded and an explicit mask."""
    q, k, v = (t.permute(1, 2, 0, 3).double() for t in (query, key, value))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    s = s.masked_fill(~allowed, float("-inf"))
    out = F.softmax(s, dim=-1) @ v
    b, n, t, d = out.shape
    return out.permute(2, 0, 1, 3).reshape(t, b, n * d).to(query.dtype)


@dataclass
class SegmentContext(AttentionContext):
    """Non-causal attention inside segments given by `cu_seqlens` (vision windows / frames).

    Segments of equal length run as one batched SDPA call, so no [N, N] mask is built and SDPA
    can use its fused kernels; the result equals attention with the block-diagonal mask.
    """

    cu: torch.Tensor | None = None  # [n_seg + 1] cumulative segment lengths (CPU, long)
    device: torch.device | str | None = None  # where the token indices live (copied there once)

    def __post_init__(self) -> None:
        self.qkv_format = "sbhd"
        self._index = pack_index(self.cu.diff(), self.device)  # token index [n, L] per distinct segment length

    def attend(self, layer: int, query, key, value, scale):
        """query/key/value [N,1,H,D] -> [N,1,H*D], attention within each segment."""
        query, key = self.rotate(query, key)
        index = [i.to(query.device) for i in self._index]
        return segment_attention(query, key, value, index, scale, causal=False)
