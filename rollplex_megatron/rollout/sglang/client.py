"""The trainer's end of the bridge: modules and prefix jobs out, prefix K/V back, one handshake per RL step.

A trainer rank listens once (`TrainerBridge`), SGLang's scheduler process for the same TP rank
connects when its plugin first runs, and the trainer sends the modules the jobs run on (every
parameter as a handle: the scheduler's modules alias the trainer's weights, so an optimizer step is
visible there at once, with no weight traffic). Each RL step, `run_step` sends the decode window's
jobs, at most `depth` unanswered (the bounded queue), records each job's K/V as it returns
(`PrefixJob.accept`: the trainer's tensors alias the scheduler's), and ends with the step handshake.
"""
from __future__ import annotations

import os
import threading

import torch

from rollplex_megatron.rollout.sglang import protocol as P
from rollplex_megatron.rollout.window import WorkItem


def shareable(t: torch.Tensor) -> torch.Tensor:
    """The tensor as it crosses processes without a copy: CUDA tensors as they are (IPC handles of their
    allocation); CPU tensors moved, in place, into shared memory."""
    if t.device.type == "cpu" and not t.is_shared():
        t.share_memory_()
    return t


def on_device(prompt):
    """The prompt with its tensors on this GPU (they cross as CUDA IPC handles; CPU tensors would need a
    file-descriptor hand-over that processes not spawned by each other cannot authenticate); on CPU as is."""
    return prompt.to(torch.cuda.current_device()) if torch.cuda.is_available() else prompt


class TrainerBridge:
    """One trainer rank's listener and connection to its SGLang scheduler process."""

    def __init__(self, host: str = "127.0.0.1", timeout: float | None = None):
        self.key = os.environ.get(P.ENV_KEY) or P.new_key()
        self.listener, self.address = P.listen(host, self.key)
        self.timeout = P.timeout_s() if timeout is None else timeout
        self.link: P.Link | None = None
        self.hello: P.Hello | None = None
        self._storage: dict[str, int] = {}
        self.step = -1

    def env(self, addresses: list[str] | None = None) -> dict:
        """The environment SGLang's scheduler processes need (`addresses`: every TP rank's, in rank order)."""
        return {P.ENV_ADDRESS: ",".join(addresses or [self.address]), P.ENV_KEY: self.key,
                P.ENV_TIMEOUT: str(self.timeout)}

    def accept(self, timeout: float | None = None) -> P.Hello:
        """Wait for the scheduler to connect (it does at its first hook call, after SGLang has loaded the
        model and captured its graphs: `timeout`, default the bridge's) and say who it is."""
        limit = self.timeout if timeout is None else timeout
        box: dict = {}

        def take():
            try:
                box["conn"] = self.listener.accept()
            except Exception as e:  # surfaced below
                box["error"] = e

        th = threading.Thread(target=take, name="rollplex-bridge-accept", daemon=True)
        th.start()
        th.join(limit)
        if "conn" not in box:
            raise P.BridgeTimeout(f"no SGLang scheduler connected to the rollplex bridge at {self.address} within "
                                  f"{limit:g} s: is the `rollplex` plugin loaded (installed with this package; "
                                  f"SGLANG_PLUGINS, if set, must name it) and the scheduler started with "
                                  f"{P.ENV_ADDRESS} in its environment? ({box.get('error', 'no connection')})")
        self.link = P.Link(box["conn"], "the SGLang scheduler", self.timeout)
        hello = self.link.recv("the scheduler's hello")
        if not isinstance(hello, P.Hello):
            raise P.BridgeError(f"the SGLang scheduler opened with {type(hello).__name__}, not Hello")
        self.link.peer = f"the SGLang scheduler (TP rank {hello.tp_rank}, pid {hello.pid})"
        self.hello = hello
        return hello

    def send_weights(self, named: list) -> None:
        """Hand SGLang's parameters over ([(SGLang name, tensor)], as handles) and wait until they are bound."""
        self.link.send(P.WeightHandles([(n, shareable(t)) for n, t in named]))
        self._expect(P.Ack, "the scheduler to bind SGLang's parameters to the training shards")

    def send_modules(self, modules: dict, model_cfg, dtype: str, megatron: dict, tp: int,
                     window: dict | None = None) -> None:
        """Hand the jobs' modules over (`modules`: name -> model; every parameter as a handle)."""
        params = {}
        for name, model in modules.items():
            params[name] = {n: shareable(p.data) for n, p in model.named_parameters()}
            self._storage.update({f"{name}.{n}": t.untyped_storage().data_ptr() for n, t in params[name].items()})
        self._modules, self._spec = modules, (model_cfg, dtype, megatron, tp, window)
        self.link.send(P.ModuleHandles(model_cfg, dtype, megatron or {}, tp, params, dict(window or {})))
        self._expect(P.Ack, "the scheduler to bind the modules")

    def moved(self) -> list[str]:
        """Parameters re-allocated since their handles were sent: the scheduler would read the old (stale)
        memory through the old handles."""
        return [f"{name}.{n}" for name, model in self._modules.items() for n, p in model.named_parameters()
                if p.data.untyped_storage().data_ptr() != self._storage[f"{name}.{n}"]]

    def drain(self, step: int) -> None:
        """The rollout's decoding is over: the scheduler may run the step's remaining jobs when idle."""
        self.link.send(P.Drain(step))

    def run_step(self, step: int, items: list[WorkItem], depth: int = 4, drain: bool = False) -> dict:
        """Run the window items of one RL step in the scheduler; returns its window statistics. Jobs left when
        decoding ends wait for `drain(step)` (from another thread; `drain=True`: allowed at once)."""
        if depth < 1:
            raise ValueError(f"bridge queue depth must be >= 1, got {depth}")
        missing = [i.name for i in items if i.job is None]
        if missing:
            raise ValueError(f"window item {missing[0]} has no job form (PrefixJob); the SGLang engine runs prefix "
                             f"stages only")
        if self.moved():  # handles again, before any job reads them
            self.send_modules(self._modules, *self._spec)
        self.step = step
        self.link.send(P.BeginStep(step, len(items)))
        self._expect(P.Ack, f"step {step}: the scheduler to open the step")
        if drain:
            self.drain(step)
        sent, open_ = 0, {}
        while sent < len(items) or open_:
            while sent < len(items) and len(open_) < depth:
                it = items[sent]
                self.link.send(P.Job(step, sent, it.name, it.job.module, on_device(it.job.prompt)))
                open_[sent] = it
                sent += 1
            oldest = items[min(open_)].name
            msg = self.link.recv(f"step {step}: item {oldest}")
            if isinstance(msg, P.Failed):
                raise P.BridgeError(f"step {step}: item {msg.name} failed in the SGLang scheduler: {msg.error}")
            if not isinstance(msg, P.Result) or msg.step != step or msg.index not in open_:
                raise P.BridgeError(f"step {step}: unexpected {type(msg).__name__} from the scheduler while "
                                    f"waiting for item {oldest}")
            it = open_.pop(msg.index)
            it.job.accept(msg.kv)
            it.done, it.seconds, it.in_window = True, msg.seconds, msg.in_window
        self.link.send(P.EndStep(step))
        done = self._expect(P.StepDone, f"step {step}: the scheduler to close the step")
        return done.stats

    def _expect(self, kind, waiting_for: str):
        msg = self.link.recv(waiting_for)
        if isinstance(msg, P.Failed):
            raise P.BridgeError(f"{waiting_for}: {msg.name} failed in the SGLang scheduler: {msg.error}")
        if not isinstance(msg, kind):
            raise P.BridgeError(f"{waiting_for}: got {type(msg).__name__}, expected {kind.__name__}")
        return msg

    def close(self) -> None:
        """Close the connection and the listener (the scheduler's bridge sees EOF and drops its queue)."""
        if self.link is not None:
            self.link.close()
        self.listener.close()
