"""CUDA's stream ordering, simulated on CPU around the real `MemoryManager`, so that its copy-stream logic
(`memory.copy_streams`, `memory.prefetch_ahead`, `restore_all`) can fail a CPU test.

Every stream keeps a vector clock: an operation on a stream is an (stream, count) pair, and it happened before a
point of another stream when that stream's clock has reached it (through `wait_stream`, `wait_event` or a host
synchronisation). The manager runs its CUDA branch on these fakes (`patched`): its device storages, pinned host
buffers, copies and `record_stream` calls are proxies that record each operation, and a `Hazard` is noted where
real hardware could race:
- a copy reads a host buffer or a device storage before the copy or the kernel that wrote it has finished, or
  writes one that an earlier copy may still read;
- a storage is freed (`resize_(0)`) while an operation on a stream the allocator does not know of (no
  `record_stream`, not the compute stream) may still touch it: the caching allocator may hand the block out;
- the compute stream reads a class that is offloaded, or before its host-to-device copy has finished.
What the trainer's phases read (`READS`) is written here apart from the planner's tables, so a manager that waits
at the wrong phase is caught too.
"""
from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import torch

from rollplex_megatron.memory import manager as M

READS = {  # phase -> the managed classes its compute reads (w: writes too), as the trainer's code does
    "serial": {"ref_logp": ["reference_weights"]},
    "prefix_shared": {"ref_logp": ["reference_weights"]},
    "rollplex": {"rollout": ["reference_weights"], "ref_logp": ["reference_weights"]},
}
OPTIMIZER_READS = ["main_weights:w", "optimizer_states:w"]


class Stream:
    """A stream with a vector clock ({stream: operations of it that happened before this stream's next one})."""

    def __init__(self, sim: "Sim", name: str):
        self.sim, self.name, self.clock = sim, name, {}

    def __repr__(self) -> str:
        return self.name

    def op(self) -> tuple:
        """A new operation on this stream."""
        self.clock[self] = self.clock.get(self, 0) + 1
        return self, self.clock[self]

    def merge(self, clock: dict) -> None:
        for s, n in clock.items():
            self.clock[s] = max(self.clock.get(s, 0), n)

    def wait_stream(self, other: "Stream") -> None:  # noqa: D102
        self.merge(other.clock)

    def wait_event(self, event: "Event") -> None:  # noqa: D102
        self.merge(event.clock or {})

    def synchronize(self) -> None:
        """The host waits for this stream: whatever any stream issues later comes after its work."""
        for s in self.sim.streams:
            s.merge(self.clock)


class Event:
    """A recorded point of a stream."""

    def __init__(self, sim: "Sim"):
        self.sim, self.clock = sim, None

    def record(self, stream: Stream | None = None) -> None:  # noqa: D102
        self.clock = dict((stream or self.sim.current()).clock)


def before(op: tuple | None, clock: dict) -> bool:
    """Whether operation `op` happened before the point `clock`."""
    return op is None or clock.get(op[0], 0) >= op[1]


class Block:
    """One allocation behind a device storage: the operations that touched it and the streams recorded on it."""

    def __init__(self, sim: "Sim"):
        self.ops, self.recorded = [], set()
        self.last_write = sim.compute.op()  # allocated (and, for a prefetch, about to be written) on compute
        self.ops.append(self.last_write)


class DeviceStorage:
    """A device storage of a managed tensor: resizing frees or allocates its block."""

    def __init__(self, sim: "Sim", real: torch.UntypedStorage, tag: str):
        self.sim, self.real, self.tag, self.block = sim, real, tag, Block(sim)
        self._cdata = real._cdata

    def nbytes(self) -> int:  # noqa: D102
        return self.real.nbytes()

    def resize_(self, n: int) -> None:  # noqa: D102
        sim = self.sim
        if n == 0:
            if sim.current() is not sim.compute:
                sim.hazard(f"{self.tag} freed on a side stream")
            for op in self.block.ops:
                if not (before(op, sim.compute.clock) or any(before(op, s.clock) for s in self.block.recorded)):
                    sim.hazard(f"{self.tag} freed while an operation on {op[0]} may still touch it")
            self.block = None
        else:
            self.block = Block(sim)
        self.real.resize_(n)


class DeviceBytes:
    """`_bytes(storage)`: the flat view the manager copies from and into."""

    def __init__(self, storage: DeviceStorage):
        self.st = storage

    def numel(self) -> int:  # noqa: D102
        return self.st.nbytes()

    def record_stream(self, stream: Stream) -> None:  # noqa: D102
        self.st.sim.recorded(self.st, stream)

    def flat(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8).set_(self.st.real)

    def copy_(self, src: "HostBuffer", non_blocking: bool = False) -> None:
        """Host-to-device copy on the current stream."""
        sim, block = self.st.sim, self.st.block
        stream = sim.current()
        if src.last_write is None:
            sim.hazard(f"{self.st.tag} copied in from a host buffer never written")
        elif not before(src.last_write, stream.clock):
            sim.hazard(f"{self.st.tag} copied in before the copy out to its host buffer finished")
        if any(not before(op, stream.clock) for op in block.ops):
            sim.hazard(f"{self.st.tag} written by a copy in before its block's earlier users finished")
        op = stream.op()
        src.reads.append(op)
        block.ops.append(op)
        block.last_write = op
        self.flat().copy_(src.real)


class HostBuffer:
    """A pinned host buffer."""

    def __init__(self, n: int):
        self.real, self.last_write, self.reads = torch.zeros(n, dtype=torch.uint8), None, []

    def numel(self) -> int:  # noqa: D102
        return self.real.numel()

    def copy_(self, src: DeviceBytes, non_blocking: bool = False) -> None:
        """Device-to-host copy on the current stream."""
        sim, block = src.st.sim, src.st.block
        stream = sim.current()
        if block is None:
            sim.hazard(f"{src.st.tag} copied out of a freed block")
        elif not before(block.last_write, stream.clock):
            sim.hazard(f"{src.st.tag} copied out before its last write finished")
        if not before(self.last_write, stream.clock) or any(not before(r, stream.clock) for r in self.reads):
            sim.hazard(f"{src.st.tag}'s host buffer overwritten while an earlier copy may still use it")
        op = stream.op()
        self.last_write, self.reads = op, []
        if block is not None:
            block.ops.append(op)
        self.real.copy_(src.flat())


class Sim:
    """The fakes' shared state: streams, storage proxies, hazards."""

    def __init__(self, drop: frozenset = frozenset()):
        self.drop = drop  # manager calls whose effect is dropped (the mutation checks)
        self.compute = Stream(self, "compute")
        self.streams, self.stack, self.storages, self.hazards = [self.compute], [self.compute], {}, []

    def hazard(self, what: str) -> None:  # noqa: D102
        self.hazards.append(what)

    def current(self) -> Stream:  # noqa: D102
        return self.stack[-1]

    def recorded(self, storage: DeviceStorage, stream: Stream) -> None:
        if "record_stream" not in self.drop:
            storage.block.recorded.add(stream)

    def new_stream(self, *args, **kwargs) -> Stream:
        s = Stream(self, f"copy{len(self.streams)}")
        if "copy_wait_stream" in self.drop:
            s.wait_stream = lambda other: None
        if "copy_wait_event" in self.drop:
            s.wait_event = lambda event: None
        self.streams.append(s)
        return s

    @contextmanager
    def on(self, stream: Stream):
        self.stack.append(stream)
        try:
            yield
        finally:
            self.stack.pop()

    def host_sync(self) -> None:
        """`torch.cuda.synchronize()`: every stream's later work comes after all work issued so far."""
        clock: dict = {}
        for s in self.streams:
            for k, n in s.clock.items():
                clock[k] = max(clock.get(k, 0), n)
        for s in self.streams:
            s.merge(clock)

    def register(self, tensors, tag: str) -> None:
        for t in tensors:
            real = t.untyped_storage()
            self.storages.setdefault(real._cdata, DeviceStorage(self, real, tag))

    def proxies(self, tensors) -> list[DeviceStorage]:
        """`manager._storages`: the unique storages behind `tensors`, as proxies."""
        out, seen = [], set()
        for t in tensors:
            key = t.untyped_storage()._cdata
            if key not in seen:
                seen.add(key)
                out.append(self.storages[key])
        return out

    def touch(self, mm, name: str, write: bool) -> None:
        """The compute stream reads (and maybe writes) class `name`."""
        for st in self.proxies(mm.classes[name].tensors()):
            if st.block is None or st.nbytes() == 0:
                self.hazard(f"compute reads {name} while it is offloaded")
                continue
            if not before(st.block.last_write, self.compute.clock):
                self.hazard(f"compute reads {name} before its copy in finished")
            op = self.compute.op()
            st.block.ops.append(op)
            if write:
                st.block.last_write = op


class _Torch:
    """The manager module's `torch`: torch itself, with the simulation's CUDA and pinned host buffers."""

    def __init__(self, sim: Sim):
        self.cuda = SimpleNamespace(is_available=lambda: True, current_device=lambda: "cpu", Stream=sim.new_stream,
                                    current_stream=sim.current, stream=sim.on, Event=lambda: Event(sim))

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, pin_memory=None, **kwargs):  # noqa: D102
        return HostBuffer(args[0]) if pin_memory is not None else torch.empty(*args, **kwargs)


def patched(monkeypatch, sim: Sim) -> None:
    """Point the manager module's CUDA calls at the simulation (pytest's monkeypatch undoes it)."""
    if "compute_wait_event" in sim.drop:
        sim.compute.wait_event = lambda event: None
    monkeypatch.setattr(M, "torch", _Torch(sim))
    monkeypatch.setattr(M, "_storages", sim.proxies)
    monkeypatch.setattr(M, "_bytes", lambda storage, device: DeviceBytes(storage))


def trainer_steps(sim: Sim, mode: str, ahead: dict | None, copy_streams: int, minis: int, lazy_states: bool,
                  host_sync: bool, checkpoint: bool, extras: bool = False, steps: int = 3) -> list[str]:
    """A manager over small synthetic classes driven through `steps` of the trainer's phase sequence (the loop's
    order, the optimizer step's `then` included), the compute stream reading what each phase reads; the hazards.
    `extras`: each step also has a weights phase (under the optimizer's residency) and a validation rollout."""
    main = [torch.randn(100 + i) for i in range(3)]
    ref = [torch.randn(50 + i) for i in range(3)]
    state: dict = {}
    optimizer = SimpleNamespace(fp32_from_float16_groups=[main],
                                optimizer=SimpleNamespace(state=state, param_groups=[{"params": main}]))
    sim.register(main, "main_weights")
    sim.register(ref, "reference_weights")

    def adam_states():  # created by the first optimizer step, as torch's Adam does
        for p in main:
            if p not in state:
                state[p] = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p), "step": torch.zeros(())}
                sim.register([state[p]["exp_avg"], state[p]["exp_avg_sq"]], "optimizer_states")
    if not lazy_states:
        adam_states()
    ddp = SimpleNamespace(buffers=[], expert_parallel_buffers=[], offload_grad_buffers=lambda **kw: None,
                          restore_grad_buffers=lambda **kw: None)
    mm = M.MemoryManager("phase", mode, ddp, optimizer, SimpleNamespace(parameters=lambda: ref), copy_streams, ahead)
    mm.reserve_host()

    def phase(name: str, then: str | None = None) -> None:
        if host_sync:  # the phase timer's device synchronisation
            sim.host_sync()
        mm.enter(name, then)
        for cls in READS[mode].get(name, []):
            sim.touch(mm, cls, write=False)
        if name == "optimizer":
            adam_states()
            for entry in OPTIMIZER_READS:
                sim.touch(mm, entry.split(":")[0], write=True)
    for _ in range(steps):
        phase("rollout")
        phase("reward")
        # rollplex scores later mini-batches' old log-probs after its reference stage (train.ppo_mini_batches > 1)
        for name in ("ref_logp", "old_logp")[:1 + (minis > 1)] if mode == "rollplex" else ("old_logp", "ref_logp"):
            phase(name)
        for k in range(minis):
            phase("update")
            phase("optimizer", None if k == minis - 1 else "update")
        if extras:
            mm.enter("optimizer")  # the weights phase, right after the optimizer step: no transition
            phase("rollout")  # validation decodes under the rollout's residency
        if checkpoint:
            mm.restore_all()
            for name in mm.classes:
                sim.touch(mm, name, write=False)
    return sorted(set(sim.hazards))
