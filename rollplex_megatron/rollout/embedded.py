"""The embedded rollout engine: the actor's own Megatron modules, in place, at the training TP.

Legend: Gr = groups (requests) of a wave, P = padded prefix length, Rm = max new tokens,
B = active samples, Ng = KV groups per TP rank, D = head dim, L = decoder layers.

Prefill is the prefix stage (`prefix.execution.prefix_forward`) over prompt[:-1], once per
request; its K/V go into the engine's cache once per group and are shared by the group's G
samples. Decode feeds [prompt[-1], sampled tokens...] at the positions the response stage uses, so
a rollout's log-probs are the training forward's log-probs. Finished samples leave the batch. The
cache is sized per wave from `memory.kv_cache_gib`; requests that do not fit wait for the next wave.

With `keep_decode_state` (`rollout.keep_decode_state`) the cache, the per-slot state and the CUDA graphs
of the decode step outlive the rollout (`_DecodeState`): a later wave of the same shape (groups, samples,
stop-list width, sampling parameters, the same weight tensors) refills them in place and replays the
graphs captured before, so only the first rollout pays the captures. The cache then grows to the largest
prefix and response length seen and stays allocated between rollouts (the memory planner counts the largest
wave in every phase; a grown cache, padded to the longest prefix and response seen, can hold more). On the
Triton path a grown cache gives a fresh engine's results exactly (its extra splits are empty partials of
the log-sum-exp merge); on the math and flash paths the longer padded shapes can change the summation order,
so log-probs can differ in the last bits. One state is kept: a rollout of another shape (a ragged last wave,
validation's sampling parameters) replaces it, and a rollout that fails drops it.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from megatron.core import parallel_state as ps

from rollplex_megatron.attention.decode import (
    FlashIndex,
    flash_varlen_available,
    flash_index,
    flash_shared_prefix_decode_attention,
    group_slots,
    shared_prefix_decode_attention,
)
from rollplex_megatron.attention.context import AttentionContext
from rollplex_megatron.attention.kv_store import KVStore
from rollplex_megatron.attention.triton_decode import INTERPRET as TRITON_INTERPRET
from rollplex_megatron.attention.triton_decode import (
    TritonIndex,
    triton_decode_available,
    triton_index,
    triton_rope_and_write,
    triton_shared_prefix_decode_attention,
)
from rollplex_megatron.config import ModelConfig, check_sampling_kernel
from rollplex_megatron.memory.tensor_bytes import kv_bytes_per_token
from rollplex_megatron.models.decode_layers import unsupported as decode_layers_unsupported
from rollplex_megatron.models.registry import model_spec
from rollplex_megatron.prefix.batch import Group, prompt_positions
from rollplex_megatron.prefix.execution import mini_batch_starts, p2p_communicator, prefix_forward, unwrap
from rollplex_megatron.rollout.engine import DecodeHooks, RolloutOutput, RolloutRequest, RolloutResult
from rollplex_megatron.rollout.sampling import SamplingParams, row_uniforms, sample_tokens
from rollplex_megatron.rollout.triton_norm import fused_rms_norms
from rollplex_megatron.rollout.triton_sampling import fused_sample, fused_sample_available
from rollplex_megatron.runtime import device, tensors_key


class DecodeCache:
    """Prefix K/V once per group and response K/V per sample, per layer: [2, Gr, P, Ng, D] and
    [2, rows, Rm, Ng, D], P and Rm at least the wave's (a kept cache is as large as the largest wave)."""

    def __init__(self, layers: list[int], n_groups: int, prefix_pad: int, n_rows: int, max_new: int, ng: int, d: int,
                 dtype, dev):
        self.layers, self.prefix_pad, self.max_new = layers, prefix_pad, max_new
        self.prefix_len = torch.zeros(n_groups, dtype=torch.long, device=dev)
        self.prefix = {layer: torch.zeros(2, n_groups, prefix_pad, ng, d, dtype=dtype, device=dev) for layer in layers}
        self.resp = {layer: torch.zeros(2, n_rows, max_new, ng, d, dtype=dtype, device=dev) for layer in layers}

    @staticmethod
    def layout(store: KVStore, store_ids: list[int]) -> tuple[list[int], list[int], int, int, torch.device]:
        """The stored prefixes' layers, lengths, KV groups, head dim and device."""
        layers = sorted({layer for layer, g in store.leaves if g == store_ids[0]})
        k0 = store.leaves[(layers[0], store_ids[0])][0]
        lens = [store.leaves[(layers[0], g)][0].shape[0] for g in store_ids]
        return layers, lens, k0.shape[2], k0.shape[3], k0.device

    @classmethod
    def for_wave(cls, store: KVStore, store_ids: list[int], rows_per_group: list[int], max_new: int, dtype):
        """A cache of exactly the wave's size, filled from `store`."""
        layers, lens, ng, d, dev = cls.layout(store, store_ids)
        cache = cls(layers, len(store_ids), max(lens), sum(rows_per_group), max_new, ng, d, dtype, dev)
        cache.fill(store, store_ids)
        return cache

    def fill(self, store: KVStore, store_ids: list[int], reused: bool = False) -> None:
        """The wave's prefix K/V copied in, in place (a kept cache's graphs read these tensors). A new cache
        is all zeros; a `reused` one has the padding behind each prefix and its response K/V zeroed again:
        the Triton and flash paths read only this wave's positions, but the math path multiplies masked
        positions by zero weights, and a non-finite value left by an earlier wave would make that NaN."""
        lens = [store.leaves[(self.layers[0], g)][0].shape[0] for g in store_ids]
        self.prefix_len.copy_(torch.tensor(lens))
        for layer, pk in self.prefix.items():
            for i, g in enumerate(store_ids):
                k, v = store.leaves[(layer, g)]
                pk[0, i, :lens[i]], pk[1, i, :lens[i]] = k[:, 0].detach(), v[:, 0].detach()
                if reused:
                    pk[:, i, lens[i]:].zero_()
        if reused:
            for r in self.resp.values():
                r.zero_()

    @staticmethod
    def nbytes(cfg: ModelConfig, tp: int, layers: int, prefix_len: int, rows: int, max_new: int, elt: int) -> int:
        """Bytes one group occupies: K and V of its prefix once plus `rows` response slots."""
        return kv_bytes_per_token(cfg, tp, layers, elt) * (prefix_len + rows * max_new)

    def attend(self, layer: int, ctx: "DecodeContext", query, key, value, scale):
        """Write this step's K/V of slots [0, n), then shared-prefix attention; [1,n,Nq*D].

        Static shapes only (slot count, response window, samples-per-group bound come from the
        context; the step is a device tensor), so the step can be captured in a CUDA graph."""
        r, n, p = self.resp[layer], ctx.n, self.prefix[layer]
        if ctx.rope is not None:  # the model left RoPE to this step (forward_decode): rotate and write at once
            q = triton_rope_and_write(query[0], key[0], value[0], ctx.rope, r[0, :n], r[1, :n], ctx.step)
            return triton_shared_prefix_decode_attention(q, p[0], p[1], r[0, :n], r[1, :n], ctx.triton, scale)[None]
        r[0, :n].index_copy_(1, ctx.step, key[0][:, None])
        r[1, :n].index_copy_(1, ctx.step, value[0][:, None])
        if ctx.triton is not None:
            return triton_shared_prefix_decode_attention(query[0], p[0], p[1], r[0, :n], r[1, :n], ctx.triton,
                                                         scale)[None]
        if ctx.flash is not None:
            out = flash_shared_prefix_decode_attention(query[0], p[0], p[1], ctx.group, ctx.slot, ctx.s_max, r[0, :n],
                                                       r[1, :n], ctx.window, ctx.flash, scale)
            return out[None]
        out = shared_prefix_decode_attention(query[0], p[0], p[1], self.prefix_len, ctx.group,
                                             r[0, :n, :ctx.window], r[1, :n, :ctx.window], ctx.length, scale,
                                             ctx.s_max, ctx.slot)
        return out[None]


@dataclass
class DecodeContext(AttentionContext):
    """Attention context of one decode step (reaches core attention as `packed_seq_params`)."""

    cache: DecodeCache | None = None
    n: int = 0  # slots in the step (a batch-size bucket)
    group: torch.Tensor | None = None  # [n] group of each slot
    step: torch.Tensor | None = None  # [1] long: the step (the response position written)
    s_max: int = 0  # bound on slots per group
    window: int = 0  # response positions attended (>= step + 1)
    slot: torch.Tensor | None = None  # [n] rank of each slot within its group (same for every layer)
    length: torch.Tensor | None = None  # [n] response positions written so far (step + 1)
    flash: FlashIndex | None = None  # varlen offsets when decode attention runs on flash kernels
    triton: TritonIndex | None = None  # indices when decode attention runs on the Triton kernels
    rope: torch.Tensor | None = None  # [n, D] rotary angles when the attention applies RoPE (forward_decode)
    gemm: str = "torch"  # the fused layer path's GEMMs: torch (the modules') | gated | all (models/decode_layers.py)

    part = None  # decode steps record no phase part (an eager step per layer would cost two timing events)

    def __post_init__(self) -> None:
        self.qkv_format = "sbhd"

    def attend(self, layer: int, query, key, value, scale):
        """Decode attention for this step's queries [1,n,Nq,D]."""
        return self.cache.attend(layer, self, query, key, value, scale)


@dataclass
class _DecodeState:
    """What a wave's decoding allocates and captures: the cache, the decoder's device tensors, the step's CUDA
    graphs and their memory pool. Kept by the engine between rollouts under `keep_decode_state`; `key` says
    which waves may reuse it (everything a captured graph bakes in but the tensors' contents)."""

    key: tuple
    cache: DecodeCache
    tensors: dict | None = None  # _WaveDecoder's device tensors (slot state, step, outputs), once allocated
    graphs: dict = field(default_factory=dict)  # (bucket, samples-per-group bound, window) -> torch.cuda.CUDAGraph
    pool: object = None  # the graphs' memory pool


_RESET = ("step", "length", "stopped")  # a kept state's counters, zeroed at each wave (outputs are read by length)


def _buckets(n: int) -> list[int]:
    """Batch-size buckets of a wave of `n` samples: n itself and the powers of two below it."""
    out, b = {n}, 1
    while b < n:
        out.add(b)
        b *= 2
    return sorted(out)


def _window(step: int, max_new: int) -> int:
    """Response positions a step attends: a power of two >= step + 1 (at least 64), capped."""
    w = 64
    while w < step + 1:
        w *= 2
    return min(w, max_new)


class EmbeddedEngine:
    """RolloutEngine on the actor's Megatron modules (no weight copy), at the training TP and PP.

    At pp > 1 every stage calls `generate` with the same requests: the prefill runs the prefix
    stage across the pipeline, each decode step passes the hidden states stage to stage, and the
    last stage's tokens are broadcast to all (decode runs eagerly there)."""

    prefill_is_actor_prefix = True  # the prefill can be the actor prefix stage (same modules, same layout)
    window_items_elsewhere = False
    weights_phase = None  # decodes on the actor's own modules: nothing to sync after an optimizer step
    collective = False  # generate involves this rank's model-parallel group only

    def __init__(self, model, cfg: ModelConfig, max_prompt_len: int, max_response_len: int, kv_cache_gib: float,
                 cuda_graphs: bool = True, decode_attention: str = "auto", sampling_kernel: str = "auto",
                 fused_rope: bool = True, fused_norm: bool = True, fused_layer: bool = True,
                 prefix_pack_tokens: int = 0, actor_pack_tokens: int | None = None, keep_decode_state: bool = False,
                 pack_splits: int = 1, decode_gemm: str = "torch"):
        self.model, self.cfg, self.spec = model, cfg, model_spec(cfg)
        self.keep_decode_state = keep_decode_state  # the cache, slot state and graphs outlive a rollout
        self._state: _DecodeState | None = None  # what the last wave left (kept only under keep_decode_state)
        self.prefix_pack_tokens = prefix_pack_tokens  # the prefill's packing (prefix_forward's pack_tokens)
        # ... when the prefill is the actor prefix stage (its graph, or its recomputation, per pack)
        self.actor_pack_tokens = prefix_pack_tokens if actor_pack_tokens is None else actor_pack_tokens
        # packs end where the requests' PPO mini-batches do (train.ppo_mini_batches): an update packs the same way
        self.pack_splits = pack_splits
        self.max_prompt_len, self.max_response_len = max_prompt_len, max_response_len
        self.budget = int(kv_cache_gib * 2**30)
        self.dev = device()
        self.cuda_graphs = cuda_graphs and torch.cuda.is_available()
        tc = unwrap(model).config
        self.attention = _decode_attention(decode_attention, tc.params_dtype, self.dev, tc.kv_channels)
        _check_sampling_kernel(sampling_kernel, self.dev)
        self.sampling_kernel = sampling_kernel
        self.pp = ps.get_pipeline_model_parallel_world_size()
        # the Triton attention also takes RoPE and the cache write (forward_decode); the whole step on one stage
        self.fused_rope = self.attention == "triton" and self.pp == 1 and fused_rope
        self.fused_norm = self.attention == "triton" and fused_norm  # the decode step's RMSNorms as one kernel each
        # the decoder's layers with the glue between the GEMMs fused (models/decode_layers.py), where it computes
        # what the modules do; its norms are the fused norm's arithmetic, so it goes with fused_rope and fused_norm
        self.layer_error = decode_layers_unsupported(unwrap(model)) if self.fused_rope and self.fused_norm else ""
        self.fused_layer = self.fused_rope and self.fused_norm and fused_layer and not self.layer_error
        self.decode_gemm = decode_gemm if self.fused_layer else "torch"  # the Triton GEMMs ride the fused layer path
        self.graph_error = ""  # why CUDA-graph decode was turned off, if it was
        if self.cuda_graphs and self.pp > 1:  # the stage-to-stage sends are not captured
            self.cuda_graphs = False
            self.graph_error = "parallel.pp > 1: decode runs eagerly"
        if self.cuda_graphs and ps.get_tensor_model_parallel_world_size() > 1:
            backend = torch.distributed.get_backend(ps.get_tensor_model_parallel_group())
            if backend != "nccl":  # the TP all-reduces are captured into the step's graph: NCCL only
                self.cuda_graphs = False
                self.graph_error = f"parallel.tp > 1 over {backend}: decode runs eagerly (graphs need NCCL)"

    @classmethod
    def for_run(cls, model, cfg, actor_pack_tokens: int | None = None) -> "EmbeddedEngine":
        """An engine over `model` with a run's rollout, KV-budget and packing settings (`RunConfig`)."""
        r = cfg.rollout
        eng = cls(model, cfg.model, r.max_prompt_len, r.max_response_len, cfg.memory.kv_cache_gib, r.cuda_graphs,
                  r.decode_attention, sampling_kernel=r.sampling_kernel, fused_layer=r.layer_kernel != "modules",
                  prefix_pack_tokens=cfg.workload.prefix_pack_tokens, actor_pack_tokens=actor_pack_tokens,
                  keep_decode_state=r.keep_decode_state, pack_splits=cfg.train.ppo_mini_batches,
                  decode_gemm=r.decode_gemm)
        if (r.layer_kernel == "triton" or r.decode_gemm != "torch") and not eng.fused_layer:
            name = "layer_kernel" if r.layer_kernel == "triton" else "decode_gemm"
            _layer_kernel_refused(eng.layer_error or _layer_path_needs(eng.attention, eng.pp), name, getattr(r, name))
        return eng

    def generate(self, requests: list[RolloutRequest], params: SamplingParams,
                 hooks: DecodeHooks | None = None, actor_prefix: KVStore | None = None,
                 recompute_prefix: bool = False) -> RolloutOutput:
        """Sample every request (see RolloutEngine); waves when the cache budget is exceeded.

        `actor_prefix`: the prefill is the actor prefix stage; its K/V leaves land in this store and
        the returned `prefix_states` drive the prefix backward. With `recompute_prefix` the prefill
        keeps no graph (the prefix backward recomputes it one group, or one pack, at a time)."""
        self._validate(requests)
        hooks = hooks if hooks is not None else DecodeHooks()
        results: list[RolloutResult | None] = [None] * len(requests)
        try:
            stats, states = self._generate_waves(requests, params, hooks, actor_prefix, recompute_prefix, results)
        except BaseException:
            # a kept state is not reused after a failure: the failed step's queued work may still write into its
            # tensors after the next wave's in-place refill, and a graph may have been left half captured
            self._state = None
            hooks.abort()  # side work issued from another thread stops with the rollout
            raise
        hooks.on_idle()
        return RolloutOutput(results, states if actor_prefix is not None else [], stats)

    def _generate_waves(self, requests, params, hooks, actor_prefix, recompute_prefix, results):
        states, stats = [], {"decode_steps": 0, "waves": 0, "prefill_s": 0.0, "decode_s": 0.0, "graphs_captured": 0,
                             "graph_replays": 0, "eager_steps": 0, "capture_s": 0.0, "attention": self.attention,
                             "sampling": "", "states_reused": 0}
        starts = mini_batch_starts(len(requests), self.pack_splits)
        for wave in self._waves(requests):
            t0 = time.perf_counter()
            store = actor_prefix if actor_prefix is not None else KVStore()
            groups = [Group(requests[i].prompt, [], torch.zeros(0)) for i in wave]
            graph = actor_prefix is not None and not recompute_prefix
            with torch.set_grad_enabled(graph):
                states += prefix_forward(self.model, groups, store, keep_graph=graph, group_ids=wave,
                                         recompute=actor_prefix is not None and recompute_prefix,
                                         pack_tokens=self.prefix_pack_tokens if actor_prefix is None
                                         else self.actor_pack_tokens, pack_starts=starts)
            state = self._wave_state(store, [requests[i] for i in wave], wave, params)
            stats["states_reused"] += int(state.tensors is not None)
            cache = state.cache
            if actor_prefix is None:
                for i in wave:
                    store.release(i)
            t1 = time.perf_counter()
            with torch.no_grad():
                dec = _WaveDecoder(self, [requests[i] for i in wave], state, params)
                hooks.on_wave(dec.n_rows)
                stream = hooks.decode_stream()
                if stream is not None:
                    stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream) if stream is not None else nullcontext():
                    stats["decode_steps"] += dec.run(hooks, wave, results)
                if stream is not None:
                    torch.cuda.current_stream().wait_stream(stream)
                for k in ("graphs_captured", "graph_replays", "eager_steps", "capture_s"):
                    stats[k] += dec.stats[k]
                stats["sampling"] = "triton" if dec.fused_sampling else "torch"
                del dec, cache, state
            stats["prefill_s"] += t1 - t0
            stats["decode_s"] += time.perf_counter() - t1
            stats["waves"] += 1
        return stats, states

    def _wave_state(self, store: KVStore, reqs: list[RolloutRequest], store_ids: list[int],
                    params: SamplingParams) -> _DecodeState:
        """The wave's cache (filled from `store`) and decoding state: the kept one when its key matches and it
        is large enough, else a new one (kept for later waves under `keep_decode_state`)."""
        dtype = unwrap(self.model).config.params_dtype
        rows, max_new = [r.n for r in reqs], max(r.max_new_tokens for r in reqs)
        if not self.keep_decode_state:
            return _DecodeState((), DecodeCache.for_wave(store, store_ids, rows, max_new, dtype))
        layers, lens, ng, d, dev = DecodeCache.layout(store, store_ids)
        key = (len(reqs), sum(rows), max([len(r.stop_token_ids) for r in reqs] + [1]), tuple(layers), ng, d,
               (params.temperature, params.top_k, params.top_p), self._weights_key())
        st = self._state
        if st is None or st.key != key or st.cache.prefix_pad < max(lens) or st.cache.max_new < max_new:
            grow = st is not None and st.key == key  # a longer wave of the same shape: keep the larger sizes
            pad = max(max(lens), st.cache.prefix_pad if grow else 0)
            max_new = max(max_new, st.cache.max_new if grow else 0)
            self._state = st = None  # the old cache and graphs go before the new ones are allocated
            st = _DecodeState(key, DecodeCache(layers, len(reqs), pad, sum(rows), max_new, ng, d, dtype, dev))
            self._state = st
        st.cache.fill(store, store_ids, reused=st.tensors is not None)
        return st

    def _weights_key(self) -> tuple:
        """The tensors a captured step reads besides the state (parameters and buffers), by address: graphs
        are kept only while they are the same tensors (a rebuilt or reloaded model gets new graphs)."""
        return tensors_key(unwrap(self.model))

    def _validate(self, requests: list[RolloutRequest]) -> None:
        vocab = self.cfg.vocab_size
        for i, r in enumerate(requests):
            n_p = r.prompt.input_ids.numel()
            if n_p > self.max_prompt_len:
                raise ValueError(f"request {i}: prompt of {n_p} tokens exceeds rollout.max_prompt_len="
                                 f"{self.max_prompt_len}; raise it or shorten the prompt")
            if n_p < 2:
                raise ValueError(f"request {i}: prompt needs at least 2 tokens")
            if not 1 <= r.max_new_tokens <= self.max_response_len:
                raise ValueError(f"request {i}: max_new_tokens={r.max_new_tokens} must be in 1.."
                                 f"rollout.max_response_len={self.max_response_len}")
            if r.n < 1:
                raise ValueError(f"request {i}: n={r.n} samples; need >= 1")
            try:  # on the host prompt, before any model work
                self.spec.vision.check_placeholders(self.cfg, r.prompt.input_ids[:-1], r.prompt.pixel_values,
                                                    r.prompt.image_grid_thw, r.prompt.pixel_values_videos,
                                                    r.prompt.video_grid_thw)
            except ValueError as e:
                raise ValueError(f"request {i}: {e}") from None
            bad = [t for t in r.stop_token_ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"request {i}: stop token ids {bad} outside the vocabulary (0..{vocab - 1})")

    def _waves(self, requests: list[RolloutRequest]) -> list[list[int]]:
        """Requests grouped so each wave's cache fits the budget (back-pressure, never truncation)."""
        m = unwrap(self.model)
        tp, elt = ps.get_tensor_model_parallel_world_size(), m.config.params_dtype.itemsize
        layers = m.language_model.decoder.num_layers_per_pipeline_rank
        waves, cur, used = [], [], 0
        for i, r in enumerate(requests):
            need = DecodeCache.nbytes(self.cfg, tp, layers, r.prompt.input_ids.numel() - 1, r.n, r.max_new_tokens, elt)
            if need > self.budget:
                raise ValueError(f"request {i}: its KV cache needs {need / 2**20:.3f} MiB, more than "
                                 f"memory.kv_cache_gib ({self.budget / 2**20:.3f} MiB); raise the budget or lower "
                                 f"rollout.group_size / max_new_tokens")
            if cur and used + need > self.budget:
                waves.append(cur)
                cur, used = [], 0
            cur.append(i)
            used += need
        return waves + [cur] if cur else waves


def kv_group_bytes(cfg, source, samples: int, whole_layers: bool) -> int:
    """The KV cache one group of the source's longest prompt (`source.longest_prompt`) and `samples` responses
    of `source.max_new_tokens` occupies on a rank of the engine: `_waves`'s bound. `whole_layers`: a rollout
    model of its own (replicas at `rollout.tp`, the rollout ranks) holds every layer; the actor's modules a
    pipeline stage of them."""
    tp = (cfg.rollout.tp or cfg.parallel.tp) if whole_layers else cfg.parallel.tp
    layers = cfg.model.num_layers // (1 if whole_layers else cfg.parallel.pp)
    elt = cfg.param_bytes
    return DecodeCache.nbytes(cfg.model, tp, layers, source.longest_prompt[0] - 1, samples, source.max_new_tokens,
                              elt)


def check_kv_budget(cfg, source, samples: dict[str, int], whole_layers: bool) -> None:
    """One group of the source's longest prompt with the largest of `samples` (setting -> responses a group)
    must fit `memory.kv_cache_gib`, which the engine checks for each request in the first step: checked here
    when the source is built, before any model (the embedded engine only; SGLang sizes its own pool).
    `whole_layers` as in `kv_group_bytes`."""
    if cfg.rollout.engine != "embedded":
        return
    setting, n = max(samples.items(), key=lambda kv: kv[1])
    need = kv_group_bytes(cfg, source, n, whole_layers)
    if need > int(cfg.memory.kv_cache_gib * 2**30):
        length = "task.max_answer_tokens" if source.name == "rendered" else "rollout.max_response_len"
        tokens, what = source.longest_prompt
        raise ValueError(f"memory.kv_cache_gib={cfg.memory.kv_cache_gib:g} is too small: one group of {what} "
                         f"({tokens} tokens) with {setting}={n} responses of up to {length}="
                         f"{source.max_new_tokens} tokens needs {need / 2**30:.3g} GiB of KV cache; raise "
                         f"memory.kv_cache_gib or lower {setting} / {length}")


def check_decode_settings(cfg) -> None:
    """The decode kernel settings (`rollout.decode_attention`, `sampling_kernel`, `layer_kernel`) against this
    device, dtype and `parallel.pp`, before any model is built: a one-line error naming the setting. The engine
    checks them again on the model it decodes with (and what only the model can tell, decode_layers_unsupported)."""
    r, dev = cfg.rollout, device()
    attention = _decode_attention(r.decode_attention, getattr(torch, cfg.dtype), dev, cfg.model.head_dim)
    _check_sampling_kernel(r.sampling_kernel, dev)
    for name, off in (("layer_kernel", "modules"), ("decode_gemm", "torch")):
        if getattr(r, name) not in (off, "auto") and (attention != "triton" or cfg.parallel.pp > 1):
            _layer_kernel_refused(_layer_path_needs(attention, cfg.parallel.pp), name, getattr(r, name))


def _check_sampling_kernel(kernel: str, dev) -> None:
    """rollout.sampling_kernel=triton where the fused draw cannot run: refused, naming the setting."""
    if kernel == "triton" and not (fused_sample_available(dev) or TRITON_INTERPRET):
        raise ValueError(f"rollout.sampling_kernel=triton needs CUDA (here: {torch.device(dev).type}); "
                         f"use auto or torch")


def _layer_path_needs(attention: str, pp: int) -> str:
    """Why the fused layer path does not run under `attention` at pipeline size `pp` (what is missing only)."""
    why = []
    if attention != "triton":
        why.append(f"the decode attention is {attention} (it needs rollout.decode_attention=triton, which runs on "
                   f"CUDA)")
    if pp > 1:
        why.append(f"parallel.pp={pp} (it needs 1)")
    return " and ".join(why)


def _layer_kernel_refused(why: str, name: str = "layer_kernel", value: str = "triton") -> None:
    fix = "rollout.layer_kernel=modules" if name == "layer_kernel" else "rollout.decode_gemm=torch"
    raise ValueError(f"rollout.{name}={value} cannot run here: {why}; use {fix}")


def _decode_attention(choice: str, dtype, dev, head_dim: int) -> str:
    """The decode attention path: `choice`, or for auto the first of triton, flash, math that can run."""
    can = {"triton": triton_decode_available(dtype, dev, head_dim) or (choice == "triton" and TRITON_INTERPRET),
           "flash": flash_varlen_available(dtype, dev, head_dim), "math": True}
    if choice == "auto":
        return next(k for k, ok in can.items() if ok)
    if not can[choice]:
        need = {"triton": "a power-of-two head dim in 16..256",
                "flash": "sm80+, a torch build with flash attention, a head dim <= 256 and a multiple of 8"}[choice]
        raise ValueError(f"rollout.decode_attention={choice} needs CUDA and bf16/fp16 weights with {need} (here: "
                         f"{dtype}, head dim {head_dim} on {torch.device(dev).type}); use auto or math")
    return choice


class _WaveDecoder:
    """Batched decode of one wave in slot order: slots [0, live) hold the live samples.

    A step runs the actor on the slots of a batch-size bucket (>= live), writes their K/V, samples
    from counter-based uniforms (`row_uniforms`: request seed, sample index, step), all with static
    shapes: on GPU one CUDA graph per (bucket, samples-per-group bound, response window) replays
    it. Outside the step: the results are written in row order, finished samples are marked, and
    the one host read per step counts the live samples. When they fit a smaller bucket, the live
    slots are compacted to the front (their state and response K/V move), so finished sequences
    leave the batch.
    """

    def __init__(self, engine: "EmbeddedEngine", reqs, state: _DecodeState, params: SamplingParams):
        dev, c = engine.dev, engine.cfg
        self.engine, self.state, self.cache, self.params, self.reqs = engine, state, state.cache, params, reqs
        self.m, self.vocab = unwrap(engine.model), c.vocab_size
        counts = torch.tensor([r.n for r in reqs])
        self.first_row = counts.cumsum(0) - counts
        req_of_row = torch.repeat_interleave(torch.arange(len(reqs)), counts)
        self.n_rows, self.max_new = int(counts.sum()), self.cache.max_new  # the cache's Rm >= every request's
        self.n_groups = len(reqs)
        last_pos = torch.stack([prompt_positions(c, r.prompt)[:, 0, -1] for r in reqs])  # [Gr, 3]
        n_stop = max([len(r.stop_token_ids) for r in reqs] + [1])
        stops = torch.tensor([list(r.stop_token_ids) + [-1] * (n_stop - len(r.stop_token_ids)) for r in reqs])
        # per-slot state (slot i holds row owner[i]); compaction permutes every one of these
        slot = {
            "owner": torch.arange(self.n_rows),
            "group": req_of_row.clone(),
            "seed": torch.tensor([reqs[k].seed for k in req_of_row.tolist()]),
            "sample": torch.arange(self.n_rows) - self.first_row[req_of_row],
            "limit": torch.tensor([reqs[k].max_new_tokens for k in req_of_row.tolist()]),
            "stop": stops[req_of_row],
            "tok": torch.cat([r.prompt.input_ids[-1:].expand(r.n) for r in reqs]),
            "alive": torch.ones(self.n_rows, dtype=torch.bool),
        }
        t = state.tensors
        if t is None:  # a new state: the decoder's device tensors (a captured step reads these very tensors)
            t = state.tensors = {
                "slot": {k: v.to(dev) for k, v in slot.items()},
                "last_pos": last_pos.to(dev),
                "step": torch.zeros(1, dtype=torch.long, device=dev),
                "live": torch.zeros((), dtype=torch.long, device=dev),
                # results in row order, plus a scratch row (n_rows) that slots past the live ones write to
                "out_tok": torch.zeros(self.n_rows + 1, self.max_new, dtype=torch.long, device=dev),
                "out_lp": torch.zeros(self.n_rows + 1, self.max_new, dtype=torch.float32, device=dev),
                "length": torch.zeros(self.n_rows + 1, dtype=torch.long, device=dev),
                "stopped": torch.zeros(self.n_rows + 1, dtype=torch.bool, device=dev),
                "banned": torch.tensor(c.vision_token_ids, device=dev),
            }
        else:  # a kept state: this wave's values written into the same tensors (outputs past a length are
            # never read, so only the counters are reset)
            for k, v in slot.items():
                t["slot"][k].copy_(v)
            t["last_pos"].copy_(last_pos)
            for k in _RESET:
                t[k].zero_()
        self.slot, self.last_pos, self.step_t, self.live_t = t["slot"], t["last_pos"], t["step"], t["live"]
        self.out_tok, self.out_lp, self.length, self.stopped = t["out_tok"], t["out_lp"], t["length"], t["stopped"]
        self.banned, self.hooks = t["banned"], DecodeHooks()
        self.p2p = p2p_communicator(engine.model) if engine.pp > 1 else None
        greedy_free = params.top_k == 0 and params.top_p >= 1.0
        check_sampling_kernel(engine.sampling_kernel, params.top_k, params.top_p, "this request")
        self.fused_sampling = greedy_free and (engine.sampling_kernel == "triton" or (
            engine.sampling_kernel == "auto" and fused_sample_available(dev)))
        self.stats = {"graphs_captured": 0, "graph_replays": 0, "eager_steps": 0, "capture_s": 0.0}

    def _forward(self, n: int, s_max: int, window: int) -> None:
        """`_step`, with the language model's RMSNorms on the fused kernel where the engine uses it."""
        with fused_rms_norms(self.m.language_model) if self.engine.fused_norm else nullcontext():
            self._step(n, s_max, window)

    def _step(self, n: int, s_max: int, window: int) -> None:
        """The static-shape step on slots [0, n): logits, sampling, then `_advance`.

        Pipeline stages: each runs its layers on the hidden states the previous stage sends; the
        last stage samples and broadcasts the tokens and log-probs, so every stage advances the
        same state (stop tokens, lengths, compaction) and returns the same results."""
        st = self.slot
        group = st["group"][:n]
        pos = self.engine.spec.decode.positions(self.last_pos[group], self.step_t)  # [3, n, 1]
        slot, _ = group_slots(group, self.n_groups, s_max)  # once per step, not once per layer
        length = (self.step_t + 1).expand(n)
        c, how = self.cache, self.engine.attention
        flash = flash_index(c.prefix_len, c.prefix_pad, s_max, length, c.max_new) if how == "flash" else None
        tri = triton_index(group, slot, s_max, c.prefix_len, length) if how == "triton" else None
        ctx = DecodeContext(cache=c, n=n, group=group, step=self.step_t, s_max=s_max, window=window, slot=slot,
                            length=length, flash=flash, triton=tri, gemm=self.engine.decode_gemm)
        first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        if self.engine.fused_rope:
            out = self.m.forward_decode(st["tok"][:n, None], pos, ctx, fused_layers=self.engine.fused_layer)
        else:
            if not first:
                self.m.set_input_tensor(self.p2p.recv_forward((1, n, self.m.cfg.hidden_size), first))
            out = self.m(input_ids=st["tok"][:n, None] if first else None, position_ids=pos, attention_context=ctx,
                         check=False)  # decode feeds sampled tokens, and sampling bans the placeholders
        if not last:
            self.p2p.send_forward(out, last)
            new, lp = self._from_last_stage(n)
        else:
            full = self.engine.spec.decode.gather_logits(out, self.vocab)[:, 0]  # [n, V]
            if self.fused_sampling:  # the same draw in one pass (the placeholders banned inside)
                new, lp = fused_sample(full, self.params.temperature, st["seed"][:n], st["sample"][:n], self.step_t,
                                       self.banned)
            else:
                full = full.index_fill(1, self.banned, float("-inf"))  # vision placeholders are never emitted
                uniform = row_uniforms(st["seed"][:n], st["sample"][:n], self.step_t, self.vocab)
                new, lp = sample_tokens(full, self.params, uniform)
            if self.engine.pp > 1:
                self._from_last_stage(n, new, lp)
        self._advance(n, new, lp)

    def _from_last_stage(self, n: int, new=None, lp=None):
        """Broadcast the last stage's tokens and log-probs over the pipeline group (pp > 1)."""
        dev = self.step_t.device
        new = torch.empty(n, dtype=torch.long, device=dev) if new is None else new.contiguous()
        lp = torch.empty(n, dtype=torch.float32, device=dev) if lp is None else lp.float().contiguous()
        src, group = ps.get_pipeline_model_parallel_last_rank(), ps.get_pipeline_model_parallel_group()
        torch.distributed.broadcast(new, src, group=group)
        torch.distributed.broadcast(lp, src, group=group)
        return new, lp

    def _advance(self, n: int, new, lp) -> None:
        """Bookkeeping of the step on slots [0, n), on the device (inside the graph): results in row
        order, stop tokens and length limits, the next input token, the step counter, the live count."""
        st, step = self.slot, self.step_t.expand(n)
        alive, owner = st["alive"][:n], st["owner"][:n]
        self.out_tok.index_put_((owner, step), new)  # finished rows get garbage past their length, never read
        self.out_lp.index_put_((owner, step), lp)
        self.length.scatter_add_(0, owner, alive.long())
        hit = (st["stop"][:n] == new[:, None]).any(1) & alive
        self.stopped[owner] = self.stopped[owner] | hit
        alive &= ~hit & (step + 1 < st["limit"][:n])
        st["tok"][:n] = new
        self.step_t += 1
        self.live_t.copy_(alive.sum())

    def _run_step(self, n: int, s_max: int, window: int) -> None:
        key = (n, s_max, window)
        if not self.engine.cuda_graphs:
            self._forward(*key)
            self.stats["eager_steps"] += 1
            return
        g = self.state.graphs.get(key)
        if g is None:  # this step runs eagerly (it is also the warm-up capture needs), then is captured
            t0 = time.perf_counter()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward(*key)
            torch.cuda.current_stream().wait_stream(side)
            self.stats["eager_steps"] += 1
            self.state.pool = self.state.pool or torch.cuda.graph_pool_handle()
            g = torch.cuda.CUDAGraph()
            hooks = self.hooks
            guard = hooks.capture_guard()
            try:
                with guard, torch.cuda.graph(g, pool=self.state.pool, capture_error_mode="thread_local"):
                    self._forward(*key)  # recorded, not run: the state advanced once, above
            except Exception as e:  # steps that cannot be captured run eagerly, and say why
                self.state.graphs.clear()  # never replayed now: their pool goes with them
                self.state.pool = None
                self.engine.cuda_graphs = False
                self.engine.graph_error = f"{type(e).__name__}: {e}"[:500]
                torch.cuda.current_stream().synchronize()
                return
            self.state.graphs[key] = g
            self.stats["graphs_captured"] += 1
            # capture is rare (a new bucket or window); its time is reported apart. (Entering the capture
            # already synchronised the whole device, side-stream work included: torch.cuda.graph does.)
            torch.cuda.current_stream().synchronize()
            self.stats["capture_s"] += time.perf_counter() - t0
            return
        g.replay()
        self.stats["graph_replays"] += 1

    def window(self, step: int) -> int:
        """Response positions step `step` attends. Flash and Triton read each sample's keys up to its length,
        so one window (one graph per bucket) serves every step; the math path slices the window it
        attends (one graph per window size)."""
        return _window(step, self.max_new) if self.engine.attention == "math" else self.max_new

    def _s_max(self, n: int) -> int:
        return int(torch.bincount(self.slot["group"][:n], minlength=self.n_groups).max())

    def _compact(self, n: int, live: int) -> None:
        """Move the live slots among [0, n) to [0, live), with their response K/V."""
        idx = self.slot["alive"][:n].nonzero()[:, 0]
        for v in self.slot.values():
            v[:live] = v[idx]
        self.slot["alive"][live:n] = False  # the slots behind the live ones are dead copies
        self.slot["owner"][live:n] = self.n_rows  # and write to the scratch row
        for r in self.cache.resp.values():
            r[:, :live] = r[:, idx]

    def run(self, hooks, ids, results) -> int:
        """Decode until every sample stopped; fills `results[ids[k]]`; returns the step count."""
        self.hooks = hooks if hooks is not None else DecodeHooks()
        hooks = self.hooks
        buckets = _buckets(self.n_rows)
        n, step = self.n_rows, 0
        s_max = self._s_max(n)
        while True:
            self._run_step(n, s_max, self.window(step))
            step += 1
            live = int(self.live_t)  # the step's one host read
            hooks.on_decode_step(step, live)
            if live == 0:
                break
            smaller = min(b for b in buckets if b >= live)
            if smaller < n:
                self._compact(n, live)
                n = smaller
                s_max = self._s_max(n)
        tok, lp, length, stopped = self.out_tok.cpu(), self.out_lp.cpu(), self.length.cpu(), self.stopped.cpu()
        for k, r in enumerate(self.reqs):
            rows = range(int(self.first_row[k]), int(self.first_row[k]) + r.n)
            results[ids[k]] = RolloutResult([tok[i, :length[i]] for i in rows], [lp[i, :length[i]] for i in rows],
                                            ["stop" if stopped[i] else "length" for i in rows])
        return step
