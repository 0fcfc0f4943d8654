"""Workers for tests/test_streamed_optimizer.py (importable for spawn): the same three optimizer steps run by
megatron's resident step and by the streamed step (memory.optimizer_step=stream) on two copies of one model,
with the same fresh gradients, and every parameter, master weight and Adam state compared bit for bit."""
from __future__ import annotations

import copy
import time

import torch

from rollplex_megatron.dist import init_parallel
from rollplex_megatron.memory.manager import MemoryManager
from rollplex_megatron.models.qwen25vl import build_model
from rollplex_megatron.optim import build_optimizer, optimizer_step
from rollplex_megatron.recipes import load_run_config
from rollplex_megatron.runtime import wrap_ddp

STEPS = 3
CLIP = 1.0  # under the gradients' norm (their magnitudes reach 1e2): clipping scales every step


def run_cases(tp: int, cases: dict, backend: str = "gloo") -> dict:
    """`{name: case}` in this process (one parallel state): each case's comparison."""
    init_parallel(tp, 1, 1234, backend)
    out = {}
    for name, c in cases.items():
        out[name] = compare(tp, **c)
    return out


def compare(tp: int, dtype: str, released, bucket_mib: float, mutant: str = "", model: tuple = ("model=tiny",),
            load: bool = True, copy_streams: int = 1) -> dict:
    """STEPS resident and streamed steps, then (`load`) a checkpoint's state dict loaded into both and one step
    more; each step's seconds (optimizer entry and step) and, on CUDA, the allocator's peak in it."""
    cfg = load_run_config([*model, f"dtype={dtype}", f"parallel.tp={tp}", f"optim.clip_grad={CLIP}",
                           "optim.weight_decay=0.1", "optim.lr=0.01"])
    runs = [_run(cfg, released, step, bucket_mib, copy_streams) for step in ("resident", "stream")]
    runs[1][0].load_state_dict(runs[0][0].state_dict())  # the same initial weights
    runs[1][3].reload_model_params()  # megatron's masters were cloned from the weights before the load
    if mutant:
        _mutate(runs[1][4].streamed_step, mutant)
    dev = runs[0][2].module.parameters().__next__().device
    gen = torch.Generator(device=dev).manual_seed(100 + torch.distributed.get_rank())
    out = {"grad_norms": [], "streamed_zero": [], "stats": [], "seconds": [], "peak_bytes": [], "exit_seconds": []}
    for _ in range(STEPS):
        _steps(runs, gen, out)
    out["equal"] = _equal(runs)
    if not load:
        return out
    state = copy.deepcopy(runs[0][3].state_dict())  # the resident run's checkpoint, loaded into both
    for _, _, _, opt, mm in runs:
        opt.load_state_dict(copy.deepcopy(state))
    _steps(runs, gen, out)
    out["equal_after_load"] = _equal(runs)
    return out


def _run(cfg, released, step: str, bucket_mib: float, copy_streams: int):
    model = build_model(cfg.model, cfg.dtype)
    ddp = wrap_ddp(model)
    opt = build_optimizer(ddp, cfg.optim, cfg.dtype == "bfloat16")
    mm = MemoryManager(released, "rollplex", ddp, opt, None, copy_streams, optimizer_step=step, bucket_mib=bucket_mib)
    mm.reserve_host()
    return model, cfg, ddp, opt, mm


def _steps(runs, gen: torch.Generator, out: dict) -> None:
    """One optimizer step of each run on the same fresh gradients (magnitudes 1e-6 to 1e2 within every tensor)."""
    grads = None
    norms = []
    for model, _, ddp, opt, mm in runs:
        mm.enter("update")
        params = list(ddp.module.parameters())
        if grads is None:
            grads = [torch.randn(p.shape, generator=gen, device=gen.device)
                     * 10 ** torch.empty(p.shape, device=gen.device).uniform_(-6, 2, generator=gen) for p in params]
        for p, g in zip(params, grads):
            p.main_grad.copy_(g)
        t0 = _start()
        mm.enter("optimizer")
        streamed = [t for n in mm.streamed for t in mm.classes[n].tensors()]
        norms.append(optimizer_step(opt, mm.streamed_step)["grad_norm"])
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
        out["seconds"].append(time.perf_counter() - t0)
        out["peak_bytes"].append(torch.cuda.max_memory_allocated() if cuda else 0)
        out["streamed_zero"].append(all(t.untyped_storage().nbytes() == 0 for t in streamed))
        ddp.zero_grad_buffer()
        opt.zero_grad()
        t0 = _start()
        mm.enter("rollout")  # its released classes leave before the other run's step (whose peak is measured)
        if cuda:
            torch.cuda.synchronize()
        out["exit_seconds"].append(time.perf_counter() - t0)
    out["grad_norms"].append(norms)
    out["stats"].append(dict(runs[1][4].streamed_step.stats))


def _start() -> float:
    """Seconds, after the device's queued work, with the allocator's peak reset there (CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    return time.perf_counter()


def _equal(runs) -> dict:
    """Bit-for-bit equality of the weights and of the optimizers' state dicts (masters, Adam states and steps)."""
    for *_, mm in runs:
        mm.restore_all()  # offloaded classes back before the state is read
    (ma, _, _, oa, _), (mb, _, _, ob, _) = runs
    weights = all(torch.equal(a, b) for a, b in zip(ma.parameters(), mb.parameters()))
    return {"weights": weights, "state_dict": _same(oa.state_dict(), ob.state_dict())}


def _same(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _mutate(step, mutant: str) -> None:
    """Mutants the comparison must catch: `skip_copy_back` leaves bucket 1's update off the host (its copy out is
    skipped); `stale_masters` skips bucket 1's copy in once values exist, its slot filled with 0xff bytes (NaN in
    every float dtype) rather than whatever the allocator's block last held, which could by chance be the right
    values."""
    orig_out, orig_in, n = step._copy_out, step._copy_in, {"out": 0, "in": 0}

    def copy_out(bucket, slot, streams):
        n["out"] += 1
        return None if n["out"] == 2 else orig_out(bucket, slot, streams)

    def copy_in(bucket, slot, fresh, streams, free):
        n["in"] += 1
        first = step.stats["buckets"]  # buckets of the step before: 0 during the first step
        if first and n["in"] == first + 2:
            slot.fill_(255)
            return None
        return orig_in(bucket, slot, fresh, streams, free)

    if mutant == "skip_copy_back":
        step._copy_out = copy_out
    elif mutant == "stale_masters":
        step._copy_in = copy_in
    else:
        raise ValueError(f"unknown mutant {mutant!r}")
