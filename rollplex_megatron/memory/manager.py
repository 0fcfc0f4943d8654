"""Phase-aware residency at run time (docs/design.md §1): a plan's actions on the runtime's tensors.

The trainer enters every phase of the step through `MemoryManager.enter(phase)`. Managed classes:

  class              tensors                                          outside its phases
  main_weights       fp32 master weights of megatron's Float16 optimizer   offload
  optimizer_states   Adam's exp_avg / exp_avg_sq                            offload
  reference_weights  the frozen reference model                             offload (copied again only if written)
  grads              megatron DDP's grad buffers                            free (reallocated zeroed)

Under plan `phase` the phases each class is resident in are `planner.PHASE_RESIDENCY`, the same
table the planner predicts from; under `keep` every class stays.

The prefix classes follow their producers' lifetimes in code rather than here: the rollout KV cache
is freed when the rollout returns, the reference prefix K/V after the reference response stage, the
actor prefix K/V and gK/gV after each group's prefix backward, and under the `phase` plan the actor
prefix keeps no graph (it is recomputed one group, or one pack of `workload.prefix_pack_tokens`, at a time,
`prefix.execution`).

Offload: the device-to-host copy runs on a copy stream into persistent pinned host buffers, then
the device storage is released (`resize_(0)`, so every view, optimizer reference and DDP bucket
stays valid; reading a tensor of an offloaded class is invalid until it is back, so code outside
the step calls `restore_all()` first, or reads the host copies through `host_reader()`, as the checkpoint writer
does, with no device memory for it). The storage is marked as used by
the copy stream, so the caching allocator does not
hand it out before the copy has finished. Prefetch: the storage is re-allocated on the compute
stream, the host-to-device copy runs on the copy stream, and the compute stream waits on an event:
no host synchronisation on the hot path. `memory.copy_streams=2` gives each direction a stream of its
own: a prefetch then need not queue behind the offloads issued before it in the same `enter`
(rollplex's rollout entry offloads about 45 GB of Adam states and master weights at 3B and prefetches
the 7.5 GB reference its window needs; on one stream the compute stream waits for both). A class's
copy waits for its own previous copy on the other stream (a prefetch reads what its offload wrote).
`memory.prefetch_ahead` (`ahead`: class -> phase) brings a class back at the entry of the phase before its
own; the compute stream waits for its copy only at the entry of a phase that reads it (`needed_in`). Where update
and optimizer alternate (several mini-batches a step) the trainer names the phase that follows (`then`), and a class
comes back ahead only before a phase that reads it: the reference once a step, at the last optimizer step.
Without CUDA the same steps run synchronously on CPU buffers (the tests' bit-exactness of the round
trip and of the update holds there too).

`memory.optimizer_step=stream`: the released master weights and Adam states never come back as a whole; the
optimizer step reads and writes their host buffers bucket by bucket (`StreamedStep`, memory/stream_optimizer.py).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch

from rollplex_megatron.memory.planner import STREAMABLE, released, resident_phases
from rollplex_megatron.memory.stream_optimizer import StreamedStep


def _storages(tensors) -> list[torch.UntypedStorage]:
    """Unique storages behind `tensors` (views of one buffer count once, released or not)."""
    seen, out = set(), []
    for t in tensors:
        s = t.untyped_storage()
        key = s._cdata  # the storage itself: stable across resize_, unlike its data pointer
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def _host_view(host: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Tensor `t` (of a released storage) as a view of `host`, the flat uint8 host copy of that whole storage."""
    flat = host.view(t.dtype)
    return flat.as_strided(t.shape, t.stride(), flat.storage_offset() + t.storage_offset())


def _bytes(storage: torch.UntypedStorage, device) -> torch.Tensor:
    """A flat uint8 tensor over a whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


@dataclass
class OffloadClass:
    """Tensors offloaded as one unit into persistent host buffers."""

    name: str
    tensors: Callable[[], list[torch.Tensor]]  # re-read at every action (Adam's states appear lazily)
    read_only: bool = False
    resident: bool = True
    host: list = field(default_factory=list)  # one buffer per storage, in `tensors()` order
    sizes: list = field(default_factory=list)  # device bytes per storage while offloaded
    host_valid: bool = False  # host buffers hold the current values
    versions: tuple = ()  # the tensors' autograd version counters when the host copy was made
    event: object = None  # last copy's completion (CUDA)

    def nbytes(self) -> int:
        """Device bytes this class holds now."""
        return sum(s.nbytes() for s in _storages(self.tensors()))


class MemoryManager:
    """Runs a residency plan (`keep`, `phase`, or the set of classes `auto` releases) over the runtime's
    managed classes."""

    host_allocations = 0  # host buffers allocated by an offload (stays 0 after `reserve_host`)

    def __init__(self, plan, mode: str, ddp, optimizer, reference, copy_streams: int = 1, ahead: dict | None = None,
                 optimizer_step: str = "resident", bucket_mib: float = 512.0, buckets: int = 2):
        self.plan, self.mode, self.ddp = plan, mode, ddp
        self.released = released(plan)  # the classes this plan releases outside their phases (checked there)
        # memory.optimizer_step=stream: released optimizer classes stay on the host, the step streams them
        self.streamed = self.released & STREAMABLE if optimizer_step == "stream" else frozenset()
        self.streamed_step = StreamedStep(self, int(bucket_mib * 2**20), buckets) if self.streamed else None
        self.ahead = dict(ahead or {})  # class -> the phase before its own in which it comes back (prefetch_ahead)
        self.cuda = torch.cuda.is_available()
        self.device = torch.cuda.current_device() if self.cuda else "cpu"
        self.copy_streams = None  # {"d2h": stream, "h2d": stream}: one stream for both, or one each (CUDA)
        if self.cuda:
            d2h = torch.cuda.Stream()
            self.copy_streams = {"d2h": d2h, "h2d": d2h if copy_streams == 1 else torch.cuda.Stream()}
        self.optimizer = optimizer  # None until built (`set_optimizer`): its classes hold nothing before
        self.classes = {
            "main_weights": OffloadClass("main_weights", lambda: _main_weights(self.optimizer)),
            "optimizer_states": OffloadClass("optimizer_states", lambda: _optimizer_states(self.optimizer)),
        }
        if reference is not None:  # none without a reference (train.reference)
            self.add_reference(reference)
        self.grads_resident = True
        self.phase_bytes: dict[str, dict[str, int]] = {}  # managed bytes per class at each phase's entry
        self.copy_bytes = {"d2h": 0, "h2d": 0}
        self.host_reserve_s = 0.0  # seconds spent pinning host buffers at start-up (`reserve_host`)

    def set_optimizer(self, optimizer) -> None:
        """The optimizer whose master weights and Adam states this manager moves (built after the manager)."""
        self.optimizer = optimizer

    def add_reference(self, reference) -> None:
        """Manage the frozen reference model's parameters (built after the manager: `release_built`)."""
        self.classes["reference_weights"] = OffloadClass("reference_weights", lambda: list(reference.parameters()),
                                                         read_only=True)

    def release_built(self, names) -> None:
        """Start-up (trainer/runtime.py): release the classes of `names` this plan releases, right after they were
        built, so the next one is built without them (what the planner's `setup` point counts): `grads` freed (the
        first phase that reads them gets them zeroed), an offload class offloaded into the host buffers reserved
        for it here. Classes the plan keeps stay."""
        for name in names:
            if name not in self.released:
                continue
            if name == "grads":
                self._set_grads(False)
                continue
            c = self.classes[name]
            self.reserve_host((name,))
            if c.resident:
                self._offload(c)

    def reserve_host(self, names=None) -> float:
        """Allocate the host buffers of every released class (of `names`; all by default) not reserved yet, now
        (start-up) instead of at its first offload; returns the seconds it took. Pinning host memory runs at about
        1.8 GB/s on the H200 machine, so the first offload of Adam's states (which exist only after the first
        optimizer step) used to add about 16 s to step 2 at 3B (`benchmarks/results/pinned_alloc_probe.json`).
        Adam's state buffers are sized from the parameters they mirror (exp_avg and exp_avg_sq per parameter, in
        the optimizer's parameter order, the order Adam creates them in)."""
        t0 = time.perf_counter()
        for name, c in self.classes.items():
            if name not in self.released or (names is not None and name not in names) or c.host:
                continue
            sizes = [st.nbytes() for st in _storages(c.tensors())]
            if name == "optimizer_states" and not sizes:
                sizes = _adam_state_sizes(self.optimizer)
            c.host = [torch.empty(n, dtype=torch.uint8, pin_memory=self.cuda) for n in sizes]
        took = time.perf_counter() - t0
        self.host_reserve_s += took
        return took

    def new_step(self) -> None:
        """Start a step's records (bytes per phase, bytes copied)."""
        self.phase_bytes, self.copy_bytes = {}, {"d2h": 0, "h2d": 0}

    def resident_in(self, name: str, phase: str, then: str | None = None) -> bool:
        """Whether the plan wants class `name` on the device during `phase`: read there, or brought back ahead of
        the phase that reads it. `then`: the phase entered after this one when it is not the next in the plan's
        order (update and optimizer alternate over several mini-batches); a class comes back ahead only where
        `then` reads it, so rollplex's reference is not copied in at every optimizer step of a step, only the last.
        A streamed class (`memory.optimizer_step=stream`) is never brought back: the optimizer step streams it."""
        if name in self.streamed:
            return False
        if self.needed_in(name, phase):
            return True
        return self.ahead.get(name) == phase and (then is None or self.needed_in(name, then))

    def needed_in(self, name: str, phase: str) -> bool:
        """Whether `phase` reads class `name`: the compute stream waits for its copy at the phase's entry."""
        return name not in self.released or phase in resident_phases(name, self.mode)

    def enter(self, phase: str, then: str | None = None) -> None:
        """Release what `phase` does not need, then bring back what it does (in that order); `then`: see
        `resident_in`."""
        for name, c in self.classes.items():
            if c.resident and not self.resident_in(name, phase, then):
                self._offload(c)
        self._set_grads(self.resident_in("grads", phase, then))
        for name, c in self.classes.items():
            if not c.resident and self.resident_in(name, phase, then):
                self._prefetch(c)
        for name, c in self.classes.items():  # a class brought back ahead is waited for where it is read
            if c.resident and self.needed_in(name, phase):
                self._wait(c)
        self.phase_bytes[phase] = self.resident_bytes()

    @contextmanager
    def holding(self, names):
        """The classes of `names` on the device within the block (a resume's checkpoint load writes into them), and
        released again after it where the plan releases them, so a load holds one group of classes at a time."""
        for name in names:
            c = self.classes.get(name)
            if c is not None and not c.resident:
                self._prefetch(c)
                self._wait(c)
        try:
            yield
        finally:
            for name in names:
                c = self.classes.get(name)
                if c is not None and c.resident and name in self.released:
                    self._offload(c)

    def host_reader(self):
        """A function giving what a checkpoint writes for a tensor, without bringing released classes back (a save
        then needs no more device memory than the phase before it): for a tensor of an offloaded class, a view of
        that class's host buffer at the tensor's place (once its copy there has finished; no new host memory), for
        any other the tensor itself (torch.save copies a device tensor to the host one storage at a time, as
        before). A released class without a valid host copy (freed, not copied) is refused by name."""
        by_storage = {}
        for c in self.classes.values():
            if c.resident or not c.sizes:
                continue
            if not c.host_valid:
                raise RuntimeError(f"memory class {c.name} is released without a current host copy; its values "
                                   f"cannot be written")
            if self.cuda and c.event is not None:
                c.event.synchronize()
            by_storage.update((s._cdata, h) for s, h in zip(_storages(c.tensors()), c.host))

        def read(t: torch.Tensor) -> torch.Tensor:
            h = by_storage.get(t.untyped_storage()._cdata)
            return t if h is None else _host_view(h, t)
        return read

    def restore_all(self) -> None:
        """Every class back on the device."""
        for c in self.classes.values():
            if not c.resident:
                self._prefetch(c)
        self._set_grads(True)
        for c in self.classes.values():  # the host-to-device copies run on the copy stream
            self._wait(c)
        if self.cuda:
            torch.cuda.current_stream().synchronize()

    def _set_grads(self, resident: bool) -> None:
        """DDP's grad buffers freed, or back (zeroed, as after zero_grad_buffer), where they are not so already."""
        if resident != self.grads_resident:
            if resident:
                self.ddp.restore_grad_buffers(synchronize=False)
            else:
                self.ddp.offload_grad_buffers(synchronize=False, empty_cache=False)
            self.grads_resident = resident

    def _wait(self, c: OffloadClass) -> None:
        """The compute stream waits for class `c`'s last copy, if one ran and is not waited for yet (a class that
        held nothing when released copies nothing: no event)."""
        if self.cuda and c.event is not None:
            torch.cuda.current_stream().wait_event(c.event)
            c.event = None

    def resident_bytes(self) -> dict[str, int]:
        """Device bytes of every managed class now."""
        out = {name: c.nbytes() for name, c in self.classes.items()}
        buffers = self.ddp.buffers + self.ddp.expert_parallel_buffers
        out["grads"] = sum(b.grad_data.untyped_storage().nbytes() for b in buffers)
        return out

    @staticmethod
    def _adopt(tensors) -> None:
        """Move tensors whose storage cannot be resized (e.g. loaded by torch.load from a checkpoint)
        into fresh storage of their own; the tensor objects, and every reference to them, stay."""
        with torch.no_grad():
            for t in tensors:
                if not t.untyped_storage().resizable():
                    t.set_(t.clone())

    def _offload(self, c: OffloadClass) -> None:
        tensors = c.tensors()
        self._adopt(tensors)
        storages = _storages(tensors)
        if not storages:  # nothing exists yet (Adam's states before the first step): keep reserved buffers
            c.sizes, c.resident = [], False
            return
        versions = tuple(t._version for t in tensors)  # in-place writes (e.g. load_state_dict) bump these
        if not (c.read_only and c.host_valid and c.versions == versions and len(c.host) == len(storages)):
            c.host = self._host_for(c.host, [st.nbytes() for st in storages])
            self._copy(c, [_bytes(s, self.device) for s in storages], c.host, "d2h")
            c.host_valid, c.versions = True, versions
        c.sizes = [s.nbytes() for s in storages]
        for s in storages:
            if self.cuda:  # no reuse before this offload's copy ends, nor a prefetch ahead not yet waited for
                for stream in dict.fromkeys(self.copy_streams.values()):  # (a read-only class copies nothing out)
                    _bytes(s, self.device).record_stream(stream)
            s.resize_(0)
        c.resident = False

    def _host_for(self, host: list, sizes: list[int]) -> list:
        """Host buffers of `sizes` bytes: reserved ones of the right size are kept; only the others are allocated."""
        if [h.numel() for h in host] == list(sizes):
            return host
        spare = {}
        for h in host:
            spare.setdefault(h.numel(), []).append(h)
        new = []
        for n in sizes:
            if spare.get(n):
                new.append(spare[n].pop())
            else:
                new.append(torch.empty(n, dtype=torch.uint8, pin_memory=self.cuda))
                self.host_allocations += 1
        return new

    def host_views(self) -> dict:
        """The streamed classes' host buffers while offloaded, by device storage (`_storages`' key): what the
        streamed optimizer step reads and writes in place of the device tensors."""
        out = {}
        for name in self.streamed:
            c = self.classes[name]
            if not c.resident and c.sizes:
                out.update((s._cdata, h) for s, h in zip(_storages(c.tensors()), c.host))
        return out

    def adopt_offloaded(self, name: str) -> None:
        """Class `name`'s tensors were created offloaded (Adam's states on the streamed step's first step: each its
        own storage, released): give them host buffers, whose values the caller writes before any read."""
        c = self.classes[name]
        tensors = c.tensors()
        if len(_storages(tensors)) != len(tensors):
            raise ValueError(f"{name}: tensors created offloaded must each own their storage")
        c.sizes = [t.numel() * t.element_size() for t in tensors]
        c.host = self._host_for(c.host, c.sizes)
        c.resident, c.host_valid = False, True

    def _prefetch(self, c: OffloadClass) -> None:
        if not c.sizes:  # nothing was offloaded (see _offload): the reserved buffers stay unread, and
            c.resident = True  # tensors created meanwhile (Adam's first step) are left as they are
            return
        storages = _storages(c.tensors())
        for s, n in zip(storages, c.sizes):
            s.resize_(n)
        self._copy(c, c.host, [_bytes(s, self.device) for s in storages], "h2d")
        c.resident = True
        if not c.read_only:
            c.host_valid = False  # the device copy is the live one again

    def _copy(self, c: OffloadClass, src: list, dst: list, kind: str) -> None:
        if not self.cuda:
            for s, d in zip(src, dst):
                d.copy_(s)
        else:
            stream = self.copy_streams[kind]
            stream.wait_stream(torch.cuda.current_stream())
            if c.event is not None:  # this class's last copy (on the other stream): its result is read or overwritten
                stream.wait_event(c.event)
            with torch.cuda.stream(stream):
                for s, d in zip(src, dst):
                    d.copy_(s, non_blocking=True)
                c.event = torch.cuda.Event()
                c.event.record(stream)
        self.copy_bytes[kind] += sum(int(s.numel()) for s in src)


def _main_weights(optimizer) -> list[torch.Tensor]:
    if optimizer is None:
        return []
    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in getattr(opt, "fp32_from_float16_groups", []):
            out += list(group)
    return out


def _optimizer_states(optimizer) -> list[torch.Tensor]:
    if optimizer is None:
        return []
    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in opt.optimizer.state.values():
            out += [v for k, v in state.items() if torch.is_tensor(v) and k != "step" and v.numel() > 1]
    return out


def _adam_state_sizes(optimizer) -> list[int]:
    """Bytes of Adam's exp_avg and exp_avg_sq per parameter, in the order `_optimizer_states` will
    list them once the first step has created them."""
    if optimizer is None:
        return []
    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                if p.numel() > 1:  # `_optimizer_states` leaves out the states of one-element parameters
                    out += [p.numel() * p.element_size()] * 2
    return out
