"""SGLang plugin: the two scheduler hooks that drive the bridge (entry point `sglang.srt.plugins: rollplex`).

SGLang (0.5.12 and later) loads every `sglang.srt.plugins` entry point in each process, the
scheduler's included (`run_scheduler_process` calls `load_plugins()`), and `register` adds:
- AROUND `Scheduler.run_batch`: after the batch's forward is enqueued, for a decode batch, the
  bridge's `on_decode_step(batch size)` (the decode-window items of this step);
- AROUND `Scheduler.on_idle`: the bridge drains its admitted jobs when no batch runs;
- AFTER `ModelRunner.load_model`: SGLang's parameters become the trainer's shards (`weights.py`), before
  SGLang sizes its KV cache and captures CUDA graphs.
Releases without the plugin framework call `install_direct()` from a patch (`patches/sglang/`),
which wraps the same methods (there the idle method is `self_check_during_idle`).

The hooks do nothing unless the trainer asked for the bridge (`ROLLPLEX_SGLANG_BRIDGE` in the
scheduler's environment), so installing the package changes no other SGLang user's server.
"""
from __future__ import annotations

import functools
import logging
import os

from rollplex_megatron.rollout.sglang import protocol as P

log = logging.getLogger(__name__)

SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
LOAD_MODEL = "sglang.srt.model_executor.model_runner.ModelRunner.load_model"
RUN_BATCH = f"{SCHEDULER}.run_batch"
ON_IDLE = f"{SCHEDULER}.on_idle"  # 0.5.12 and later
OLD_IDLE = "self_check_during_idle"  # the idle method of releases without the plugin framework
_BRIDGE = None  # this process's bridge (one scheduler per process)
_NO_BRIDGE = object()  # a rendezvous without this scheduler's trainer (decided once)


def tp_coordinates(obj) -> tuple[int, int]:
    """(TP rank, TP size) of this SGLang process: the object's `tp_rank` / `tp_size` (0.5.12's Scheduler and
    ModelRunner), its `ps` ParallelState (0.5.17's), else SGLang's runtime context (`get_parallel()`, 0.5.23)."""
    for holder in (obj, getattr(obj, "ps", None)):
        if hasattr(holder, "tp_rank") and hasattr(holder, "tp_size"):
            return int(holder.tp_rank), int(holder.tp_size)
    from sglang.srt.runtime_context import get_parallel

    par = get_parallel()
    return int(par.tp_rank), int(par.tp_size)


def bridge_of(obj):
    """This process's bridge, opened at the first hook call (None without ROLLPLEX_SGLANG_BRIDGE, or under a
    rendezvous that names no trainer for this scheduler)."""
    global _BRIDGE
    if not os.environ.get(P.ENV_ADDRESS):
        return None
    if _BRIDGE is None:
        _BRIDGE = open_bridge(*tp_coordinates(obj), model_path=_model_path(obj)) or _NO_BRIDGE
    return None if _BRIDGE is _NO_BRIDGE else _BRIDGE


def _model_path(obj) -> str | None:
    """The checkpoint this SGLang server serves (its ServerArgs), if the object says."""
    return getattr(getattr(obj, "server_args", None), "model_path", None)


def open_bridge(tp_rank: int, tp_size: int, model_path: str | None = None):
    """Connect this scheduler process to its trainer (one connection per SGLang TP rank); None when a rendezvous
    names no trainer for this scheduler (on every rank of its TP group, which decide together)."""
    import torch
    import torch.distributed as dist

    from rollplex_megatron.rollout.sglang.bridge import SchedulerBridge

    group = None
    if tp_size > 1:
        if not dist.is_initialized() or dist.get_world_size() != tp_size:
            raise P.BridgeError(f"the rollplex bridge needs SGLang's world to be its TP group (tp_size={tp_size}); "
                                f"run SGLang without data or pipeline parallelism under the bridge")
        group = dist.new_group(backend="gloo")  # the bridge's own: ranks agree on the jobs they hold
    link = P.connect(tp_rank, model_path=model_path)
    if group is not None and P.rendezvous_dir() is not None:
        every = torch.tensor([int(link is not None)])
        dist.all_reduce(every, op=dist.ReduceOp.MIN, group=group)
        if not int(every) and link is not None:  # a TP group joins whole or not at all
            link.close()
            link = None
    if link is None:
        log.info("rollplex: no trainer published for this SGLang scheduler under %s (tp rank %d); the bridge stays "
                 "off here", os.environ.get(P.ENV_ADDRESS), tp_rank)
        return None
    return SchedulerBridge(link, tp_rank, tp_size, version=_version(), cpu_group=group)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:
        return "unknown"


def around_run_batch(original, scheduler, batch, *args, **kwargs):
    """Run the batch; after a decode forward is enqueued, the bridge's window items for this step. The batch
    is read before the forward: SGLang rewrites some of its fields while launching it (input_ids, output_ids)."""
    bridge = bridge_of(scheduler)
    decode = bridge is not None and batch is not None and batch.forward_mode.is_decode()
    size = batch.batch_size() if decode else 0
    result = original(scheduler, batch, *args, **kwargs)
    if decode:
        bridge.on_decode_step(size)
    return result


def around_on_idle(original, scheduler, *args, **kwargs):
    """No batch runs: the bridge drains its jobs, then SGLang's own idle work."""
    bridge = bridge_of(scheduler)
    if bridge is not None:
        bridge.on_idle()
    return original(scheduler, *args, **kwargs)


def after_load_model(result, runner, *args, **kwargs):
    """SGLang has built its model (dummy weights): bind its parameters to the trainer's shards now, before
    the KV cache is sized and the CUDA graphs are captured (they record parameter addresses). Not under a
    rendezvous (`dir:`): SGLang keeps the weights the framework that started it loads and syncs."""
    if not P.binds_weights():
        return result
    bridge = bridge_of(runner)
    if bridge is not None:
        bridge.bind_weights(runner.model, bridge.link.timeout)
    return result


HOOKS = ((RUN_BATCH, around_run_batch), (ON_IDLE, around_on_idle))


def register() -> None:
    """The entry point SGLang's `load_plugins()` runs: AROUND hooks on the scheduler's two methods."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook in HOOKS:
        HookRegistry.register(target, hook, HookType.AROUND)
    HookRegistry.register(LOAD_MODEL, after_load_model, HookType.AFTER)


def _after(hook):
    """An AROUND form of an AFTER hook (SGLang's HookType.AFTER semantics: a None result keeps the original's)."""
    def around(original, *args, **kwargs):
        result = original(*args, **kwargs)
        new = hook(result, *args, **kwargs)
        return result if new is None else new
    return around


def install_direct(scheduler_cls=None, runner_cls=None) -> None:
    """For releases without `sglang.srt.plugins` (called by the patch in `run_scheduler_process`): wrap
    `run_batch`, the idle method (`on_idle`, else `self_check_during_idle`) and `ModelRunner.load_model`
    in place. Idempotent."""
    if scheduler_cls is None:
        from sglang.srt.managers.scheduler import Scheduler as scheduler_cls
    if runner_cls is None:
        try:
            from sglang.srt.model_executor.model_runner import ModelRunner as runner_cls
        except ImportError:  # a stand-in scheduler without SGLang
            runner_cls = None
    idle = "on_idle" if hasattr(scheduler_cls, "on_idle") else OLD_IDLE
    targets = [(scheduler_cls, "run_batch", around_run_batch), (scheduler_cls, idle, around_on_idle)]
    if runner_cls is not None:
        targets.append((runner_cls, "load_model", _after(after_load_model)))
    for cls, name, hook in targets:
        original = getattr(cls, name)
        if getattr(original, "_rollplex_hook", False):
            continue

        def wrapper(*args, _original=original, _hook=hook, **kwargs):
            return _hook(_original, *args, **kwargs)

        wrapper = functools.wraps(original)(wrapper)
        wrapper._rollplex_hook = True
        setattr(cls, name, wrapper)
    log.info("rollplex: SGLang hooks installed directly on %s", scheduler_cls.__name__)
