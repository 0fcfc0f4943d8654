"""`RolloutEngine` over `sglang.Engine`: SGLang decodes; the decode window's prefix jobs run in its scheduler.

Start-up (`SGLangEngine.__init__`), per training TP rank (SGLang at tp_size = parallel.tp, its rank g on
the trainer's GPU g):
1. this rank's shards in SGLang's layout (`weights.SGLangShards`: views of the training storage, or
   buffers the trainer refreshes) and a bridge listener; every rank's address goes into SGLang's
   environment;
2. rank 0 starts `sglang.Engine(load_format="dummy", custom_weight_loader=[alias_loader], ...)`. Each
   scheduler process connects while it loads, and the plugin binds SGLang's parameters to the shards
   right after `ModelRunner.load_model`, before SGLang sizes its KV cache and captures its CUDA graphs;
3. the reference and actor modules go to the scheduler for the window's jobs (handles again).

Per step: `generate` sends the window's jobs over the bridge while rank 0 asks SGLang for the samples
(G requests per prompt, each with its own seed; SGLang's radix cache shares the prompt's KV among
them), and the other ranks get the results from rank 0. `sync_weights` after the optimizer step
refreshes the non-view buffers; the views need nothing. SGLang's KV cache and CUDA graphs are held only
during `generate` (released after it, resumed before the next: `ROLLOUT_MEMORY`). SGLang's log-probs are those of the
temperature-scaled distribution it samples from (its default; `SGLANG_RETURN_ORIGINAL_LOGPROB` would
break that and is refused).
"""
from __future__ import annotations

import importlib.util
import os
import threading
import time

import torch
import torch.distributed as dist

from rollplex_megatron.rollout.engine import DecodeHooks, RolloutOutput, RolloutRequest, RolloutResult
from rollplex_megatron.rollout.sampling import SamplingParams
from rollplex_megatron.rollout.sglang import protocol as P
from rollplex_megatron.rollout.sglang.client import TrainerBridge, shareable
from rollplex_megatron.rollout.sglang.weights import LOADER, SGLangShards

# SGLang's memory outside the rollout phase: its KV cache and CUDA graphs are released (the memory saver keeps
# their addresses, so the graphs stay valid), its weights are the trainer's and are never released
ROLLOUT_MEMORY = ("kv_cache", "cuda_graph")
# what SGLang's processes get in their environment: no vision-embedding cache. SGLang keys it by image hash and
# never clears it, not even when its weights change (release_memory_occupation flushes the KV cache only); here its
# weights change in place at every optimizer step, so a recurring image would get the vision tower's output of an
# earlier step. SGLang sets the same itself for RL (rl_on_policy_target)
SGLANG_ENV = {"SGLANG_VLM_CACHE_SIZE_MB": "0"}
BANNED_BIAS = -1e9  # logit bias of the vision placeholder tokens (the embedded sampler bans them too)


def rollout_memory_tags() -> list[str]:
    """The tags of `ROLLOUT_MEMORY` this SGLang release has (0.5.2 has no cuda_graph tag: its graphs stay)."""
    try:
        from sglang.srt import constants as C
    except ImportError:  # a stand-in without sglang.srt
        return list(ROLLOUT_MEMORY)
    have = {getattr(C, n, None) for n in dir(C) if n.startswith("GPU_MEMORY_TYPE_")}
    return [t for t in ROLLOUT_MEMORY if t in have]


def import_sglang():
    """The `sglang` package, or a one-line error saying how to get it."""
    try:
        import sglang
    except ImportError:
        raise ValueError("rollout.engine=sglang needs SGLang in this environment (pip install 'sglang==0.5.23', "
                         "0.5.17 for torch 2.11, or 0.5.12 as verl 0.9.1 pins; docs/guides/sglang.md); use "
                         "rollout.engine=embedded") from None
    version = getattr(sglang, "__version__", "0")
    if _release(version) < MIN_ADAPTER:
        raise ValueError(f"rollout.engine=sglang needs SGLang >= {'.'.join(map(str, MIN_ADAPTER))} (per-sample "
                         f"sampling_seed, deterministic inference); this is {version}. Older releases get the "
                         f"bridge's hooks through patches/sglang/ but not this adapter")
    if importlib.util.find_spec("torch_memory_saver") is None:  # else SGLang's scheduler dies at start-up
        raise ValueError("rollout.engine=sglang releases SGLang's KV cache outside the rollout through its memory "
                         "saver (enable_memory_saver), which needs the torch-memory-saver package (an SGLang "
                         "dependency): pip install torch-memory-saver")
    return sglang


MIN_ADAPTER = (0, 5, 12)


def _release(version: str) -> tuple[int, ...]:
    out = []
    for part in version.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


def sample_seed(seed: int, sample: int) -> int:
    """SGLang's `sampling_seed` of sample `sample` of a request with seed `seed`."""
    return (seed * 1_000_003 + sample) % (1 << 31)


def request_payload(req: RolloutRequest, params: SamplingParams, banned: tuple[int, ...]) -> list[dict]:
    """SGLang's inputs for one request: G entries (one per sample) of input_ids, sampling params and media."""
    p = req.prompt
    sp = {"max_new_tokens": req.max_new_tokens, "temperature": params.temperature, "top_p": params.top_p,
          "stop_token_ids": list(req.stop_token_ids), "ignore_eos": not req.stop_token_ids,
          "logit_bias": {str(t): BANNED_BIAS for t in banned}}
    if params.top_k:
        sp["top_k"] = params.top_k
    image = None if p.pixel_values is None else {"format": "processor_output", "pixel_values": p.pixel_values,
                                                 "image_grid_thw": p.image_grid_thw}
    video = None if p.pixel_values_videos is None else {
        "format": "processor_output", "pixel_values_videos": p.pixel_values_videos,
        "video_grid_thw": p.video_grid_thw, "second_per_grid_ts": p.second_per_grid_ts}
    return [{"input_ids": p.input_ids.tolist(), "sampling_params": {**sp, "sampling_seed": sample_seed(req.seed, j)},
             "image_data": image, "video_data": video} for j in range(req.n)]


def parse_outputs(requests: list[RolloutRequest], outputs: list[dict]) -> list[RolloutResult]:
    """SGLang's outputs (one per sample, request-major) as RolloutResults in request order."""
    want = sum(r.n for r in requests)
    if len(outputs) != want:
        raise RuntimeError(f"SGLang returned {len(outputs)} outputs for {want} samples")
    results, k = [], 0
    for r in requests:
        toks, lps, fins = [], [], []
        for _ in range(r.n):
            meta = outputs[k]["meta_info"]
            k += 1
            pairs = meta["output_token_logprobs"]  # [(logprob, token id, text or None)] per generated token
            toks.append(torch.tensor([int(t) for _, t, *_ in pairs], dtype=torch.long))
            lps.append(torch.tensor([float(lp) for lp, *_ in pairs], dtype=torch.float32))
            fin = meta["finish_reason"]
            fins.append(fin["type"] if isinstance(fin, dict) else str(fin))
        results.append(RolloutResult(toks, lps, fins))
    return results


class SGLangEngine:
    """SGLang as the rollout engine, with the decode window in its scheduler (the RolloutEngine contract)."""

    prefill_is_actor_prefix = False  # SGLang's prefill is not the trainer's graph: the actor prefix is a job
    window_items_elsewhere = True  # the bridge runs them in the scheduler, as jobs
    weights_phase = "weight_refresh"

    def __init__(self, actor, reference, cfg, tp_group=None, sglang=None):
        """`actor`, `reference`: this rank's stage models (no reference: evaluation, no reference jobs);
        `sglang`: the package (for tests: a stand-in)."""
        if os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true", "yes"):
            raise RuntimeError("SGLANG_RETURN_ORIGINAL_LOGPROB is set: SGLang would return log-probs before the "
                               "temperature, not of the distribution it samples from; unset it")
        self.cfg, self.sg = cfg, sglang or import_sglang()
        r = cfg.rollout
        self.tp = cfg.parallel.tp
        self.tp_rank = dist.get_rank(tp_group) if dist.is_initialized() else 0
        self.group = tp_group
        self.collective = self.tp > 1  # rank 0 drives SGLang; the others receive its results
        self.banned = tuple(cfg.model.vision_token_ids)
        self.depth = r.sglang.window_depth
        models = {"actor": actor} if reference is None else {"reference": reference, "actor": actor}
        for model in models.values():  # CPU: into shared memory now (it moves storage) so every handle and
            for prm in model.parameters():  # view taken below stays valid; CUDA tensors are left as they are
                shareable(prm.data)
        self.shards = SGLangShards(actor, cfg.model, self.tp, self.tp, tp_group, self.tp_rank)
        if dist.is_initialized() and self.tp > 1:  # one auth key for the group: SGLang's schedulers get rank 0's env
            key = [os.environ.get(P.ENV_KEY) or P.new_key()]
            dist.broadcast_object_list(key, src=dist.get_global_rank(tp_group, 0), group=tp_group)
            os.environ[P.ENV_KEY] = key[0]
        self.bridge = TrainerBridge(timeout=r.sglang.timeout_s)
        addrs = [None] * self.tp
        if dist.is_initialized() and self.tp > 1:
            dist.all_gather_object(addrs, self.bridge.address, group=tp_group)
        else:
            addrs = [self.bridge.address]
        os.environ.update(self.bridge.env(addrs))  # inherited by SGLang's scheduler processes
        joiner = self._in_thread(self._accept_and_bind)
        self.engine = None
        t0 = time.perf_counter()
        if self.tp_rank == 0:
            self.engine = self.start_engine()
        joiner()
        self.startup_s = time.perf_counter() - t0
        m = cfg.mode
        window = {"mechanism": m.window, "items_per_step": m.window_items_per_step,
                  "tail_fraction": m.window_tail_fraction, "green_sms": m.window_green_sms}
        self.bridge.send_modules(models, cfg.model, cfg.dtype, cfg.megatron, self.tp, window)
        self.step = 0
        self.memory_tags = rollout_memory_tags()
        if self.engine is not None:  # the rollout phase resumes them
            self.engine.release_memory_occupation(tags=self.memory_tags)

    def engine_args(self) -> dict:
        """sglang.Engine's keywords: dummy weights bound by the alias loader, this run's TP and seed."""
        s = self.cfg.rollout.sglang
        path = s.model_path or self.cfg.train.init_hf
        # per-sample seeds are honoured only under deterministic inference; the memory saver makes
        # release/resume of the KV cache and graphs real (without it they are no-ops)
        args = {"model_path": path, "tp_size": self.tp, "load_format": "dummy", "custom_weight_loader": [LOADER],
                "mem_fraction_static": s.mem_fraction_static, "random_seed": self.cfg.seed,
                "dtype": "bfloat16" if self.cfg.dtype == "bfloat16" else self.cfg.dtype,
                "enable_deterministic_inference": True, "enable_memory_saver": True}
        args.update(s.engine_args)
        return args

    def start_engine(self):
        """`sglang.Engine`, its processes started with `SGLANG_ENV`; this process's environment is restored after:
        SGLang sets NCCL and CUDA variables for its children, not for this rank, whose communicators must match
        the other training ranks'."""
        saved = dict(os.environ)
        try:
            os.environ.update(SGLANG_ENV)
            return self.sg.Engine(**self.engine_args())
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def _accept_and_bind(self) -> None:
        """The scheduler's connection, then this rank's shards as SGLang's parameters (while SGLang loads)."""
        self.bridge.accept(timeout=self.cfg.rollout.sglang.startup_timeout_s)
        self.bridge.send_weights(self.shards.named_tensors())

    @staticmethod
    def _in_thread(fn):
        box = {}

        def run():
            try:
                box["value"] = fn()
            except BaseException as e:  # re-raised by the joiner
                box["error"] = e

        th = threading.Thread(target=run, name="rollplex-bridge", daemon=True)
        th.start()

        def join():
            th.join()
            if "error" in box:
                raise box["error"]
            return box.get("value")

        return join

    def sync_weights(self) -> float:
        """After the optimizer step: rebuild the non-view shards in place (the views already changed)."""
        return self.shards.refresh()

    def generate(self, requests: list[RolloutRequest], params: SamplingParams, hooks: DecodeHooks | None = None,
                 actor_prefix=None, recompute_prefix: bool = False) -> RolloutOutput:
        """Sample every request in SGLang while the window's jobs run in its scheduler."""
        if actor_prefix is not None:
            raise NotImplementedError("SGLang's prefill cannot be the actor prefix stage; it is a window job")
        items = hooks.take_items() if hooks is not None else []
        step, self.step = self.step, self.step + 1
        joiner = self._in_thread(lambda: self.bridge.run_step(step, items, self.depth))
        t0 = time.perf_counter()
        results = None
        try:
            if self.tp_rank == 0:
                self.engine.resume_memory_occupation(tags=self.memory_tags)
                payload = [x for r in requests for x in request_payload(r, params, self.banned)]
                outputs = self.engine.generate(input_ids=[x["input_ids"] for x in payload],
                                               sampling_params=[x["sampling_params"] for x in payload],
                                               image_data=[x["image_data"] for x in payload],
                                               video_data=[x["video_data"] for x in payload],
                                               return_logprob=True)
                results = parse_outputs(requests, outputs)
        finally:  # also when rank 0 failed: no rank may be left waiting
            decode_s = time.perf_counter() - t0
            if self.collective:
                box = [results]
                dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
                results = box[0]
            self.bridge.drain(step)  # decoding is over: the scheduler runs the jobs left when idle
            stats = joiner()  # every job done: SGLang is idle, as release requires
        if results is None:
            raise RuntimeError("SGLang's generate failed on training TP rank 0 (its error is in that rank's log)")
        if self.tp_rank == 0:
            self.engine.release_memory_occupation(tags=self.memory_tags)
        if hooks is not None:
            hooks.ran_elsewhere(items)
        return RolloutOutput(results, [], {"decode_s": decode_s, "sglang_window": stats})

    def shutdown(self) -> None:
        """Close the bridge (the schedulers drop their queues), then stop SGLang."""
        self.bridge.close()
        if self.engine is not None:
            self.engine.shutdown()


__all__ = ["SGLangEngine", "import_sglang", "request_payload", "parse_outputs"]
