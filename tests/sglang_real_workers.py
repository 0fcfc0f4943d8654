"""The worker of `tests/test_gpu_sglang_real.py`: the trainer's Runtime with rollout.engine=sglang over SGLang itself.

One SGLang start serves every check (SGLang starts slowly). Three greedy rollouts of the same prompts, each with
the window's reference and actor prefix jobs: as started; after an in-place weight change (as an optimizer
step makes, nothing sent); after SGLang's parameters were bound to copies (the mutation). Each rollout is
compared with the embedded engine's on the same prompts and weights, and each job's K/V with the prefix
stage run directly here. Legend: G = samples per request, R = generated tokens.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from tests.numerics import rel_err
from tests.sglang_workers import _direct

REQUESTS = 2  # prompts of the first data batch, G = 2 samples each
NEW_TOKENS = 32  # per sample, EOS ignored by both engines (no stop tokens: SGLang would also stop at the model's EOS)
TIE = 0.05  # nats: where SGLang's top two are closer, bf16 rounding may pick either (the embedded engine's choice)
WEIGHTS_TOL = 1.0  # MiB the trainer may allocate while SGLang starts beyond the shards' own buffers
PLUGIN = "rollplex = rollplex_megatron.rollout.sglang.plugin:register"  # setup.py's sglang.srt.plugins entry


def plugin_entry_point(folder: Path) -> None:
    """setup.py's `sglang.srt.plugins` entry point for a checkout that is on PYTHONPATH, not installed: a dist-info
    in `folder`, on this process's path and on SGLang's processes' (they inherit PYTHONPATH)."""
    info = folder / "rollplex_megatron_checkout-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rollplex-megatron-checkout\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[sglang.srt.plugins]\n{PLUGIN}\n")
    sys.path.insert(0, str(folder))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(folder)] + [p for p in [os.environ.get("PYTHONPATH")] if p])


def _sent_kinds(bridge) -> list:
    """The kinds of message the trainer sends over the bridge from now on (a list that grows)."""
    kinds, send = [], bridge.link.send

    def counting(msg):
        kinds.append(type(msg).__name__)
        return send(msg)

    bridge.link.send = counting
    return kinds


def _measured_build(runtime_module, out: dict):
    """`build_engine` recording what the trainer's allocator gained while SGLang started (`engine_alloc`)."""
    build = runtime_module.build_engine

    def allocated() -> int:
        if not torch.cuda.is_available():  # a CPU dry run of this worker
            return 0
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    def measured(*args, **kwargs):
        before = allocated()
        engine = build(*args, **kwargs)
        out["engine_alloc"] = allocated() - before
        return engine

    runtime_module.build_engine = measured


def top2(eng, req, prefix: list[int]) -> list[tuple[float, int]]:
    """SGLang's two most likely next tokens after `prefix` of one sample of `req` (log-prob, id), asked through the
    adapter's own request format."""
    from rollplex_megatron.rollout.engine import RolloutRequest
    from rollplex_megatron.rollout.sampling import SamplingParams
    from rollplex_megatron.rollout.sglang.engine import request_payload

    x = request_payload(RolloutRequest(req.prompt, 1, 1, (), req.seed), SamplingParams(1.0, 1.0, 1), eng.banned)[0]
    eng.engine.resume_memory_occupation(tags=eng.memory_tags)
    try:
        o = eng.engine.generate(input_ids=[x["input_ids"] + prefix], sampling_params=[x["sampling_params"]],
                                image_data=[x["image_data"]], video_data=[x["video_data"]], return_logprob=True,
                                top_logprobs_num=2)
    finally:
        eng.engine.release_memory_occupation(tags=eng.memory_tags)
    return [(float(lp), int(t)) for lp, t, *_ in o[0]["meta_info"]["output_top_logprobs"][0]]


def compare(eng, reqs, sg, em) -> dict:
    """SGLang's greedy samples against the embedded engine's: each equal, or equal up to a position where SGLang's
    top two are within TIE and the embedded engine took the second (bf16 rounding; the rest of that sample follows
    another prefix, so it is not compared). `agreed`: tokens before each sample's first difference. Log-probs over
    the common part, norm-relative."""
    out = {"samples": 0, "equal": 0, "agreed": 0, "ties": [], "breaks": [], "lp_rel": 0.0}
    lp_sg, lp_em = [], []
    for i, (req, a, b) in enumerate(zip(reqs, sg, em)):
        for j, (ta, tb) in enumerate(zip(a.tokens, b.tokens)):
            out["samples"] += 1
            n = min(len(ta), len(tb))
            diff = (ta[:n] != tb[:n]).nonzero()
            at = int(diff[0]) if len(diff) else n
            out["agreed"] += at
            lp_sg.append(a.logprobs[j][:at])
            lp_em.append(b.logprobs[j][:at])
            if at == len(ta) == len(tb):
                out["equal"] += 1
                continue
            best = top2(eng, req, ta[:at].tolist()) if at < n else []
            case = {"request": i, "sample": j, "at": at, "sglang": ta[at:at + 1].tolist(),
                    "embedded": tb[at:at + 1].tolist(), "sglang_top2": best}
            pair = [t for _, t in best] == [int(ta[at]), int(tb[at])]  # SGLang's first, the embedded's second
            tie = pair and best[0][0] - best[1][0] <= TIE
            out["ties" if tie else "breaks"].append(case)
    out["lp_rel"] = rel_err(torch.cat(lp_sg), torch.cat(lp_em)) if lp_sg else 0.0
    return out


def one_rollout(rt, embedded, reqs) -> dict:
    """A greedy rollout through the trainer's SGLang engine with the window's prefix jobs of the same prompts, the
    embedded engine's on the same weights, and the jobs' K/V against the prefix stages run directly."""
    from rollplex_megatron.attention.kv_store import KVStore
    from rollplex_megatron.prefix import execution as X
    from rollplex_megatron.prefix.batch import Group
    from rollplex_megatron.rollout.sampling import SamplingParams
    from rollplex_megatron.rollout.window import DecodeWindow
    from rollplex_megatron.rollout.window.jobs import PrefixJob

    greedy = SamplingParams(1.0, 1.0, 1)
    window, ref_kv, actor_kv, states = DecodeWindow(), KVStore(), KVStore(), []
    for i, r in enumerate(reqs):
        window.submit(f"actor_prefix[{i}]", None, PrefixJob("actor", r.prompt, actor_kv, i, trainable=True,
                                                            states=states))
        window.submit(f"reference_prefix[{i}]", None, PrefixJob("reference", r.prompt, ref_kv, i))
    got = rt.engine.generate(reqs, greedy, window)
    want = embedded.generate(reqs, greedy)
    d_ref, d_actor, _ = _direct(rt.ref, X.unwrap(rt.ddp), [Group(r.prompt, [], torch.zeros(0)) for r in reqs])
    rel = [rel_err(a, b) for st, d in ((ref_kv, d_ref), (actor_kv, d_actor)) for k in d.leaves
           for a, b in zip(st.leaves[k], d.leaves[k])]
    return {"tokens": [[t.tolist() for t in res.tokens] for res in got.results], "kv_rel": rel,
            "jobs_done": len(window.finished), "jobs": 2 * len(reqs), "window": got.stats["sglang_window"],
            "vs_embedded": compare(rt.engine, reqs, got.results, want.results)}


def change_in_place(model, seed: int) -> None:
    """An update as an optimizer step makes it: every weight matrix moved by half its spread, in place."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                noise = torch.randn(p.shape, generator=g).to(p.device, p.dtype)
                p.add_(0.5 * p.float().std().to(p.dtype) * noise)


def real_sglang(cfg, folder: str) -> dict:
    """Start SGLang through the trainer's Runtime (rollout.engine=sglang) and run the three rollouts."""
    import sglang

    from rollplex_megatron.prefix import execution as X
    from rollplex_megatron.rollout.embedded import EmbeddedEngine
    from rollplex_megatron.rollout.engine import RolloutRequest
    from rollplex_megatron.rollout.sglang.weights import LOADER
    from rollplex_megatron.trainer import runtime as RT

    plugin_entry_point(Path(folder))
    out = {"sglang": sglang.__version__, "trainer_pid": os.getpid()}
    _measured_build(RT, out)
    rt = RT.Runtime(cfg)
    eng, actor = rt.engine, X.unwrap(rt.ddp)
    hello = eng.bridge.hello
    out.update(scheduler_pid=hello.pid, scheduler_version=hello.version, buffer_bytes=eng.shards.allocated_bytes(),
               param_bytes=sum(p.numel() * p.element_size() for p in actor.parameters()))
    sent = _sent_kinds(eng.bridge)
    _, first = rt.requests(0)
    reqs = [RolloutRequest(r.prompt, 2, NEW_TOKENS, (), seed=r.seed) for r in first[:REQUESTS]]
    embedded = EmbeddedEngine.for_run(rt.ddp, rt.cfg)
    try:
        out["first"] = one_rollout(rt, embedded, reqs)
        change_in_place(actor, 1)
        rt.sync_rollout_weights()  # the non-view buffers rebuilt in place; nothing crosses to SGLang
        out["changed"] = one_rollout(rt, embedded, reqs)
        out["sent_before_mutation"] = sorted(set(sent))
        # the mutation: SGLang's parameters bound to copies of the shards (through its own weight update and the
        # project's loader), so the next in-place change stays in the trainer
        copies = [(n, t.clone()) for n, t in eng.shards.named_tensors()]
        eng.engine.resume_memory_occupation(tags=eng.memory_tags)  # SGLang flushes its KV cache after an update
        try:
            out["mutation_update"] = str(eng.engine.update_weights_from_tensor(named_tensors=copies,
                                                                               load_format=LOADER))
        finally:
            eng.engine.release_memory_occupation(tags=eng.memory_tags)
        change_in_place(actor, 2)
        rt.sync_rollout_weights()
        out["copied"] = one_rollout(rt, embedded, reqs)
    finally:
        eng.shutdown()
    return out
