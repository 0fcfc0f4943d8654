"""The embedded rollout engine: the actor's own Megatron modules, in place, at the training TP.

Legend: Gr = groups (requests) of a wave, P = padded prefix length, Rm = max new tokens,
B = active samples, Ng = KV groups per TP rank, D = head dim, L = decoder layers.

Prefill is the prefix stage (`prefix.execution.prefix_forward`) over prompt[:-1], once per
request; its K/V go into the engine's cache once per group and are shared by the group's G
samples. Decode feeds [prompt[-1], sampled tokens...] at the positions the response stage uses, so
a rollout's log-probs are the training forward's log-probs. Finished samples leave the batch. The
cache is sized per wave from `memory.kv_cache_gib`; requests that do not fit wait for the next wave.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from megatron.core import parallel_state as ps

from rollplex_megatron.attention.decode import shared_prefix_decode_attention
from rollplex_megatron.attention.prefix import AttentionContext, KVStore
from rollplex_megatron.config import ModelConfig
from rollplex_megatron.memory.planner import kv_bytes_per_token
from rollplex_megatron.models.qwen25vl.model import gather_vocab_logits
from rollplex_megatron.prefix.batch import Group, prompt_positions
from rollplex_megatron.prefix.execution import prefix_forward, unwrap
from rollplex_megatron.rollout.engine import DecodeHooks, RolloutOutput, RolloutRequest, RolloutResult
from rollplex_megatron.rollout.sampling import SamplingParams, request_generator, sample_tokens


class DecodeCache:
    """Prefix K/V once per group and response K/V per sample, per layer, for one wave."""

    def __init__(self, store: KVStore, store_ids: list[int], rows_per_group: list[int], max_new: int, dtype):
        layers = sorted({layer for layer, g in store.leaves if g == store_ids[0]})
        k0 = store.leaves[(layers[0], store_ids[0])][0]
        ng, d, dev = k0.shape[2], k0.shape[3], k0.device
        lens = [store.leaves[(layers[0], g)][0].shape[0] for g in store_ids]
        p_max, n_rows = max(lens), sum(rows_per_group)
        self.prefix_len = torch.tensor(lens, device=dev)
        self.group_of_row = torch.repeat_interleave(torch.arange(len(store_ids), device=dev),
                                                    torch.tensor(rows_per_group, device=dev))
        self.prefix, self.resp = {}, {}
        for layer in layers:
            pk = torch.zeros(2, len(store_ids), p_max, ng, d, dtype=dtype, device=dev)
            for i, g in enumerate(store_ids):
                k, v = store.leaves[(layer, g)]
                pk[0, i, :lens[i]], pk[1, i, :lens[i]] = k[:, 0].detach(), v[:, 0].detach()
            self.prefix[layer] = pk
            self.resp[layer] = torch.zeros(2, n_rows, max_new, ng, d, dtype=dtype, device=dev)

    @staticmethod
    def nbytes(cfg: ModelConfig, tp: int, layers: int, prefix_len: int, rows: int, max_new: int, elt: int) -> int:
        """Bytes one group occupies: K and V of its prefix once plus `rows` response slots."""
        return kv_bytes_per_token(cfg, tp, layers, elt) * (prefix_len + rows * max_new)

    def attend(self, layer: int, rows, step: int, query, key, value, scale):
        """Write this step's K/V of `rows`, then shared-prefix attention; [1,B,Nq*D]."""
        r = self.resp[layer]
        r[0, rows, step], r[1, rows, step] = key[0], value[0]
        p = self.prefix[layer]
        n = torch.full((rows.numel(),), step + 1, device=rows.device)
        out = shared_prefix_decode_attention(query[0], p[0], p[1], self.prefix_len, self.group_of_row[rows],
                                             r[0, rows, :step + 1], r[1, rows, :step + 1], n, scale)
        return out[None]


@dataclass
class DecodeContext(AttentionContext):
    """Attention context of one decode step (reaches core attention as `packed_seq_params`)."""

    cache: DecodeCache | None = None
    rows: torch.Tensor | None = None  # active cache rows, in batch order
    step: int = 0

    def __post_init__(self) -> None:
        self.qkv_format = "sbhd"

    def attend(self, layer: int, query, key, value, scale):
        """Decode attention for this step's queries [1,B,Nq,D]."""
        return self.cache.attend(layer, self.rows, self.step, query, key, value, scale)


class EmbeddedEngine:
    """RolloutEngine on the actor's Megatron modules (no weight copy), pipeline size 1."""

    def __init__(self, model, cfg: ModelConfig, max_prompt_len: int, max_response_len: int, kv_cache_gib: float):
        if ps.get_pipeline_model_parallel_world_size() != 1:
            raise ValueError("the embedded rollout engine runs at parallel.pp=1; use parallel.pp=1 for training "
                             "runs (prefix/response execution itself supports pp>1)")
        self.model, self.cfg = model, cfg
        self.max_prompt_len, self.max_response_len = max_prompt_len, max_response_len
        self.budget = int(kv_cache_gib * 2**30)
        self.dev = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"

    def generate(self, requests: list[RolloutRequest], params: SamplingParams,
                 hooks: DecodeHooks | None = None, actor_prefix: KVStore | None = None,
                 recompute_prefix: bool = False) -> RolloutOutput:
        """Sample every request (see RolloutEngine); waves when the cache budget is exceeded.

        `actor_prefix`: the prefill is the actor prefix stage; its K/V leaves land in this store and
        the returned `prefix_states` drive the prefix backward. With `recompute_prefix` the prefill
        keeps no graph (the prefix backward recomputes it one group at a time)."""
        self._validate(requests)
        results: list[RolloutResult | None] = [None] * len(requests)
        states, stats = [], {"decode_steps": 0, "waves": 0, "prefill_s": 0.0, "decode_s": 0.0}
        for wave in self._waves(requests):
            t0 = time.perf_counter()
            store = actor_prefix if actor_prefix is not None else KVStore()
            groups = [Group(requests[i].prompt, [], torch.zeros(0)) for i in wave]
            graph = actor_prefix is not None and not recompute_prefix
            with torch.set_grad_enabled(graph):
                states += prefix_forward(self.model, groups, store, keep_graph=graph, group_ids=wave,
                                         recompute=actor_prefix is not None and recompute_prefix)
            cache = DecodeCache(store, wave, [requests[i].n for i in wave],
                                max(requests[i].max_new_tokens for i in wave), unwrap(self.model).config.params_dtype)
            if actor_prefix is None:
                for i in wave:
                    store.release(i)
            t1 = time.perf_counter()
            with torch.no_grad():
                stats["decode_steps"] += self._decode([requests[i] for i in wave], wave, cache, params, hooks, results)
            stats["prefill_s"] += t1 - t0
            stats["decode_s"] += time.perf_counter() - t1
            stats["waves"] += 1
        if hooks is not None:
            hooks.on_idle()
        return RolloutOutput(results, states if actor_prefix is not None else [], stats)

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

    def _decode(self, reqs, ids, cache: DecodeCache, params, hooks, results) -> int:
        """Batched decode of one wave; fills `results[ids[k]]`. Returns the number of steps.

        Per-row state lives in device tensors, so a step costs one host sync (the active rows,
        which pick each live request's uniforms), not one per row.
        """
        dev, vocab, m, c = self.dev, self.cfg.vocab_size, unwrap(self.model), self.cfg
        counts = torch.tensor([r.n for r in reqs])
        first_row = counts.cumsum(0) - counts
        req_of_row = torch.repeat_interleave(torch.arange(len(reqs)), counts)
        req_of_row_dev = req_of_row.to(dev)
        n_rows, max_new = int(counts.sum()), max(r.max_new_tokens for r in reqs)
        last_pos = torch.stack([prompt_positions(c, r.prompt)[:, 0, -1] for r in reqs]).to(dev)  # [Gr, 3]
        limit = torch.tensor([r.max_new_tokens for r in reqs], device=dev)[req_of_row_dev]
        n_stop = max([len(r.stop_token_ids) for r in reqs] + [1])
        stop_ids = torch.tensor([list(r.stop_token_ids) + [-1] * (n_stop - len(r.stop_token_ids)) for r in reqs],
                                device=dev)[req_of_row_dev]  # [rows, S], -1 pads
        banned = torch.tensor([c.image_token_id, c.video_token_id, c.vision_start_token_id, c.vision_end_token_id],
                              device=dev)
        tok = torch.cat([r.prompt.input_ids[-1:].expand(r.n) for r in reqs]).to(dev)
        out_tok = torch.zeros(n_rows, max_new, dtype=torch.long, device=dev)
        out_lp = torch.zeros(n_rows, max_new, dtype=torch.float32, device=dev)
        length = torch.zeros(n_rows, dtype=torch.long, device=dev)
        stopped = torch.zeros(n_rows, dtype=torch.bool, device=dev)
        gens = [request_generator(r.seed, dev) for r in reqs]
        active, step = torch.arange(n_rows, device=dev), 0
        while active.numel():
            pos = (last_pos[cache.group_of_row[active]] + step).T[:, :, None]  # [3, B, 1]
            logits = m(input_ids=tok[active][:, None], position_ids=pos,
                       attention_context=DecodeContext(cache=cache, rows=active, step=step))
            full = gather_vocab_logits(logits, vocab)[:, 0]  # [B, V]
            full[:, banned] = float("-inf")  # vision placeholders are never text the model may emit
            act_cpu = active.cpu()
            uniform = torch.empty_like(full, dtype=torch.float32)
            for k in torch.unique(req_of_row[act_cpu]).tolist():  # one draw per live request per step
                u = torch.rand(reqs[k].n, vocab, generator=gens[k], device=dev)
                sel = (req_of_row[act_cpu] == k).nonzero()[:, 0]
                uniform[sel.to(dev)] = u[(act_cpu[sel] - first_row[k]).to(dev)]
            new, lp = sample_tokens(full, params, uniform)
            tok[active], out_tok[active, step], out_lp[active, step] = new, new, lp
            length[active] = step + 1
            hit = (stop_ids[active] == new[:, None]).any(1)
            stopped[active[hit]] = True
            active = active[~(hit | (step + 1 >= limit[active]))]
            step += 1
            if hooks is not None:
                hooks.on_decode_step(step, int(active.numel()))
        out_tok, out_lp, length, stopped = out_tok.cpu(), out_lp.cpu(), length.cpu(), stopped.cpu()
        for k, r in enumerate(reqs):
            rows = range(int(first_row[k]), int(first_row[k]) + r.n)
            results[ids[k]] = RolloutResult([out_tok[i, :length[i]] for i in rows], [out_lp[i, :length[i]] for i in rows],
                                            ["stop" if stopped[i] else "length" for i in rows])
        return step
