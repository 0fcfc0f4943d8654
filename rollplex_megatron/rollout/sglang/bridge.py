"""The bridge inside SGLang's scheduler process: prefix jobs from the trainer run in SGLang's decode loop.

`plugin.py` wraps `Scheduler.run_batch` and `Scheduler.on_idle`; they call `SchedulerBridge.on_decode_step`
after a decode forward has been enqueued and `on_idle` when no batch runs. The bridge drives the same
`DecodeWindow` the embedded engine drives (one implementation of the mechanisms and the policy, two
drivers): interleaved items run on the bridge's own CUDA stream, side-stream mechanisms on the
window's side stream from its issuer thread.

Threads: a reader takes the trainer's messages (modules, jobs, step handshakes) and queues jobs; a
sender waits for each finished job's CUDA event (off the decode thread, which never synchronises
the device) and sends the K/V back as IPC handles. When the trainer goes away the bridge drops its
queue and SGLang keeps serving.

Collective order (SGLang TP > 1): a job's prefix stage at training TP has collectives on the bridge's
own process groups (megatron's model-parallel groups built over SGLang's world, not SGLang's groups).
SGLang's TP ranks run the same scheduler iterations in lockstep, but a job may reach one rank's
reader an iteration before another's; so at every hook call the ranks agree (a MIN all-reduce on the
bridge's CPU group) on how many queued jobs every rank holds, and only those enter the window. Every
rank then issues the same jobs at the same hook call, in job order.
"""
from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from collections import deque
from contextlib import nullcontext
from functools import partial

import torch
import torch.distributed as dist

from rollplex_megatron.attention.kv_store import KVStore
from rollplex_megatron.prefix import execution as X
from rollplex_megatron.prefix.batch import Group
from rollplex_megatron.rollout.sglang import protocol as P
from rollplex_megatron.rollout.window import DecodeWindow, check_mechanism
from rollplex_megatron.weights.share import bind_parameter

log = logging.getLogger(__name__)


def bridge_parallel(tp: int, seed: int = 1234) -> None:
    """Megatron's model-parallel state for the jobs' modules, in this (scheduler) process: new groups (the
    bridge's own) over SGLang's world, or over a world of this process alone where there is none."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from rollplex_megatron.compat import apply_cpu_shims
    from rollplex_megatron.dist import free_port

    apply_cpu_shims()
    if ps.model_parallel_is_initialized():
        return
    if not dist.is_initialized():  # not the environment's RANK/MASTER_*: those may be the trainer's
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1,
                                init_method=f"tcp://127.0.0.1:{free_port()}")
    if dist.get_world_size() % tp:
        raise P.BridgeError(f"the SGLang world has {dist.get_world_size()} ranks, not a multiple of the training "
                            f"TP {tp} the prefix jobs run at; run SGLang at tp_size = parallel.tp")
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(seed)  # megatron's layers fork its RNG tracker while they are built


def bind_modules(handles: P.ModuleHandles) -> dict:
    """The jobs' modules: each built on the meta device and its parameters replaced by the trainer's
    tensors (handles: the same memory, no copy)."""
    from rollplex_megatron.models.registry import model_spec

    bridge_parallel(handles.tp)
    models = {}
    for name, params in handles.params.items():
        model = model_spec(handles.model_cfg).build(handles.model_cfg, handles.dtype, handles.megatron, meta=True)
        mods = dict(model.named_modules())
        for pname, tensor in params.items():
            bind_parameter(mods, pname, tensor)
        left = [n for n, p in model.named_parameters() if p.is_meta]
        if left:
            raise P.BridgeError(f"module {name}: parameter {left[0]} (and {len(left) - 1} more) was not sent by the "
                                f"trainer; send every parameter of the model")
        models[name] = model.eval()
    return models


def run_prefix(model, prompt) -> dict:
    """One prefix stage without a graph; {layer: (k, v)}, the tensors the trainer will alias."""
    store = KVStore()
    with torch.no_grad():
        X.prefix_forward(model, [Group(prompt, [], torch.zeros(0))], store, keep_graph=False, group_ids=[0])
    return {layer: kv for (layer, _), kv in store.leaves.items()}


class SchedulerBridge:
    """One scheduler process's end of the bridge."""

    def __init__(self, link: P.Link, tp_rank: int, tp_size: int, window: DecodeWindow | None = None,
                 version: str = "unknown", cpu_group=None):
        self.link, self.tp_rank, self.tp_size = link, tp_rank, tp_size
        self.window = window or DecodeWindow()
        self.models: dict = {}
        self.pending: deque = deque()  # jobs received, not yet agreed on by every rank
        self.step = -1  # the trainer's RL step in flight
        self.decode_steps = 0
        self.closed = threading.Event()
        self.error: str | None = None
        self._group = cpu_group  # SGLang TP > 1: where ranks agree on the jobs they hold
        # threads start on device 0: every thread of the bridge sets the scheduler's device first
        self._device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self._stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self._out: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        # the latest step whose Drain arrived: the trainer's Drain comes from its decode thread and its BeginStep
        # from its bridge thread, so a short rollout's Drain can overtake the BeginStep of its own step
        self._drained = -2
        self._new_step(-1, 0)
        self.weights = threading.Event()  # set once the trainer's WeightHandles arrived
        self._weights: list = []
        self._idle = False  # on_idle is draining the window (its jobs ran after decode, not in the window)
        self._modules_msg = None  # ModuleHandles received, not yet bound
        link.send(P.Hello(tp_rank, tp_size, os.getpid(), version))
        self._reader = threading.Thread(target=self._read, name="rollplex-bridge-reader", daemon=True)
        self._sender = threading.Thread(target=self._send, name="rollplex-bridge-sender", daemon=True)
        self._reader.start()
        self._sender.start()

    # --- the scheduler loop's hooks --------------------------------------------------------------
    def on_decode_step(self, active: int) -> None:
        """After a decode forward was enqueued: the window's next items, on the bridge's stream."""
        _, closed = self._admit()
        if closed:
            return
        if not self._wave:  # the step's decoding starts: `tail` and `auto` look at the wave's size
            self._wave = True
            self.window.on_wave(active)
        self.decode_steps += 1
        with self._on_stream():
            self.window.on_decode_step(self.decode_steps, active)

    def on_idle(self) -> None:
        """No batch runs: once the trainer said the rollout's decoding is over (`Drain`), run every admitted
        job; before that, SGLang is only idle between the step's start and its first batch."""
        drain, closed = self._admit()
        if closed or not drain or not (self.window.queue or self.window._issuer is not None):
            return
        self._idle = True
        try:
            with self._on_stream():
                self.window.on_idle()  # joins a side-stream issuer too
        finally:
            self._idle = False

    def bind_weights(self, model, timeout: float) -> int:
        """While SGLang loads (before its KV cache and CUDA graphs): wait for the trainer's shards and make
        `model`'s parameters those tensors (`weights.alias_loader`); returns how many were bound."""
        from rollplex_megatron.rollout.sglang.weights import alias_loader

        if not self.weights.wait(timeout):
            raise P.BridgeTimeout(f"the trainer sent no weights within {timeout:g} s while SGLang loaded its model")
        alias_loader(model, self._weights)
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()
            torch.cuda.empty_cache()  # what SGLang had allocated for its own (dummy) weights goes back
        self.link.send(P.Ack("weights"))
        return len(self._weights)

    # --- internals -------------------------------------------------------------------------------
    def _on_stream(self):
        return torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()

    def _new_step(self, step: int, jobs: int) -> None:
        with self._lock:
            self.step, self._jobs_done, self._jobs_expected, self._ended = step, 0, jobs, False
            self._wave, self._decode0 = False, self.decode_steps
            self._stats = {"items_in_window": 0, "items_after": 0, "window_s": 0.0, "after_s": 0.0}

    def _admit(self) -> tuple[bool, bool]:
        """Move the jobs every rank holds into the window (in job order); returns (every rank may drain,
        closed). Only the decode thread touches the queues; a closed bridge drops them here. At SGLang TP > 1
        every rank joins the agreement at every hook call, closed or not, so none waits on another."""
        closed = self.closed.is_set()
        with self._lock:
            drained = self._drained >= self.step >= 0
        n, drain = (0 if closed else len(self.pending)), (not closed and drained)
        bind = not closed and self._modules_msg is not None
        if self._group is not None:
            t = torch.tensor([n, int(drain), int(bind), int(closed)])
            dist.all_reduce(t[:3], op=dist.ReduceOp.MIN, group=self._group)
            dist.all_reduce(t[3:], op=dist.ReduceOp.MAX, group=self._group)
            n, drain, bind, closed = int(t[0]), bool(t[1]), bool(t[2]), bool(t[3])
        if closed:
            self.pending.clear()
            self.window.queue.clear()
            return False, True
        if bind:
            self._bind_modules()
        for _ in range(n):
            job, ready = self.pending.popleft()
            self.window.submit(job.name, partial(self._run_job, job, ready))
        return drain, False

    def _bind_modules(self) -> None:
        """The trainer's modules, bound on the decode thread at the same hook call on every rank."""
        msg, self._modules_msg = self._modules_msg, None
        try:
            if msg.window:  # the trainer's mode.window settings; side-stream mechanisms need TP=1
                check_mechanism(msg.window.get("mechanism", "interleave"), self.tp_size, 1)
                self.window = DecodeWindow(**msg.window)
            self.models = bind_modules(msg)
            if torch.cuda.is_available():
                torch.cuda.current_stream().synchronize()  # once per binding: the received parameters are ready
        except Exception as e:  # the trainer hears of it (Failed, then a closed link)
            self._close(f"binding the modules failed: {type(e).__name__}: {e}")
            return
        self.link.send(P.Ack("modules"))

    def _run_job(self, job: P.Job, ready=None) -> None:
        t0 = time.perf_counter()
        if ready is not None:  # the job's tensors were received (and their producer's event waited on) there
            torch.cuda.current_stream().wait_event(ready)
        try:
            kv = run_prefix(self.models[job.module], job.prompt)
        except Exception as e:  # reported to the trainer, which raises it naming the item
            self._out.put((P.Failed(job.step, job.index, job.name, f"{type(e).__name__}: {e}"), None))
            return
        event = None
        if torch.cuda.is_available():
            event = torch.cuda.Event()
            event.record()  # on the stream the job ran on (the bridge's, or the window's side stream)
        self._out.put((P.Result(job.step, job.index, kv, time.perf_counter() - t0, not self._idle), event))

    def _thread_device(self) -> None:
        if self._device is not None:
            torch.cuda.set_device(self._device)

    def _read(self) -> None:
        self._thread_device()
        try:
            while True:
                # no limit: SGLang's start-up and the trainer's phases between rollouts take as long as they take;
                # a trainer that dies closes the connection
                msg = self.link.recv("the trainer's next message", timeout=math.inf)
                if isinstance(msg, P.WeightHandles):
                    self._weights = msg.named
                    self.weights.set()
                elif isinstance(msg, P.ModuleHandles):  # bound by the decode thread (`_admit`): building
                    self._modules_msg = msg  # megatron's groups is collective, and one thread issues them all
                elif isinstance(msg, P.BeginStep):
                    self._new_step(msg.step, msg.jobs)
                    self.link.send(P.Ack(f"step {msg.step}"))
                elif isinstance(msg, P.Job):
                    if msg.step != self.step:
                        raise P.BridgeError(f"job {msg.name} is for step {msg.step}, but step {self.step} is open")
                    ready = None
                    if torch.cuda.is_available():  # unpickling made this thread's stream wait for the sender
                        ready = torch.cuda.Event()
                        ready.record()
                    self.pending.append((msg, ready))
                elif isinstance(msg, P.Drain):
                    with self._lock:
                        self._drained = max(self._drained, msg.step)
                elif isinstance(msg, P.EndStep):
                    with self._lock:
                        self._ended = True
                    self._out.put((None, None))  # the sender checks whether the step is complete
                else:
                    raise P.BridgeError(f"unexpected message {type(msg).__name__} from the trainer")
        except P.BridgeError as e:
            self._close(str(e))
        except Exception as e:  # a bad module or message: the trainer hears of it through the closed link
            self._close(f"{type(e).__name__}: {e}")

    def _send(self) -> None:
        self._thread_device()
        while not self.closed.is_set():
            msg, event = self._out.get()
            try:
                if msg is not None:
                    if event is not None:
                        event.synchronize()  # this thread waits, not the decode loop
                    self.link.send(msg)
                    with self._lock:
                        self._jobs_done += 1
                        if isinstance(msg, P.Result):  # the step's statistics, from what was sent
                            where = "window" if msg.in_window else "after"
                            self._stats["items_in_window" if msg.in_window else "items_after"] += 1
                            self._stats[f"{where}_s"] += msg.seconds
                with self._lock:
                    done = self._ended and self._jobs_done == self._jobs_expected
                    stats = {**self._stats, "window_mechanism": self.window._resolved or self.window.mechanism,
                             "decode_steps": self.decode_steps - self._decode0}
                    if done:
                        self._ended = False
                if done:
                    self.link.send(P.StepDone(self.step, stats))
            except P.BridgeError as e:
                self._close(str(e))

    def _close(self, why: str) -> None:
        """The trainer is gone (or broke the protocol): the decode thread drops the queues at its next hook call
        (`_admit`), and SGLang keeps serving."""
        if self.closed.is_set():
            return
        self.error = why
        self.closed.set()
        self._out.put((None, None))
        log.error("rollplex SGLang bridge (tp rank %d) closed: %s", self.tp_rank, why)
        try:  # tell the trainer why, if it is still there
            self.link.send(P.Failed(self.step, -1, "the bridge", why))
        except P.BridgeError:
            pass
        try:
            self.link.close()
        except OSError:
            pass
