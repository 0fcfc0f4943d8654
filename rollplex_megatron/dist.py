"""torch.distributed + megatron parallel state, and running a function in N local processes.

`run_local` is the one multi-process helper (tests and CLI commands use it when not under
torchrun): start N processes (forked by a forkserver that has the heavy imports loaded, on a CPU
machine; spawned on a GPU one), free port, gloo on CPU / NCCL on GPU, collect each rank's return
value, re-raise the first failure with its traceback. Workers exit when their launcher dies
(`exit_with_parent`), and a rank that fails does not leave the others waiting in a collective.
"""
from __future__ import annotations

import os
import signal
import socket
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rollplex_megatron.compat import apply_cpu_shims, quiet_known_warnings


def under_torchrun() -> bool:
    """True when launched by torchrun (or any launcher that sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_parallel(tp: int = 1, pp: int = 1, seed: int = 1234, backend: str = "auto", rollout_tp: int = 0,
                  rollout_ranks: int = 0) -> None:
    """Initialise torch.distributed from the environment and megatron's model-parallel groups (and
    the rollout layout's, `rollout_tp` ranks per replica, when it differs; with `rollout_ranks` the last
    that many ranks are the rollout's own: `ParallelLayouts`)."""
    apply_cpu_shims()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if (world - rollout_ranks) % (tp * pp) or world <= rollout_ranks:
        raise ValueError(
            f"world size {world} less parallel.rollout_ranks={rollout_ranks} is not a positive multiple of "
            f"parallel.tp*parallel.pp = {tp}*{pp}; launch tp*pp*dp (+ rollout_ranks) processes")
    check_tp_in_node(max(tp, rollout_tp), world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    if not dist.is_initialized():
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        dist.init_process_group(backend, timeout=timedelta(minutes=10))
    if not ps.model_parallel_is_initialized():
        global _LAYOUTS
        _LAYOUTS = ParallelLayouts(tp, pp, rollout_tp or tp, rollout_ranks)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


DP_FIRST_ORDER = "dp-tp-cp-ep-pp"  # megatron initialize_model_parallel(order=...): strided TP groups
DEFAULT_ORDER = "tp-cp-ep-dp-pp"


def parallel_orders(t: int, r: int, mapping: str = "aligned") -> tuple[str, str]:
    """Megatron `order` strings of the training side and the rollout side for a job of exactly max(t, r)
    ranks, where they give `aligned_coordinates`' groups (the side with the larger TP degree consecutive,
    the other strided): for tests and benchmarks that initialise megatron by order themselves."""
    if mapping == "consecutive" or t == r:
        return DEFAULT_ORDER, DEFAULT_ORDER
    return (DP_FIRST_ORDER, DEFAULT_ORDER) if r > t else (DEFAULT_ORDER, DP_FIRST_ORDER)


def _state_names(ps) -> list[str]:
    """megatron parallel_state's module globals (groups, ranks, sizes, buffers)."""
    return [k for k, v in vars(ps).items() if k.startswith("_") and k.lstrip("_")[:1].isupper()
            and k.replace("_", "").isupper() and not callable(v) and not isinstance(v, type(os))]


def aligned_coordinates(g: int, d: int, block: int) -> tuple[int, int]:
    """(TP rank, DP rank) of rank `g` at TP degree `d` in the aligned mapping over blocks of `block` =
    max(training TP, rollout TP) consecutive ranks: the side with the larger degree takes each block as
    its TP group (TP rank = place in the block); the other's TP groups are strided by block/d inside the
    block, so on every rank each rollout shard nests inside the training shard or contains it, at any
    world size (megatron's `order` strings stride over the whole world instead)."""
    b, p = divmod(g, block)
    if d == block:
        return p, b
    k = block // d
    return p // k, b * k + p % k


@contextmanager
def _megatron_world(offset: int, size: int, coords=None):
    """megatron's `initialize_model_parallel` over ranks [offset, offset + size) with, when `coords`
    (local rank -> (TP rank, DP rank), PP=CP=EP=1) is given, groups from those coordinates. megatron reads
    the world size from torch.distributed and numbers its groups from 0 (RankGenerator's rank_offset,
    fixed at 0 there). Every rank of the job calls it (group creation is collective); ranks outside the
    range get no groups."""
    from megatron.core import parallel_state as ps

    real_size, real_gen = dist.get_world_size, ps.RankGenerator

    class Generator(real_gen):
        def __init__(self, *args, **kwargs):
            kwargs["rank_offset"] = offset
            super().__init__(*args, **kwargs)

        def get_ranks(self, token):  # noqa: D102
            if coords is None:
                return super().get_ranks(token)
            axes, groups = set(token.split("-")), {}
            for g in range(self.world_size):
                tp, dp = coords(g)
                c = {"tp": tp, "dp": dp, "pp": 0, "cp": 0, "ep": 0}
                groups.setdefault(tuple(v for a, v in c.items() if a not in axes), []).append(g + offset)
            return [groups[k] for k in sorted(groups)]

    if size != real_size():
        dist.get_world_size = lambda group=None: size if group is None else real_size(group)
    ps.RankGenerator = Generator
    try:
        yield
    finally:
        dist.get_world_size, ps.RankGenerator = real_size, real_gen


class ParallelLayouts:
    """Megatron's parallel state at the training layout and at the rollout layout, swapped in around
    the work of each.

    The rollout layout (`rollout.tp` ranks per replica, no PP, replicas = world / rollout.tp) exists
    when it differs from the training TP. Megatron keeps its groups in module globals, and every
    megatron module keeps the groups it was built with, so: both layouts are built at start-up (group
    creation is collective: every rank builds both, in this order), a model is built inside the layout
    it runs at, and code that reads the globals at run time (the engine, vocab gathers, the schedules)
    runs inside `use(...)` of its layout."""

    def __init__(self, tp: int, pp: int, rollout_tp: int, rollout_ranks: int = 0):
        from megatron.core import parallel_state as ps

        self.tp, self.pp, self.rollout_tp, self.rollout_ranks = tp, pp, rollout_tp, rollout_ranks
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.train_size = world - rollout_ranks
        self.role = "rollout" if rollout_ranks and dist.get_rank() >= self.train_size else "train"
        self.train_world = None  # the training ranks' group (None: the default group, every rank)
        self.senders: list = []  # disaggregated: per training TP rank k, {rank k} + the rollout ranks
        if rollout_ranks:  # disaggregated: two disjoint sub-worlds, each megatron's whole world
            with _megatron_world(0, self.train_size):
                ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
            self._states = {"train": self._snapshot()}
            ps.destroy_model_parallel()
            with _megatron_world(self.train_size, rollout_ranks):
                ps.initialize_model_parallel(tensor_model_parallel_size=rollout_tp)
            self._states["rollout"] = self._snapshot()
            self.train_world = dist.new_group(list(range(self.train_size)))
            rollout = list(range(self.train_size, world))
            self.senders = [dist.new_group([k] + rollout) for k in range(tp)]  # DP rank 0's TP group is 0..tp-1
            self._restore(self._states[self.role])
            self.current = self.role
            return
        if rollout_tp == tp:
            ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
            self._states = dict.fromkeys(("train", "rollout"), self._snapshot())
            self.current = "train"
            return
        block = max(tp, rollout_tp)  # PP=1 here (the config checks it)
        with _megatron_world(0, world, lambda g: aligned_coordinates(g, tp, block)):
            ps.initialize_model_parallel(tensor_model_parallel_size=tp)
        self._states = {"train": self._snapshot()}
        ps.destroy_model_parallel()  # forgets the globals; the groups themselves stay alive
        with _megatron_world(0, world, lambda g: aligned_coordinates(g, rollout_tp, block)):
            ps.initialize_model_parallel(tensor_model_parallel_size=rollout_tp)
        self._states["rollout"] = self._snapshot()
        self._restore(self._states["train"])
        self.current = "train"

    @classmethod
    def adopt(cls) -> "ParallelLayouts":
        """The parallel state megatron holds now, as both layouts (initialised outside init_parallel)."""
        from megatron.core import parallel_state as ps

        self = cls.__new__(cls)
        self.tp = self.rollout_tp = ps.get_tensor_model_parallel_world_size()
        self.pp = ps.get_pipeline_model_parallel_world_size()
        self.rollout_ranks, self.role, self.train_world, self.senders = 0, "train", None, []
        self.train_size = dist.get_world_size() if dist.is_initialized() else 1
        self._states = dict.fromkeys(("train", "rollout"), self._snapshot())
        self.current = "train"
        return self

    @property
    def differ(self) -> bool:
        """The rollout runs at its own layout (rollout.tp != parallel.tp)."""
        return self.rollout_tp != self.tp

    @staticmethod
    def _snapshot() -> dict:
        from megatron.core import parallel_state as ps

        return {k: (dict(v) if isinstance(v, dict) else v) for k in _state_names(ps) for v in [getattr(ps, k)]}

    @staticmethod
    def _restore(state: dict) -> None:
        from megatron.core import parallel_state as ps

        for k, v in state.items():
            setattr(ps, k, v)

    @contextmanager
    def use(self, name: str):
        """Megatron's globals at layout `name` (train | rollout) inside the block."""
        prev = self.current
        if name != prev:
            self._restore(self._states[name])
            self.current = name
        try:
            yield
        finally:
            if name != prev:
                self._restore(self._states[prev])
                self.current = prev


_LAYOUTS: ParallelLayouts | None = None


def layouts() -> ParallelLayouts:
    """The layouts `init_parallel` built (training and rollout)."""
    global _LAYOUTS
    from megatron.core import parallel_state as ps

    if _LAYOUTS is None or not ps.model_parallel_is_initialized():
        if not ps.model_parallel_is_initialized():
            raise RuntimeError("init_parallel has not run in this process")
        _LAYOUTS = ParallelLayouts.adopt()  # megatron was initialised directly: one layout
    return _LAYOUTS


def train_world():
    """The training ranks' process group for collectives of the whole training job (None: the default
    group; under `mode=disaggregated` the rollout ranks are not in it)."""
    return _LAYOUTS.train_world if _LAYOUTS is not None else None


@contextmanager
def default_group_is_train_world():
    """Inside: torch.distributed's default-group world size and `all_gather_object` are the training
    ranks' (under mode=disaggregated). megatron-core 0.16.1 gathers the optimizer's parameter-group keys
    over the default group (core/optimizer/__init__.py, `_get_param_groups`), where the rollout ranks
    never answer."""
    g = train_world()
    if g is None:
        yield
        return
    size, gather = dist.get_world_size, dist.all_gather_object
    dist.get_world_size = lambda group=None: size(g if group is None else group)
    dist.all_gather_object = lambda out, obj, group=None: gather(out, obj, group=g if group is None else group)
    try:
        yield
    finally:
        dist.get_world_size, dist.all_gather_object = size, gather


def check_tp_in_node(tp: int, world: int, per_node: int) -> None:
    """Tensor-parallel groups (consecutive ranks; node-major ranks under scripts/torchrun.sh) must not
    span nodes: their collectives run every layer and need the node's own links."""
    if per_node < world and per_node % tp:
        raise ValueError(f"parallel.tp={tp} does not divide the {per_node} processes per node: a tensor-parallel "
                         f"group would span nodes; launch a multiple of {tp} processes per node")


def check_world_size(parallel) -> None:
    """Under torchrun, the launched process count must be the layout's (`ParallelConfig.world_size`, the
    rollout's own ranks included under mode=disaggregated): a run records what ran."""
    if not under_torchrun() or int(os.environ["WORLD_SIZE"]) == parallel.world_size:
        return
    p, n = parallel, parallel.world_size
    layout = f"parallel.tp*parallel.pp*parallel.dp = {p.tp}*{p.pp}*{p.dp}"
    if p.rollout_ranks:
        layout += f" plus parallel.rollout_ranks={p.rollout_ranks}"
    fix = "parallel.dp (or parallel.rollout_ranks)" if p.rollout_ranks else "parallel.dp"
    have, need = int(os.environ["WORLD_SIZE"]), f"{n} process" + ("es" if n != 1 else "")
    raise ValueError(f"launched {have} process{'es' if have != 1 else ''} but {layout} = {n}; launch {need} or "
                     f"set {fix} so that the layout equals the process count")


def check_launch(parallel) -> None:
    """Before any process starts: the launched process count (`check_world_size`), and a backend this machine has
    (parallel.backend=nccl needs CUDA devices)."""
    check_world_size(parallel)
    if parallel.backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("parallel.backend=nccl needs CUDA devices, and this machine has none; use parallel.backend="
                         "auto (gloo on CPU) or gloo")


def exit_with_parent(poll_s: float = 0.2) -> None:
    """Exit this process (code 1) as soon as its parent dies, e.g. after `kill -9` of the launcher:
    a worker that outlived its launcher would go on writing into a run directory nobody holds."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def destroy_parallel() -> None:
    """Tear down megatron's groups and the process group."""
    from megatron.core import parallel_state as ps

    global _LAYOUTS
    ps.destroy_model_parallel()
    _LAYOUTS = None
    if dist.is_initialized():
        dist.destroy_process_group()


def leave_torchrun() -> None:
    """A torchrun rank's last step once its command succeeded: a barrier over every rank, then the
    process group destroyed (as `run_local`'s workers do). A rank that left its process group to the
    interpreter's exit could abort (SIGABRT, gloo's `Connection closed by peer` on a transport thread,
    once in a two-node loopback launch) when a peer exited first; after the barrier no rank has a
    collective left, and each closes its connections before its process exits. Only on success:
    torchrun stops every rank when one fails."""
    if under_torchrun() and dist.is_initialized():
        dist.barrier()
        destroy_parallel()


def free_port() -> int:
    """A TCP port free on the loopback interface right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What a forkserver imports once, before it forks the workers of every later `run_local` call: a worker
# then starts with torch, megatron-core, transformers and the trainer loaded instead of importing them
# (about 10 s of one core per process on a CPU machine).
PRELOAD = ("rollplex_megatron.trainer.loop", "rollplex_megatron.rollout.engine")


def _context(fn, defer_sigterm: bool):
    """The workers' start method: on a CPU machine a forkserver with `PRELOAD` (and `fn`'s module, at its
    first start) loaded; `spawn` on a GPU machine (a process forked after anything touched the CUDA driver
    cannot use CUDA, and a GPU run's start-up is not its cost), when the workers must start with SIGTERM
    ignored (a forkserver's children do not inherit the launcher's signal dispositions), or when
    ROLLPLEX_START_METHOD=spawn asks for it."""
    method = os.environ.get("ROLLPLEX_START_METHOD", "auto")
    if method not in ("auto", "spawn", "forkserver"):
        raise ValueError(f"ROLLPLEX_START_METHOD={method!r}: choose auto, spawn or forkserver")
    if method == "spawn" or defer_sigterm or (method == "auto" and torch.cuda.is_available()):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, fn.__module__])  # read only when the forkserver starts
    return ctx


def _worker(rank: int, world: int, port: int, fn, args, out_dir: str, env: dict) -> None:
    os.environ.clear()  # the launcher's environment now, as under spawn (a forkserver's is its start's)
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    exit_with_parent()
    # ROLLPLEX_NUM_THREADS pins the intra-op threads of every rank (the test suite runs once with 1
    # and once with 2 to find assertions that depend on the CPU's reduction order).
    torch.set_num_threads(int(os.environ.get("ROLLPLEX_NUM_THREADS", 0)) or max(1, (os.cpu_count() or 1) // world))
    quiet_known_warnings()
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        result = {"ok": True, "value": fn(*args)}
    except BaseException:  # noqa: BLE001 - the parent re-raises with this traceback
        # `at`: the launcher reports the rank that failed first (the others' errors are often its consequence,
        # a collective with a dead peer), not the lowest-numbered one
        result = {"ok": False, "error": traceback.format_exc(), "at": time.time()}
    torch.save(result, path)
    if dist.is_initialized():
        dist.destroy_process_group()
    if not result["ok"]:
        raise SystemExit(1)


class LocalRunError(RuntimeError):
    """A rank of `run_local` failed; the message holds its traceback, `summary` its last line."""

    def __init__(self, message: str, summary: str):
        super().__init__(message)
        self.summary = summary


def _stop(procs) -> None:
    """Terminate the processes still alive; a trainer rank treats SIGTERM as "stop after this step", so one
    that does not exit within seconds is killed."""
    live = [p for p in procs if p.is_alive()]
    for p in live:
        p.terminate()
    for p in live:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()


def _join(procs, grace_s: float) -> None:
    """Wait for every process; once one has failed, the rest get `grace_s` to finish (they may be
    blocked in a collective with the dead rank), then are terminated."""
    live, deadline = list(procs), None
    while live:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        done = wait([p.sentinel for p in live], timeout)
        if not done:  # grace period over
            _stop(live)
            return
        for p in [p for p in live if p.sentinel in done]:
            p.join()
            live.remove(p)
            if p.exitcode != 0 and deadline is None:
                deadline = time.monotonic() + grace_s


def run_local(fn, world_size: int, *args, on_start=None, grace_s: float = 30.0, defer_sigterm: bool = False) -> list:
    """Run `fn(*args)` in `world_size` fresh processes; return the per-rank results (rank order).

    `fn` must be importable (module level). Each process sees RANK/WORLD_SIZE/MASTER_* like
    under torchrun, so `fn` calls `init_parallel(...)` itself. `on_start(pids)` is called once the
    processes run (the launcher records them in the run directory's lock and forwards signals).
    `defer_sigterm`: the workers start with SIGTERM and SIGINT ignored (the disposition survives the
    spawn; a signal mask would not), so a SIGTERM, or a terminal's Ctrl-C (which reaches every process
    of the foreground group), that arrives while they import does not kill them; the launcher re-sends
    SIGTERM until their handler (`trainer.loop.Preemption`) has taken it. A launcher interrupted while
    it waits (KeyboardInterrupt) stops the workers before it removes the folder they write their
    results into.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = _context(fn, defer_sigterm)
        port = free_port()
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, out_dir, dict(os.environ)))
                 for r in range(world_size)]
        deferred = (signal.SIGTERM, signal.SIGINT) if defer_sigterm else ()
        old = {s: signal.signal(s, signal.SIG_IGN) for s in deferred}
        try:
            for p in procs:
                p.start()
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
        try:
            if on_start is not None:
                on_start([p.pid for p in procs])
            _join(procs, grace_s)
        except BaseException:
            _stop(procs)  # before the temporary folder goes: a worker writing its result there would fail loudly
            raise
        found = {}
        for r in range(world_size):
            path = os.path.join(out_dir, f"rank{r}.pt")
            # The full unpickler, on purpose: these are the results this launch's own workers wrote into the
            # private folder (mode 0700) it created above; nothing another user or a run directory provides.
            found[r] = torch.load(path, weights_only=False) if os.path.exists(path) else None
        failed = [r for r, res in found.items() if res is not None and not res["ok"]]
        if failed:  # a rank's own error first: the others may only have been stopped after it
            r = min(failed, key=lambda r: found[r].get("at", 0.0))
            last = found[r]["error"].strip().splitlines()[-1]
            raise LocalRunError(f"rank {r} failed:\n{found[r]['error']}", f"rank {r}: {last}")
        for r, res in found.items():
            if res is None:
                msg = f"rank {r} died without a result (exit code {procs[r].exitcode})"
                raise LocalRunError(msg, msg)
        results = [found[r]["value"] for r in range(world_size)]
        return results


def launch_on_ranks(fn, world_size: int, *args, on_start=None, defer_sigterm: bool = False) -> list:
    """The one way every command runs on its ranks: results of `fn(*args)`, this rank's alone (a
    one-item list) under torchrun, else every local rank's in rank order (`run_local`)."""
    if under_torchrun():
        return [fn(*args)]
    return run_local(fn, world_size, *args, on_start=on_start, defer_sigterm=defer_sigterm)
