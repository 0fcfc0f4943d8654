"""Workers for the SGLang bridge tests (importable for spawn): a trainer rank and a stand-in scheduler.

`StandInScheduler` is a stand-in for `sglang.srt.managers.scheduler.Scheduler` (SGLang cannot be
installed here): it replays the call sequence of SGLang's `event_loop_overlap` (get_next_batch_to_run
-> run_batch -> process the last batch's result -> on_idle when nothing ran), with decode batches that
do real (small) work, and it carries the bridge through the real plugin hooks (`install_direct`).
"""
from __future__ import annotations

import os
import queue
import threading
import time
from collections import deque

import torch

from tests.numerics import rel_err


class ForwardMode:
    """Stand-in for sglang's ForwardMode: only what the hooks read."""

    def __init__(self, decode: bool):
        self.decode = decode

    def is_decode(self) -> bool:
        return self.decode


class Batch:
    """Stand-in for sglang's ScheduleBatch."""

    def __init__(self, size: int, decode: bool = True):
        self.size, self.forward_mode = size, ForwardMode(decode)

    def batch_size(self) -> int:
        return self.size

    def copy(self) -> "Batch":
        return Batch(self.size, self.forward_mode.decode)


class StandInScheduler:
    """Stand-in for SGLang's Scheduler, replaying `event_loop_overlap`'s call sequence."""

    def __init__(self, decode_steps: int, step_s: float, tp_rank: int = 0, tp_size: int = 1,
                 max_idle_s: float = 1200.0):
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.steps, self.rollout, self.todo = decode_steps, -1, deque()
        self.step_s, self.max_idle_s = step_s, max_idle_s
        self.last_batch = None
        self.decoded, self.idles, self.processed = 0, 0, 0
        self.work = torch.randn(64, 64)

    def get_next_batch_to_run(self):
        from rollplex_megatron.rollout.sglang.plugin import bridge_of

        bridge = bridge_of(self)
        step = -1 if bridge is None else bridge.step
        if self.tp_size > 1:  # SGLang's TP ranks run the same batches: rank 0's requests reach all of them
            import torch.distributed as dist

            t = torch.tensor([step])
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            step = int(t)
        if step < 0:  # requests arrive once the trainer has opened its step
            return None
        if step != self.rollout:  # a new RL step: its rollout's prefill and decode batches
            self.rollout = step
            self.todo = deque([Batch(1, decode=False)] + [Batch(max(8 - i // 2, 1)) for i in range(self.steps)])
        return self.todo.popleft() if self.todo else None

    def run_batch(self, batch):
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < self.step_s:  # a decode forward's worth of work
            self.work = torch.tanh(self.work @ self.work.T / 64)
        self.decoded += batch.forward_mode.is_decode()
        return {"batch": batch.size}

    def process_batch_result(self, batch, result):
        self.processed += 1

    def on_idle(self):
        self.idles += 1
        time.sleep(0.002)

    def _agree_stop(self, local: bool) -> bool:
        """The ranks stop at the same iteration (one that left early would break the next all-reduce of the
        others, which is a stand-in artefact: SGLang's loop does not stop when the bridge closes)."""
        if self.tp_size == 1:
            return local
        import torch.distributed as dist

        t = torch.tensor([int(local)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t)

    def event_loop_overlap(self):
        """SGLang's overlap loop, minus request intake and sampling: stops when the bridge closes."""
        from rollplex_megatron.rollout.sglang.plugin import bridge_of

        result_queue = deque()
        # a safety net, not a test bound: a scheduler whose trainer is gone stops after this long. At 300 s it
        # stopped a loaded CI machine's adapter test mid-job (its CPU prefix jobs ran slower than that)
        t_end = time.perf_counter() + self.max_idle_s
        while time.perf_counter() < t_end:
            bridge = bridge_of(self)
            if self._agree_stop(bridge is not None and bridge.closed.is_set()):
                return None if bridge is None else bridge.error
            batch = self.get_next_batch_to_run()
            if batch:
                result_queue.append((batch.copy(), self.run_batch(batch)))
            if self.last_batch:
                self.process_batch_result(*result_queue.popleft())
            elif batch is None:
                self.on_idle()
            self.last_batch = batch
        return "stand-in scheduler ran out of time"


class StandInRunner:
    """Stand-in for sglang's ModelRunner: `load_model` builds parameters of SGLang's names holding their own
    (dummy) memory, shaped as the trainer's shards say (SGLang would derive them from the HF config)."""

    def __init__(self, shapes: dict):
        self.tp_rank, self.tp_size, self.shapes = 0, 1, shapes

    def load_model(self):
        self.model = torch.nn.Module()
        for n, shape in self.shapes.items():
            self.model._parameters[n] = torch.nn.Parameter(torch.randn(shape), requires_grad=False)


def scheduler_main(env: dict, decode_steps: int, step_s: float, mutation: str = "", report=None,
                   load_shapes: dict | None = None, tp_rank: int = 0, tp_size: int = 1, world_port: int = 0) -> None:
    """A scheduler process: the plugin's hooks on the stand-in, its loop until the trainer closes the bridge."""
    os.environ.update(env)
    from rollplex_megatron.rollout.sglang import bridge as B
    from rollplex_megatron.rollout.sglang.plugin import install_direct

    if mutation == "copy_weights":  # the scheduler's modules own copies instead of aliasing the trainer's
        bind = B.bind_modules

        def copied(handles):
            handles.params = {m: {n: t.clone() for n, t in ps.items()} for m, ps in handles.params.items()}
            return bind(handles)

        B.bind_modules = copied
    if mutation == "die":  # the scheduler process dies in the middle of the step's first job
        B.run_prefix = lambda model, prompt: os._exit(3)
    if mutation == "drain_lost":  # the scheduler forgets a Drain that arrived before its step's BeginStep
        new_step = B.SchedulerBridge._new_step

        def forgetting(self, step, jobs):
            new_step(self, step, jobs)
            self._drained = -2

        B.SchedulerBridge._new_step = forgetting
    if mutation == "stuck":  # the scheduler hangs inside the step's first job
        B.run_prefix = lambda model, prompt: time.sleep(3600)
    install_direct(StandInScheduler, StandInRunner)
    bound = None
    if load_shapes is not None:  # SGLang's start-up: the model is loaded (the plugin binds it), then the loop
        runner = StandInRunner(load_shapes)
        runner.load_model()
        bound = sum(1 for p in runner.model.parameters() if p.is_shared())  # the trainer's shared memory
    if tp_size > 1:  # SGLang's own world, which the bridge's groups are built over
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{world_port}", rank=tp_rank,
                                world_size=tp_size)
    sched = StandInScheduler(decode_steps, step_s, tp_rank, tp_size)
    err = sched.event_loop_overlap()
    if report is not None:
        report.put({"error": err, "decoded": sched.decoded, "idles": sched.idles, "bound": bound})


def _models(cfg, tp: int = 1):
    from rollplex_megatron.dist import init_parallel
    from rollplex_megatron.models.qwen25vl import build_model

    init_parallel(tp, 1, cfg.seed)
    torch.manual_seed(11)
    ref = build_model(cfg.model, "float32")
    torch.manual_seed(12)
    actor = build_model(cfg.model, "float32")
    for m, scale in ((ref, 0.5), (actor, 3.0)):  # very different magnitudes between the two modules
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(scale if p.dim() > 1 else 1.0)
    return ref, actor


def _jobs(cfg, step: int, n: int):
    from rollplex_megatron.attention.kv_store import KVStore
    from rollplex_megatron.rollout.window import DecodeWindow
    from rollplex_megatron.rollout.window.jobs import PrefixJob
    from rollplex_megatron.verify.equivalence import random_groups

    cfg.verify.groups_per_rank, cfg.verify.seed = n, 40 + step
    groups = random_groups(cfg, 0)
    window, ref_kv, actor_kv, states = DecodeWindow(), KVStore(), KVStore(), []
    for i, g in enumerate(groups):
        window.submit(f"actor_prefix[{i}]", None, PrefixJob("actor", g.prompt, actor_kv, i, trainable=True,
                                                            states=states))
        window.submit(f"reference_prefix[{i}]", None, PrefixJob("reference", g.prompt, ref_kv, i))
    return groups, list(window.queue), ref_kv, actor_kv, states


def _direct(ref, actor, groups):
    from rollplex_megatron.attention.kv_store import KVStore
    from rollplex_megatron.prefix import execution as X

    ref_kv, actor_kv = KVStore(), KVStore()
    with torch.no_grad():
        X.prefix_forward(ref, groups, ref_kv, keep_graph=False)
        states = X.prefix_forward(actor, groups, actor_kv, keep_graph=False, recompute=True)
    return ref_kv, actor_kv, states


def trainer_kv(cfg, mutation: str = "", steps: int = 2, groups: int = 3, timeout: float = 60.0,
               decode_steps: int = 4) -> dict:
    """A trainer rank: modules and each step's prefix jobs to the stand-in scheduler, K/V compared with
    the same prefix stages run directly here. Between steps the actor's weights change in place (as an
    optimizer step does) and are not sent again; after step 1 the reference is re-allocated (an offload
    and reload), and its handles must be sent again."""
    import multiprocessing as mp

    from rollplex_megatron.rollout.sglang.client import TrainerBridge

    ref, actor = _models(cfg)
    if mutation == "no_resend":  # the trainer never notices that the reference moved
        TrainerBridge.moved = lambda self: []
    bridge = TrainerBridge(timeout=timeout)
    ctx = mp.get_context("spawn")
    report = ctx.Queue()
    proc = ctx.Process(target=scheduler_main, args=(bridge.env(), decode_steps, 0.01, mutation, report),
                       daemon=True)
    proc.start()
    out = {"rel": [], "leaf_grad": [], "states": [], "in_window": 0, "after": 0, "stats": []}
    try:
        hello = bridge.accept(timeout=120)
        out["hello"] = (hello.tp_rank, hello.tp_size)
        bridge.send_modules({"reference": ref, "actor": actor}, cfg.model, "float32", {}, 1,
                            {"mechanism": "interleave", "items_per_step": 1})
        for step in range(steps):
            gs, items, ref_kv, actor_kv, states = _jobs(cfg, step, groups)
            out["stats"].append(run_then_drain(bridge, step, items, 0.5))
            d_ref, d_actor, d_states = _direct(ref, actor, gs)
            for got, want in ((ref_kv, d_ref), (actor_kv, d_actor)):
                if set(got.leaves) != set(want.leaves):
                    raise AssertionError(f"step {step}: K/V keys differ: {sorted(got.leaves)} vs {sorted(want.leaves)}")
                for key in want.leaves:
                    for a, b in zip(got.leaves[key], want.leaves[key]):
                        out["rel"].append(rel_err(a, b))
            out["leaf_grad"].append(all(t.requires_grad for kv in actor_kv.leaves.values() for t in kv)
                                    and not any(t.requires_grad for kv in ref_kv.leaves.values() for t in kv))
            got_states = sorted(states, key=lambda s: s.group)  # appended as results arrived
            out["states"].append(len(got_states) == len(d_states) and all(
                s.group == d.group and s.length == d.length and s.received is None and s.output is None
                and s.prompt.prompt is g.prompt for s, d, g in zip(got_states, d_states, gs)))
            out["in_window"] += sum(i.in_window for i in items)
            out["after"] += sum(not i.in_window for i in items)
            with torch.no_grad():  # an optimizer step: the actor's weights change in place
                for p in actor.parameters():
                    p.add_(0.1 * torch.randn_like(p))
            if step == 1:  # an offload and reload: the reference comes back at new addresses, other values
                for p in ref.parameters():
                    p.data = p.data.clone().mul_(1.5)
    finally:
        bridge.close()
    out.update(scheduler_outcome(proc, report, 30))
    return out


def scheduler_outcome(proc, report, wait: float) -> dict:
    """A stand-in scheduler process's report and exit code once its trainer closed the bridge."""
    proc.join(wait)
    try:
        got = report.get(timeout=10)
    except queue.Empty:
        got = None
    return {"scheduler": got, "scheduler_exit": proc.exitcode}


def run_then_drain(bridge, step: int, items: list, after_s: float, probe=None) -> dict:
    """As the engine does: the step's jobs run between decode steps, and the rest once the trainer says decoding
    is over (`drain`, `after_s` later; `probe()` is called just before it)."""
    box = {}

    def run():
        try:
            box["stats"] = bridge.run_step(step, items)
        except BaseException as e:  # re-raised below
            box["error"] = e

    th = threading.Thread(target=run)
    th.start()
    th.join(after_s)
    if probe is not None:
        probe()
    if th.is_alive():
        bridge.drain(step)
    th.join()
    if "error" in box:
        raise box["error"]
    return box["stats"]


def trainer_idle_gate(cfg) -> dict:
    """A scheduler that never decodes (idle only): no job runs before the trainer's drain, all run after it."""
    import multiprocessing as mp

    from rollplex_megatron.rollout.sglang.client import TrainerBridge

    ref, actor = _models(cfg)
    bridge = TrainerBridge(timeout=60)
    proc = mp.get_context("spawn").Process(target=scheduler_main, args=(bridge.env(), 0, 0.01), daemon=True)
    proc.start()
    seen = {}
    try:
        bridge.accept(timeout=120)
        bridge.send_modules({"reference": ref, "actor": actor}, cfg.model, "float32", {}, 1)
        _, items, *_ = _jobs(cfg, 0, 2)
        stats = run_then_drain(bridge, 0, items, 2.0, lambda: seen.update(before=sum(i.done for i in items)))
        seen.update(after=sum(i.done for i in items), in_window=stats["items_in_window"], n=len(items))
    finally:
        bridge.close()
        proc.join(30)
    return seen


def trainer_early_drain(cfg, mutation: str = "", timeout: float = 60.0) -> dict:
    """A rollout so short that the trainer's Drain reaches an idle-only scheduler before the step's BeginStep:
    every job must still run (after the drain), none may wait for a drain that already came."""
    import multiprocessing as mp

    from rollplex_megatron.rollout.sglang.client import TrainerBridge

    ref, actor = _models(cfg)
    bridge = TrainerBridge(timeout=timeout)
    proc = mp.get_context("spawn").Process(target=scheduler_main, args=(bridge.env(), 0, 0.01, mutation),
                                           daemon=True)
    proc.start()
    try:
        bridge.accept(timeout=120)
        bridge.send_modules({"reference": ref, "actor": actor}, cfg.model, "float32", {}, 1)
        out = {}
        for step in range(2):
            _, items, *_ = _jobs(cfg, step, 2)
            bridge.drain(step)  # on the wire before the step's BeginStep
            try:
                stats = bridge.run_step(step, items)
            except Exception as e:
                out["error"] = f"{type(e).__name__}: {e}"
                break
            out[step] = (sum(i.done for i in items), len(items), stats["items_after"])
        return out
    finally:
        bridge.close()
        proc.join(30)


def trainer_failure(cfg, mutation: str, timeout: float) -> dict:
    """A trainer rank facing a failing scheduler: the error it raises, and how long it took."""
    t0 = time.perf_counter()
    try:
        trainer_kv(cfg, mutation, steps=1, groups=2, timeout=timeout, decode_steps=2)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.perf_counter() - t0}
    return {"error": None, "seconds": time.perf_counter() - t0}


def trainer_dies(cfg) -> dict:
    """A trainer that dies after sending its jobs: the scheduler process must drop them and go on."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    report = ctx.Queue()
    box = ctx.Queue()
    tr = ctx.Process(target=_dying_trainer, args=(cfg, box, report))
    tr.start()
    tr.join(120)
    sched = box.get(timeout=5)
    res = report.get(timeout=60)  # the scheduler's loop ended by itself
    for _ in range(100):  # and its process exits
        try:
            os.kill(sched, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(sched, 9)
        res["left_running"] = True
    return {"trainer_exit": tr.exitcode, "scheduler": res}


def _dying_trainer(cfg, box, report) -> None:
    import multiprocessing as mp

    from rollplex_megatron.rollout.sglang import protocol as P
    from rollplex_megatron.rollout.sglang.client import TrainerBridge

    ref, actor = _models(cfg)
    bridge = TrainerBridge(timeout=60)
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=scheduler_main, args=(bridge.env(), 3, 0.5, "", report))  # not a daemon: outlives us
    proc.start()
    box.put(proc.pid)
    bridge.accept(timeout=120)
    bridge.send_modules({"reference": ref, "actor": actor}, cfg.model, "float32", {}, 1)
    _, items, *_ = _jobs(cfg, 0, 3)
    bridge.link.send(P.BeginStep(0, len(items)))
    bridge.link.recv("ack")
    for i, it in enumerate(items):
        bridge.link.send(P.Job(0, i, it.name, it.job.module, it.job.prompt))
    os._exit(7)


def trainer_bad_job(cfg) -> str:
    """A step whose first reference job has a token id past the vocabulary: the error the trainer raises."""
    import dataclasses
    import multiprocessing as mp

    from rollplex_megatron.rollout.sglang.client import TrainerBridge

    ref, actor = _models(cfg)
    bridge = TrainerBridge(timeout=60)
    proc = mp.get_context("spawn").Process(target=scheduler_main, args=(bridge.env(), 2, 0.01), daemon=True)
    proc.start()
    try:
        bridge.accept(timeout=120)
        bridge.send_modules({"reference": ref, "actor": actor}, cfg.model, "float32", {}, 1)
        _, items, *_ = _jobs(cfg, 0, 2)
        ref_items = [i for i in items if i.job.module == "reference"]
        bad = ref_items[0].job.prompt.input_ids.clone()
        bad[1] = 10**6  # past the padded vocabulary too
        ref_items[0].job.prompt = dataclasses.replace(ref_items[0].job.prompt, input_ids=bad)
        try:
            bridge.run_step(0, ref_items, drain=True)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return "no error"
    finally:
        bridge.close()
        proc.join(30)


def sglang_shards(hf_dir: str, t: int, r: int, loader: str = "alias") -> dict:
    """SGLang-layout shards of a training rank: each equals SGLang's shard cut from the HF tensors by the
    layout rules (`weights/layout.py`), views alias the training storage, and after SGLang's parameters are
    bound by the loader they are the same memory: an optimizer step (plus `refresh`) reaches them."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from rollplex_megatron.compat import apply_cpu_shims
    from rollplex_megatron.models.qwen25vl import build_model
    from rollplex_megatron.models.qwen25vl.hf import HFCheckpoint, load_hf_into_model
    from rollplex_megatron.rollout.sglang import weights as SW
    from rollplex_megatron.weights import layout as WL
    from rollplex_megatron.models.qwen25vl import hf_layout as CL

    apply_cpu_shims()
    dist.init_process_group("gloo")
    g = dist.get_rank()
    ck = HFCheckpoint(hf_dir)
    cfg = ck.model_config()
    ps.initialize_model_parallel(tensor_model_parallel_size=t)
    train = build_model(cfg)
    load_hf_into_model(train, ck, cfg, ps.get_tensor_model_parallel_rank(), t, 0, 1)
    shards = SW.SGLangShards(train, cfg, t, r, ps.get_tensor_model_parallel_group(), g)
    rules = {x.mcore: x for x in CL.model_rules(cfg, r, 1, ck.naming)}
    tparams = dict(train.named_parameters())
    out = {"value": [], "alias": {}, "names": [], "allocated": shards.allocated_bytes()}
    for mname, (sname, tensor) in zip(shards.names, shards.named_tensors()):
        rule = rules[mname]
        hf = [ck.get(n).float() for n in rule.hf]
        need = WL.shard_index("sglang", rule, [tuple(h.shape) for h in hf], r, g % r, cfg)
        if need.dim is None:
            want = hf[0]
        else:
            canon = torch.cat(hf, dim=need.dim)
            want = canon.index_select(need.dim, need.index.clamp_min(0))
            pad = need.index < 0
            if pad.any():
                shape = [1] * want.dim()
                shape[need.dim] = -1
                want = want.masked_fill(pad.view(shape), 0)
        out["value"].append(float((tensor - want).abs().max()) if tensor.shape == want.shape else float("inf"))
        same = tensor.untyped_storage().data_ptr() == tparams[mname].untyped_storage().data_ptr()
        out["alias"][mname] = (shards.classes[mname], same)
        out["names"].append(sname)
    # SGLang's model stand-in: parameters of SGLang's names and shapes, holding their own (dummy) memory
    sg = SW._holder({n.replace(".", "__"): t_.shape for n, t_ in shards.named_tensors()}, next(train.parameters()))
    dummy = {n.replace("__", "."): torch.nn.Parameter(torch.randn(p.shape), requires_grad=False)
             for n, p in sg.named_parameters()}
    model = torch.nn.Module()
    for n, p in dummy.items():
        model._parameters[n.replace(".", "__")] = p
    named = [(n.replace(".", "__"), t_) for n, t_ in shards.named_tensors()]
    if loader == "alias":
        SW.alias_loader(model, named)
    else:  # mutation: the loader copies into SGLang's own memory
        for n, t_ in named:
            dict(model.named_parameters())[n].data.copy_(t_)
    mp = dict(model.named_parameters())
    out["bound"] = all(mp[n].untyped_storage().data_ptr() == t_.untyped_storage().data_ptr() for n, t_ in named)
    with torch.no_grad():  # an optimizer step on the training weights, then the step's refresh
        for p in train.parameters():
            p.add_(torch.sin(3 * p) + 0.1)
    shards.refresh()
    fresh = SW.SGLangShards(train, cfg, t, r, ps.get_tensor_model_parallel_group(), g)  # what a new binding gives
    out["after_step"] = max(float((mp[n] - t_).abs().max()) for (n, _), (_, t_) in zip(named, fresh.named_tensors()))
    dist.destroy_process_group()
    return out


class StandInEngine:
    """Stand-in for `sglang.Engine` (SGLang cannot be installed here): starts the stand-in scheduler process
    (which connects to the bridge and loads its model through the plugin's hook) and answers `generate` in
    SGLang's output format, with tokens drawn from each entry's `sampling_seed`."""

    calls: list = []

    def __init__(self, **kwargs):
        import multiprocessing as mp

        from rollplex_megatron.rollout.sglang import protocol as P

        StandInEngine.calls.append(("__init__", kwargs))
        env = {k: os.environ[k] for k in (P.ENV_ADDRESS, P.ENV_KEY, P.ENV_TIMEOUT)}
        ctx = mp.get_context("spawn")
        self.report = ctx.Queue()
        self.proc = ctx.Process(target=scheduler_main, args=(env, 4, 0.01, "", self.report, StandInEngine.shapes),
                                daemon=True)
        self.proc.start()

    def generate(self, input_ids, sampling_params, image_data=None, video_data=None, return_logprob=False):
        StandInEngine.calls.append(("generate", {"input_ids": input_ids, "sampling_params": sampling_params,
                                                 "image_data": image_data, "video_data": video_data,
                                                 "return_logprob": return_logprob}))
        return [standin_output(sp) for sp in sampling_params]

    def release_memory_occupation(self, tags=None):
        StandInEngine.calls.append(("release_memory_occupation", {"tags": tags}))

    def resume_memory_occupation(self, tags=None):
        StandInEngine.calls.append(("resume_memory_occupation", {"tags": tags}))

    def shutdown(self):
        self.proc.join(30)


def standin_output(sp: dict) -> dict:
    """What the stand-in SGLang generates for one entry: SGLang's output dict."""
    g = torch.Generator().manual_seed(sp["sampling_seed"])
    toks, fin = [], {"type": "length", "length": sp["max_new_tokens"]}
    for _ in range(sp["max_new_tokens"]):
        toks.append(int(torch.randint(0, 100, (1,), generator=g)))
        if toks[-1] in sp["stop_token_ids"]:
            fin = {"type": "stop", "matched": toks[-1]}
            break
    lps = [-float(x) for x in torch.rand(len(toks), generator=g)]
    return {"text": "", "output_ids": toks,
            "meta_info": {"output_token_logprobs": [(lp, t, None) for lp, t in zip(lps, toks)], "finish_reason": fin}}


class StandInSGLang:
    """Stand-in for the `sglang` package: only `Engine`."""

    Engine = StandInEngine


def adapter_rollout(cfg) -> dict:
    """SGLangEngine over the stand-in: SGLang's parameters bound at load, a rollout with window jobs."""
    from megatron.core import parallel_state as ps

    from rollplex_megatron.rollout.sampling import SamplingParams
    from rollplex_megatron.rollout.sglang.engine import SGLangEngine
    from rollplex_megatron.rollout.sglang.weights import SGLangShards
    from tests.rollout_workers import requests as make_requests

    ref, actor = _models(cfg)
    shards = SGLangShards(actor, cfg.model, 1, 1, ps.get_tensor_model_parallel_group(), 0)
    StandInEngine.shapes = {n: tuple(t.shape) for n, t in shards.named_tensors()}
    del shards
    eng = SGLangEngine(actor, ref, cfg, ps.get_tensor_model_parallel_group(), sglang=StandInSGLang)
    reqs = make_requests(cfg, 3)
    gs, items, ref_kv, actor_kv, states = _jobs(cfg, 0, 3)
    from rollplex_megatron.rollout.window import DecodeWindow

    window = DecodeWindow()
    window.queue.extend(items)
    out = eng.generate(reqs, SamplingParams(temperature=0.7, top_p=0.9, top_k=5), window)
    d_ref, d_actor, _ = _direct(ref, actor, gs)
    rel = [rel_err(a, b) for st, d in ((ref_kv, d_ref), (actor_kv, d_actor)) for k in d.leaves
           for a, b in zip(st.leaves[k], d.leaves[k])]
    eng.sync_weights()
    eng.shutdown()
    sched = eng.engine.report.get(timeout=30)
    return {"calls": StandInEngine.calls, "results": out.results, "reqs": [(r.n, r.max_new_tokens, r.seed,
            r.stop_token_ids) for r in reqs], "rel": rel, "finished": len(window.finished),
            "stats": window.stats(), "bound": sched["bound"], "n_params": len(StandInEngine.shapes)}


def gpu_ipc(cfg, mutation: str = "") -> dict:
    """GPU: a trainer and the stand-in scheduler in two processes, over real CUDA IPC handles. The scheduler's
    modules alias the trainer's weights (an in-place change between steps reaches them with nothing sent), and
    the reference K/V the trainer receives are the scheduler's memory (this process allocates nothing for
    them) and equal the directly computed K/V."""
    import multiprocessing as mp

    from rollplex_megatron.rollout.sglang.client import TrainerBridge, on_device

    if mutation == "copy_kv":  # the trainer copies the K/V it receives instead of keeping the scheduler's memory
        from rollplex_megatron.rollout.window.jobs import PrefixJob

        accept = PrefixJob.accept
        PrefixJob.accept = lambda self, kv: accept(self, {n: (k.clone(), v.clone()) for n, (k, v) in kv.items()})
    ref, actor = _models(cfg)
    bridge = TrainerBridge(timeout=120)
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=scheduler_main, args=(bridge.env(), 4, 0.01), daemon=True)
    proc.start()
    out = {"rel": [], "allocated": [], "kv_bytes": []}
    try:
        bridge.accept(timeout=300)
        bridge.send_modules({"reference": ref, "actor": actor}, cfg.model, "float32", {}, 1)
        for step in range(2):
            gs, items, ref_kv, _, _ = _jobs(cfg, step, 3)
            ref_items = [i for i in items if i.job.module == "reference"]
            for it in ref_items:  # the trainer's prompts live on its GPU (the copy `on_device` would make is
                it.job.prompt = on_device(it.job.prompt)  # kept alive by torch's IPC limbo, not K/V memory)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            bridge.run_step(step, ref_items, drain=True)
            out["allocated"].append(torch.cuda.memory_allocated() - before)
            out["kv_bytes"].append(sum(t.nbytes for kv in ref_kv.leaves.values() for t in kv))
            out["device"] = str(next(t for kv in ref_kv.leaves.values() for t in kv).device)
            d_ref, _, _ = _direct(ref, actor, gs)
            out["rel"] += [rel_err(a, b) for k in d_ref.leaves for a, b in zip(ref_kv.leaves[k], d_ref.leaves[k])]
            del ref_kv
            with torch.no_grad():  # the weights change in place: the scheduler's modules must see it
                for p in ref.parameters():
                    p.mul_(1.25)
    finally:
        bridge.close()
    proc.join(60)
    return out


def trainer_kv_tp2(cfg) -> dict:
    """Two trainer ranks at training TP 2, each with its stand-in scheduler (SGLang TP 2 over a gloo world of
    their own): the prefix jobs' collectives run in the schedulers' bridge groups, ranks agreeing on every
    job, and each rank's K/V shard equals the direct prefix stage's at TP 2."""
    import multiprocessing as mp

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from rollplex_megatron.dist import free_port
    from rollplex_megatron.rollout.sglang import protocol as P
    from rollplex_megatron.rollout.sglang.client import TrainerBridge

    ref, actor = _models(cfg, 2)
    rank, group = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
    shared = [P.new_key(), free_port()]
    dist.broadcast_object_list(shared, src=0, group=group)
    os.environ[P.ENV_KEY] = shared[0]
    bridge = TrainerBridge(timeout=60)
    addrs = [None, None]
    dist.all_gather_object(addrs, bridge.address, group=group)
    ctx = mp.get_context("spawn")
    report = ctx.Queue()
    proc = ctx.Process(target=scheduler_main, args=(bridge.env(addrs), 4, 0.01, "", report, None, rank, 2,
                                                    shared[1]), daemon=True)
    proc.start()
    out = {"rel": [], "in_window": 0}
    try:
        hello = bridge.accept(timeout=120)
        out["hello"] = (hello.tp_rank, hello.tp_size)
        bridge.send_modules({"reference": ref, "actor": actor}, cfg.model, "float32", {}, 2)
        for step in range(2):
            gs, items, ref_kv, actor_kv, _ = _jobs(cfg, step, 2)
            stats = run_then_drain(bridge, step, items, 0.5)
            out["in_window"] += stats["items_in_window"]
            d_ref, d_actor, _ = _direct(ref, actor, gs)
            for got, want in ((ref_kv, d_ref), (actor_kv, d_actor)):
                out["rel"] += [rel_err(a, b) for k in want.leaves for a, b in zip(got.leaves[k], want.leaves[k])]
            with torch.no_grad():
                for p in actor.parameters():
                    p.add_(0.1 * torch.sin(p))  # the same change on both ranks' shards (no randomness)
    finally:
        bridge.close()
    proc.join(30)
    out["scheduler_exit"] = proc.exitcode
    return out
