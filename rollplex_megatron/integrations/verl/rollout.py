"""The `rollplex` rollout backend for verl (`actor_rollout_ref.rollout.name=rollplex`).

verl's hybrid rollout has three parts, each given here:
- `RollplexReplica` (registered in `RolloutReplicaRegistry`): one replica per rollout TP x PP ranks of verl's
  colocated worker group; it starts one `RollplexServer` actor for them.
- `RollplexServer`: takes the agent loop's `generate` calls (one per sample), waits until they stop arriving
  (`BATCH_QUIET_S`), merges the samples of one prompt (ids and every processor tensor equal) into one request of
  `n` samples, so the prompt is prefilled once and its K/V shared in decode, and runs the batch on every rank of
  its replica at once. Its samples come back as verl's `TokenOutput` (tokens, log-probs of the
  temperature-scaled logits, the stop reason).
- `RollplexRollout` (registered in `_ROLLOUT_REGISTRY` for `("rollplex", "async")`): the worker-side rollout
  inside verl's worker process. It runs this project's embedded engine (`rollout/embedded.py`) on the actor
  engine's own modules: there is no second copy, so verl's weight sync (`update_weights`) has nothing to do and
  does not read the weights. `release` (verl's sleep, with `free_cache_engine`) drops the engine's kept decode
  state (cache, slot state); without `free_cache_engine` it is kept for the next rollout.
The images go through the processor as verl's agent loop does (`_compute_multi_modal_inputs`: the prompt's
collapsed placeholders decoded and re-expanded by the processor), so the rollout's prompt is the batch's.
Sampling seeds derive from the prompt, the rollout's round (one per sleep) and the request's place among that
prompt's requests in the round, so two runs of one configuration sample the same tokens.
"""
from __future__ import annotations

import asyncio
import logging
import os
import zlib
from functools import partial

import ray
import torch
from megatron.core import parallel_state as ps
from verl.workers.rollout import base as rollout_base
from verl.workers.rollout.base import BaseRollout
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.tokenizer import build_multimodal_processor_inputs, get_processor_token_id
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, RolloutReplicaRegistry, TokenOutput

from rollplex_megatron.attention.kv_store import KVStore
from rollplex_megatron.integrations.verl.batch import PROMPT_FIELDS, same_prompt
from rollplex_megatron.integrations.verl.held import HeldPrefixes
from rollplex_megatron.integrations.verl.window import ENV_MECHANISM
from rollplex_megatron.prefix import execution as X
from rollplex_megatron.prefix.batch import Prompt
from rollplex_megatron.rollout.embedded import EmbeddedEngine
from rollplex_megatron.rollout.engine import RolloutRequest
from rollplex_megatron.rollout.sampling import SamplingParams
from rollplex_megatron.rollout.window import DecodeWindow, layout_mechanism
from rollplex_megatron.trainer.modes.rollplex import reference_prefix_item

log = logging.getLogger(__name__)
NAME = "rollplex"
ENV_KV_GIB = "ROLLPLEX_VERL_KV_CACHE_GIB"  # the embedded engine's KV budget per rank (default 1 GiB)
# on (default) | off: the prefill's K/V held for the old log-probs, the reference prefix stage in the decode window
ENV_WINDOW = "ROLLPLEX_VERL_WINDOW"
WINDOW_MODES = ("on", "off")  # ENV_WINDOW's values
BATCH_QUIET_S = 0.5  # a batch runs once no generate call arrived for this long
STOP_REASONS = {"stop": "completed", "length": "completed"}  # verl's: "completed" | "aborted"


# -- worker side ------------------------------------------------------------------------------------------------
class RollplexRollout(BaseRollout):
    """verl's worker-side rollout: the embedded engine on the actor's modules (see the module docstring)."""

    def __init__(self, config, model_config, device_mesh, *args, **kwargs):
        super().__init__(config, model_config, device_mesh)
        tp, pp = self.config.tensor_model_parallel_size, self.config.pipeline_model_parallel_size
        if ps.model_parallel_is_initialized() and (tp, pp) != (ps.get_tensor_model_parallel_world_size(),
                                                               ps.get_pipeline_model_parallel_world_size()):
            raise ValueError(f"rollout.name=rollplex decodes on the actor's own modules: set actor_rollout_ref."
                             f"rollout.tensor_model_parallel_size={ps.get_tensor_model_parallel_world_size()} and "
                             f"pipeline_model_parallel_size={ps.get_pipeline_model_parallel_world_size()} (the "
                             f"actor's), not {tp} and {pp}")
        if self.config.data_parallel_size != 1:
            raise ValueError("rollout.name=rollplex: rollout.data_parallel_size must be 1 (each replica is one "
                             "model-parallel group of the actor)")
        self.engine: EmbeddedEngine | None = None
        self.released = 0  # verl's sleeps that dropped the decode state
        self.global_steps = None  # the weights' version (verl's trainer reads it from every sample)

    def engine_over(self, actor_engine) -> EmbeddedEngine:
        """The embedded engine over the actor engine's modules (built once; the modules are the actor's)."""
        if self.engine is None:
            c = self.config
            self.engine = EmbeddedEngine(actor_engine.module, actor_engine.cfg, c.prompt_length + c.response_length,
                                         c.response_length, float(os.environ.get(ENV_KV_GIB, "1")),
                                         keep_decode_state=True)
        return self.engine

    def generate_batch(self, actor_engine, batch: list[dict], params: dict, round_: int = 0,
                       ref_engine=None) -> list[dict]:
        """Sample each merged request of `batch` on this rank (every rank of the replica runs the same batch). With
        the window on (`ROLLPLEX_VERL_WINDOW`), the prefill's K/V are held for the actor's old log-probs and the
        reference prefix stage of each request runs in the decode window, held for the reference's (`held.py`)."""
        engine = self.engine_over(actor_engine)
        requests = [RolloutRequest(Prompt(r["input_ids"], **{k: r.get(k) for k in PROMPT_FIELDS}), r["n"],
                                   r["max_new_tokens"], tuple(r["stop"]), r["seed"]) for r in batch]
        actor_held, ref_held = prefix_holders(actor_engine, ref_engine, round_)
        hooks, ref_kv = None, KVStore()
        if ref_held is not None:
            tp = ps.get_tensor_model_parallel_world_size()
            hooks = DecodeWindow(layout_mechanism(os.environ.get(ENV_MECHANISM, "auto"), tp, engine.pp,
                                                  torch.cuda.is_available()))
            for i, req in enumerate(requests):  # the same items in the same order on every rank (TP collectives)
                hooks.submit(f"reference_prefix[{round_}.{i}]",
                             partial(reference_prefix_item, ref_engine.module, [req.prompt], ref_kv, [i]))
        actor_kv = KVStore() if actor_held is not None else None
        module = actor_engine.module
        training = module.training
        module.eval()
        try:
            with torch.no_grad():
                out = engine.generate(requests, SamplingParams(**params), hooks=hooks, actor_prefix=actor_kv,
                                      recompute_prefix=True)
        finally:
            module.train(training)
        dtype = X.unwrap(module).config.params_dtype
        for i, req in enumerate(requests):
            if actor_held is not None:
                actor_held.hold(req.prompt, actor_kv, i, actor_engine.updates, dtype)
            if ref_held is not None:
                ref_held.hold(req.prompt, ref_kv, i, ref_engine.updates, dtype)
        return [{"tokens": [t.tolist() for t in r.tokens], "logprobs": [lp.tolist() for lp in r.logprobs],
                 "finish": r.finish_reasons, "global_steps": self.global_steps} for r in out.results]

    async def resume(self, tags: list[str]):
        """The weights are the actor's and the cache is allocated per rollout: nothing to bring back."""

    async def update_weights(self, weights, wire_format: str = "named_tensors", global_steps: int | None = None,
                             **kwargs):
        """Free: the engine decodes on the actor's modules, so `weights` is not read (no gather runs); the step
        is kept, as verl's vLLM server keeps it, for each sample's `global_steps`."""
        if global_steps is not None:
            self.global_steps = global_steps

    async def release(self):
        """verl's sleep: drop the kept decode state (cache, slot state) until the next rollout."""
        self.drop_state()

    def drop_state(self) -> None:
        """Drop the engine's kept decode state, if any (the next rollout allocates a new one)."""
        if self.engine is not None and self.engine._state is not None:
            self.engine._state = None
            self.released += 1


def prefix_holders(actor_engine, ref_engine, round_: int) -> tuple:
    """(actor's, reference's) `HeldPrefixes` for this rollout round, each None where nothing is held: the window
    off (`ROLLPLEX_VERL_WINDOW=off`), no reference engine in this process, or an engine that does not share
    prefixes (`ROLLPLEX_VERL_PREFIX=full`: its scoring reads no prefix K/V)."""
    mode = os.environ.get(ENV_WINDOW, "on")
    if mode not in WINDOW_MODES:
        raise ValueError(f"{ENV_WINDOW}={mode!r}; use on or off")
    holders = []
    for engine, role in ((actor_engine, "actor"), (ref_engine, "reference")):
        if mode == "off" or engine is None or not getattr(engine, "share_prefix", False):
            holders.append(None)
            continue
        if not isinstance(engine.window, HeldPrefixes):
            engine.window = HeldPrefixes(role)
        engine.window.start_round(round_)
        holders.append(engine.window)
    return tuple(holders)


def worker_generate(worker, batch: list[dict], params: dict, round_: int = 0) -> list[dict]:
    """Run on a worker actor (`__ray_call__`): its rollout over its actor engine (and its reference engine's
    modules for the decode window, when this worker holds one)."""
    inner = _hybrid_worker(worker)
    return inner.rollout.generate_batch(inner.actor.engine, batch, params, round_, _ref_engine(inner))


def worker_held_prompts(worker) -> tuple[int, bool, list[int]]:
    """Run on a worker actor: (its DP rank, whether it writes outputs, the keys of the prompts its rollout holds
    prefix K/V for), for the trainer to keep each uid on the rank that holds its prompt."""
    inner = _hybrid_worker(worker)
    engine = inner.actor.engine
    keys: set = set()
    for e in (engine, _ref_engine(inner)):
        if isinstance(getattr(e, "window", None), HeldPrefixes):
            keys |= set(e.window.entries)
    return engine.get_data_parallel_rank(), bool(engine.is_mp_src_rank_with_outputs()), sorted(keys)


def worker_prefix_stats(worker) -> dict:
    """Run on a worker actor: its engines' last scoring phases' prefix sources, with whether this rank writes
    outputs (one per DP rank counts)."""
    inner = _hybrid_worker(worker)
    out = {"src": bool(inner.actor.engine.is_mp_src_rank_with_outputs())}
    for role, engine in (("old_logp", inner.actor.engine), ("ref", _ref_engine(inner))):
        held = getattr(engine, "window", None)
        if isinstance(held, HeldPrefixes):
            out[role] = dict(held.last)
    return out


def _ref_engine(inner):
    """The reference engine of verl's hybrid worker, None without a reference in this process."""
    return getattr(getattr(inner, "ref", None), "engine", None)


def worker_release(worker) -> int:
    """Run on a worker actor: verl's sleep for its rollout; returns how many sleeps dropped a decode state."""
    rollout = _hybrid_worker(worker).rollout
    rollout.drop_state()
    return rollout.released


def _hybrid_worker(worker):
    """verl's `ActorRolloutRefWorker` inside a colocated worker actor (`WorkerDict`), or the worker itself."""
    for w in getattr(worker, "worker_dict", {}).values():
        if isinstance(getattr(w, "rollout", None), RollplexRollout):
            return w
    if isinstance(getattr(worker, "rollout", None), RollplexRollout):
        return worker
    raise RuntimeError("rollout.name=rollplex: this worker has no rollplex rollout (it runs in verl's hybrid "
                       "actor_rollout worker only)")


# -- server side ------------------------------------------------------------------------------------------------
def prompt_inputs(processor, tokenizer, prompt_ids: list[int], images, videos) -> dict:
    """The prompt's model inputs as verl's agent loop computes them for the batch
    (`AgentLoopWorker._compute_multi_modal_inputs`): placeholder runs collapsed, decoded, re-expanded by the
    processor with the images and videos."""
    out = {"input_ids": torch.tensor(prompt_ids, dtype=torch.long)}
    if processor is None or (not images and not videos):
        return out
    pad_ids = {get_processor_token_id(processor, k) for k in ("image", "video")} - {None}
    collapsed, prev = [], None
    for t in prompt_ids:
        if not (t in pad_ids and t == prev):
            collapsed.append(t)
        prev = t
    text = tokenizer.decode(collapsed, skip_special_tokens=True)
    mm = build_multimodal_processor_inputs(processor, text=[text], images=images or None, videos=videos or None)
    mm = dict(mm.convert_to_tensors("pt"))
    # the decoded text lost the special tokens (chat tags), so compare the placeholders the processor expanded
    pads = torch.tensor(sorted(pad_ids))
    got, want = mm["input_ids"][0], out["input_ids"]
    if not torch.equal(got[torch.isin(got, pads)], want[torch.isin(want, pads)]):
        raise ValueError("rollout.name=rollplex: the processor's expansion of the prompt differs from the agent "
                         "loop's prompt ids (its images or videos do not match its placeholders)")
    out.update({k: mm[k] for k in PROMPT_FIELDS if k in mm})
    return out


def model_tools(model_config) -> tuple:
    """(processor, tokenizer, stop token ids) of verl's model config (its generation config's EOS ids)."""
    mc = omega_conf_to_dataclass(model_config)
    eos = getattr(mc.generation_config, "eos_token_id", None) if mc.generation_config is not None else None
    eos = mc.tokenizer.eos_token_id if eos is None else eos
    return mc.processor, mc.tokenizer, tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def prompt_crc(prompt: dict) -> int:
    """A prompt's CRC over its ids and every processor tensor (a text-only prompt's is its ids' CRC)."""
    crc = zlib.crc32(prompt["input_ids"].numpy().tobytes())
    for k in PROMPT_FIELDS:
        t = prompt.get(k)
        if t is not None:
            crc = zlib.crc32(t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes(), crc)
    return crc


def prompt_seed(prompt: dict, round_: int, index: int) -> int:
    """A request's sampling seed: from its whole prompt (`prompt_crc`), the rollout round and its place among that
    prompt's requests in the round (independent of the order the agent loop's calls arrive in)."""
    # the pixels count: rows of one image size and wording have equal ids, and keyed by ids alone their places
    # (0, 1) went by arrival, so two runs sampled one prompt's tokens for the other
    return zlib.crc32(f"{prompt_crc(prompt)}:{round_}:{index}".encode()) & 0x7FFFFFFF


class RollplexServer:
    """One replica's generate endpoint (a Ray actor; see the module docstring)."""

    def __init__(self, config, model_config, workers: list, replica_rank: int, tools: tuple | None = None):
        """`tools`: (processor, tokenizer, stop token ids); by default read from `model_config`'s checkpoint."""
        self.config, self.workers, self.replica_rank = config, workers, replica_rank
        self.processor, self.tokenizer, self.stop = tools if tools is not None else model_tools(model_config)
        self.pending: list = []  # (prompt inputs, max_new_tokens, sampling key, future)
        self.last_arrival = 0.0
        self.flusher: asyncio.Task | None = None
        self.round = 0  # one per sleep: a rollout
        self.seen: dict = {}  # prompt_crc -> merged requests of this round so far
        self.stats = {"requests": 0, "merged_requests": 0, "batches": 0}

    async def generate(self, prompt_ids, sampling_params: dict, request_id: str, image_data=None, video_data=None,
                       **kwargs) -> TokenOutput:
        """One sample of `prompt_ids`; batched with the calls that arrive with it (see the module docstring)."""
        params = dict(sampling_params)
        top_k = int(params.get("top_k", -1) or 0)
        key = (float(params.get("temperature", 1.0)), float(params.get("top_p", 1.0)), max(top_k, 0))
        budget = self.config.prompt_length + self.config.response_length - len(prompt_ids)
        max_new = min(int(params.get("max_tokens", params.get("max_new_tokens", self.config.response_length))),
                      self.config.response_length, budget)
        if max_new < 1:
            raise ValueError(f"rollout.name=rollplex: a prompt of {len(prompt_ids)} tokens leaves no room within "
                             f"prompt_length + response_length = {budget + len(prompt_ids)}")
        prompt = await asyncio.to_thread(prompt_inputs, self.processor, self.tokenizer, list(prompt_ids),
                                         image_data, video_data)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.pending.append((prompt, max_new, key, fut))
        self.last_arrival = loop.time()
        self.stats["requests"] += 1
        if self.flusher is None or self.flusher.done():
            self.flusher = asyncio.create_task(self._flush_when_quiet())
        tokens, logps, finish, steps = await fut
        return TokenOutput(token_ids=tokens, log_probs=logps if params.get("logprobs") else None,
                           stop_reason=STOP_REASONS.get(finish, "completed"), extra_fields={"global_steps": steps})

    async def _flush_when_quiet(self) -> None:
        loop = asyncio.get_running_loop()
        while self.pending:
            wait = self.last_arrival + BATCH_QUIET_S - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            batch, self.pending = self.pending, []
            try:
                await self._run(batch)
            except BaseException as e:  # every waiting sample fails with the batch
                for *_, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)

    async def _run(self, batch: list) -> None:
        """Merge equal prompts (per sampling setting and length limit), run them on every rank, answer each call."""
        by_key: dict = {}
        for item in batch:
            by_key.setdefault((item[2], item[1]), []).append(item)
        for (key, max_new), items in by_key.items():
            merged: list[tuple[dict, list]] = []
            for prompt, _, _, fut in items:
                same = next((m for m in merged if _same(m[0], prompt)), None)
                if same is None:
                    merged.append((prompt, [fut]))
                else:
                    same[1].append(fut)
            requests = []
            for prompt, futs in merged:
                crc = prompt_crc(prompt)
                index = self.seen.get(crc, 0)
                self.seen[crc] = index + 1
                requests.append({**prompt, "n": len(futs), "max_new_tokens": max_new, "stop": self.stop,
                                 "seed": prompt_seed(prompt, self.round, index)})
            params = {"temperature": key[0], "top_p": key[1], "top_k": key[2]}
            results = await asyncio.gather(*[w.__ray_call__.remote(worker_generate, requests, params, self.round)
                                             for w in self.workers])
            self.stats["merged_requests"] += len(requests)
            self.stats["batches"] += 1
            for (_, futs), res in zip(merged, results[0]):
                for j, fut in enumerate(futs):
                    fut.set_result((res["tokens"][j], res["logprobs"][j], res["finish"][j], res["global_steps"]))

    async def sleep(self) -> None:
        """verl's sleep (after each rollout): a new round; with free_cache_engine the ranks drop the decode state."""
        self.round += 1
        self.seen.clear()
        if self.config.free_cache_engine:
            await asyncio.gather(*[w.__ray_call__.remote(worker_release) for w in self.workers])

    async def wake_up(self) -> None:
        """Nothing to bring back (the weights are the actor's)."""

    async def get_stats(self) -> dict:
        """Calls taken, merged requests run and batches, since the start."""
        return dict(self.stats)

    async def clear_kv_cache(self) -> None:
        """No cache outlives a rollout but the kept decode state, which `sleep` handles."""

    async def release_kv_cache(self) -> None:
        """See `clear_kv_cache`."""

    async def resume_kv_cache(self) -> None:
        """See `clear_kv_cache`."""

    async def abort_all_requests(self, reject_request: bool = False) -> dict:
        """No partial rollout: requests run to the end."""
        return {}

    async def resume_generation(self) -> None:
        """See `abort_all_requests`."""

    async def start_profile(self, **kwargs) -> None:
        """No rollout profiler."""

    async def stop_profile(self) -> None:
        """No rollout profiler."""


def _same(a: dict, b: dict) -> bool:
    return same_prompt(Prompt(a["input_ids"], **{k: a.get(k) for k in PROMPT_FIELDS}),
                       Prompt(b["input_ids"], **{k: b.get(k) for k in PROMPT_FIELDS}))


class RollplexReplica(RolloutReplica):
    """verl's rollout replica for `rollout.name=rollplex`: hybrid only (on the actor's worker processes)."""

    async def launch_servers(self):
        if self.rollout_mode != RolloutMode.HYBRID or len(self.workers) != self.world_size:
            raise ValueError(f"rollout.name=rollplex runs inside verl's hybrid actor_rollout workers only (got "
                             f"{self.rollout_mode}, {len(self.workers)} workers for a replica of {self.world_size}); "
                             f"keep actor_rollout_ref.hybrid_engine=true")
        server = ray.remote(RollplexServer).options(
            name=f"rollplex_server_{self.replica_rank}{self.name_suffix}", num_cpus=0.01,
            max_concurrency=self.max_concurrency,
        ).remote(self.config, self.model_config, self.workers, self.replica_rank)
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"rollplex-replica-{self.replica_rank}{self.name_suffix}"


def register() -> None:
    """The replica (`RolloutReplicaRegistry`) and the worker-side class (`_ROLLOUT_REGISTRY`) under `rollplex`."""
    RolloutReplicaRegistry.register(NAME, lambda: RollplexReplica)
    rollout_base._ROLLOUT_REGISTRY[(NAME, "async")] = f"{__name__}.RollplexRollout"


register()
