"""The decode window under verl: the reference prefix stage runs in SGLang's scheduler while it decodes.

verl's SGLang server replicas start SGLang's schedulers, one per GPU, on the training GPUs (colocated). With
`ROLLPLEX_SGLANG_BRIDGE=dir:PATH` in the Ray workers' environment (the recipe's `runtime_env`), the parts meet
through the SGLang bridge (`rollout/sglang/`):
- each worker rank's `RefWindow` listens, publishes its address for the scheduler on its GPU
  (`protocol.publish`), and once that scheduler connected (at its first hook call) sends it the reference
  model as parameter handles (the scheduler's modules alias the worker's reference weights);
- during the rollout, verl's agent loop stores each finished sample in TransferQueue; the `rollplex` trainer
  polls it and hands each uid's prompt (read from its first finished sample: exactly what the batch will
  hold) to a DP rank (`RollplexTrainer`, which later keeps each uid on that rank when it balances the batch);
  the rank sends it as a prefix job, and the scheduler runs it between decode steps (the jobs left when
  decoding ends, when SGLang is idle);
- verl's reference phase (`compute_ref_log_prob`) then reaches the engine, which takes each group's prefix K/V
  from the window when the job's prompt equals the group's bit for bit, and runs the prefix stage itself for
  the others (`RollplexMegatronEngine.forward_backward_batch`).
The update is unchanged: the same K/V, computed in another process on the same weights.
"""
from __future__ import annotations

import logging
import os
import queue
import threading

from megatron.core import parallel_state as ps

from rollplex_megatron.attention.kv_store import KVStore
from rollplex_megatron.integrations.verl.batch import same_prompt
from rollplex_megatron.prefix.batch import Prompt
from rollplex_megatron.rollout.sglang import protocol as P
from rollplex_megatron.rollout.sglang.client import TrainerBridge, shareable
from rollplex_megatron.rollout.window import WorkItem
from rollplex_megatron.rollout.window.policy import check_mechanism
from rollplex_megatron.rollout.window.jobs import PrefixJob

log = logging.getLogger(__name__)
ENV_MECHANISM = "ROLLPLEX_VERL_WINDOW_MECHANISM"  # mode.window for the scheduler's jobs (default interleave)
STARTUP_S = 7 * 24 * 3600.0  # the accept waits as long as the run; the first reference phase judges a no-show


def window_dir():
    """The rendezvous directory when the decode window under verl is on (`ROLLPLEX_SGLANG_BRIDGE=dir:PATH`)."""
    return P.rendezvous_dir()


class RefWindow:
    """One worker rank's end of the window: its listener (published for the scheduler on its device), the
    reference model sent once that scheduler connected, and each batch of prefix jobs run as one bridge step
    from a thread of its own. `take(uids)` hands the engine those uids' K/V after every job sent was answered."""

    def __init__(self, model, model_cfg, dtype: str, megatron: dict, directory, model_path: str | None = None,
                 timeout: float | None = None):
        self.model = model
        self.bridge = TrainerBridge(timeout=timeout)
        self.tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        self.slot = P.device_slot(self.tp_rank)
        self.received: dict[str, tuple[Prompt, KVStore]] = {}
        self.steps = 0  # bridge steps run (one per batch of jobs)
        self.dropped = 0  # uids whose K/V no reference phase took
        self.error: BaseException | None = None
        self.connected = threading.Event()
        self._spec = (model_cfg, dtype, megatron or {}, tp)
        mechanism = os.environ.get(ENV_MECHANISM, "interleave")
        try:  # refused here, at start-up, rather than in SGLang's scheduler
            check_mechanism(mechanism, tp, 1)
        except ValueError as e:
            raise ValueError(f"{ENV_MECHANISM}={mechanism}: {e}") from None
        self.mechanism = {"mechanism": mechanism, "items_per_step": 1}  # at most one job between decode steps
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._open = 0  # batches queued or running
        for p in model.parameters():  # CPU: into shared memory now, so every handle stays valid
            shareable(p.data)
        self.path = P.publish(directory, self.slot, self.bridge.address, self.bridge.key, model_path)
        self._thread = threading.Thread(target=self._run, name="rollplex-verl-window", daemon=True)
        self._thread.start()

    def submit(self, prompts: dict) -> int:
        """Queue the reference prefix stage of each uid's prompt ({uid: Prompt}); returns how many."""
        if not prompts:
            return 0
        with self._lock:
            self._open += 1
        self._jobs.put(dict(prompts))
        return len(prompts)

    def take(self, uids) -> dict:
        """The K/V of `uids` among the jobs sent so far ({uid: (prompt, store with the K/V as group 0)}), after
        the last job was answered; other uids' K/V are dropped (the reference phase of a step scores every group
        it will score). Raises, in the reference phase, when the scheduler never connected (after a whole
        rollout it would have, were the plugin loaded there) or a job failed."""
        if not self.connected.is_set() and self.error is None:
            raise RuntimeError(f"rollplex verl window: no SGLang scheduler connected through {self.path} by the "
                               f"reference phase: is this package installed where SGLang runs (its "
                               f"sglang.srt.plugins entry point), and {P.ENV_ADDRESS} in the Ray workers' "
                               f"environment?")
        with self._idle:
            while self._open:
                self._idle.wait()
            if self.error is not None:
                err, self.error = self.error, None
                raise RuntimeError(f"rollplex verl window: {err}") from err.__cause__
            out = {u: self.received.pop(u) for u in uids if u in self.received}
            self.dropped += len(self.received)
            self.received.clear()
        return out

    def adopt(self, vg, todo: list[int], store: KVStore, version: int = 0) -> list[int]:
        """Move into `store` the window's K/V of each group in `todo` whose prompt equals the job's bit for bit;
        returns the groups that still need their prefix stage. A job whose prompt differs is dropped (and logged):
        the reference phase computes that prefix itself. (`version`: the reference's weights do not change.)"""
        got = self.take({vg.uids[g] for g in todo})
        left = []
        for g in todo:
            entry = got.pop(vg.uids[g], None)
            if entry is not None and same_prompt(entry[0].to("cpu"), vg.groups[g].prompt.to("cpu")):
                store.adopt(entry[1], 0, g)
            else:
                if entry is not None:
                    log.warning("rollplex verl window: uid %s: the window's prompt differs from the batch's; its "
                                "prefix runs again", vg.uids[g])
                left.append(g)
        return left

    def close(self) -> None:
        self._jobs.put(None)
        self.bridge.close()
        self.path.unlink(missing_ok=True)

    def _run(self) -> None:
        try:  # the scheduler connects at its first hook call, once SGLang runs its loop; its connect waits for this
            hello = self.bridge.accept(timeout=STARTUP_S)
            if (hello.tp_rank, hello.tp_size) != (self.tp_rank, self._spec[3]):
                raise P.BridgeError(f"the SGLang scheduler on this GPU is TP rank {hello.tp_rank} of {hello.tp_size}, "
                                    f"this reference rank TP {self.tp_rank} of {self._spec[3]}: their shards differ "
                                    f"(SGLang orders a replica's GPUs by id; verl's worker ranks did not follow it)")
            self.bridge.send_modules({"reference": self.model}, *self._spec, self.mechanism)
            self.connected.set()
        except BaseException as e:  # every job would fail: the reference phase says why
            self._fail(e, f"the SGLang scheduler through {self.path}")
        while True:
            batch = self._jobs.get()
            if batch is None:
                return
            try:
                if not self.connected.is_set():
                    continue
                items = [WorkItem(f"reference_prefix[{uid}]", None, job=PrefixJob("reference", prompt, KVStore(), 0))
                         for uid, prompt in batch.items()]
                # prompts arrive as their rollouts finish: a job left when decoding ends may run as soon as
                # SGLang idles (drain at once); the reference phase waits for every answer in take()
                self.bridge.run_step(self.steps, items, drain=True)
                self.steps += 1
                with self._lock:
                    for uid, it in zip(batch, items):
                        self.received[uid] = (batch[uid], it.job.store)
            except BaseException as e:  # surfaced by take(), in the reference phase
                self._fail(e, f"step {self.steps}: reference prefix jobs of {len(batch)} uids")
            finally:
                with self._idle:
                    self._open -= 1
                    self._idle.notify_all()

    def _fail(self, e: BaseException, what: str) -> None:
        log.error("rollplex verl window: %s: %s: %s", what, type(e).__name__, e)
        with self._lock:
            if self.error is None:
                self.error = RuntimeError(f"{what} ({type(e).__name__}: {e})")
                self.error.__cause__ = e

