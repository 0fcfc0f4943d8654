"""The optimizer step streamed from host memory (`memory.optimizer_step=stream`): the phase-aware principle
applied inside the optimizer phase.

Under a releasing plan the fp32 master weights and Adam's exp_avg / exp_avg_sq live in the memory manager's
host buffers (pinned on CUDA) outside the optimizer step (memory/manager.py). The resident step brings them back
for the step, so masters, both states, the gradients and torch Adam's sqrt workspace share the device (3B, 36
layers: the optimizer phase is the run's peak). The streamed step leaves them on the host and runs megatron's own
`step()` (megatron-core 0.16.1 optimizer/optimizer.py:593 `MixedPrecisionOptimizer.step`, :961
`FP32Optimizer.step`, :1308 `ChainedOptimizer.step`: the gradients' copy, the global norm and the clipping over
every gradient come first, unchanged) with the inner `step_with_ready_grads` (:560, :943) replaced by `_step`:

- the parameters, in the optimizer's order, are cut into buckets of at most `memory.optimizer_bucket_mib` bytes of
  streamed tensors; a larger parameter is split at multiples of ALIGN elements (Adam is elementwise);
- bucket i+1 is copied in on the copy stream while bucket i is updated on the compute stream and bucket i-1 is
  copied out, in `memory.optimizer_buckets` device slots; events order the streams, the host never waits;
- a bucket's update is torch's own Adam, `torch.optim.adam.adam` (the functional `torch.optim.AdamW.step` calls),
  with its group's options, on views of the slot: every element gets the arithmetic of the resident step, bit for
  bit; each piece gets a copy of its parameter's step count, and the counts are written once at the end;
- the bf16 weights are written from the updated masters bucket by bucket (the values megatron's
  `_copy_main_params_to_model_params`, :774, writes).

A tensor of a class the plan keeps resident (or of a one-element parameter, whose states the manager does not
manage) is updated in place on the device, in the same buckets. Adam's states are created here on the first step
(as `Adam._init_group` would), streamed ones in offloaded form: zeroed in the slot, never on the device whole.
Without CUDA the same steps run in order on CPU tensors, the host buffers standing for pinned memory.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
from torch.optim.adam import adam
from torch.optim.optimizer import _get_scalar_dtype

ROLES = ("param", "exp_avg", "exp_avg_sq")  # what a piece streams: the master (or fp32 parameter), Adam's states
ALIGN = 2048  # elements: a split parameter's pieces start at multiples of this (whole vector blocks on every ISA)
SLOT_ALIGN = 512  # bytes: each staged tensor starts at an aligned offset of its slot


@dataclass
class Piece:
    """Elements [start, stop) of one parameter, updated in one bucket."""

    group: dict  # the torch optimizer's param group
    param: torch.Tensor  # what Adam updates: the fp32 master, or the fp32 parameter itself
    model: torch.Tensor | None  # the bf16 parameter written from the master (None: Adam updates it directly)
    state: dict  # the parameter's Adam state
    start: int
    stop: int
    staged: dict = field(default_factory=dict)  # streamed roles only: role -> (offset in the slot, host view)


class StreamedStep:
    """megatron's optimizer step with the inner Adam update streamed bucket by bucket (module docstring)."""

    def __init__(self, manager, bucket_bytes: int, slots: int = 2):
        self.manager, self.bucket_bytes, self.slots = manager, int(bucket_bytes), slots
        self.stats = {"buckets": 0, "split_params": 0}  # the last step's buckets and parameters split across them

    def step(self, optimizer):
        """megatron's `optimizer.step()` (norm, clipping, statistics) with the streamed update inside."""
        subs = getattr(optimizer, "chained_optimizers", [optimizer])
        for opt in subs:  # an instance attribute shadows the class's method for this call only
            opt.step_with_ready_grads = partial(self._step, opt)
        try:
            return optimizer.step()
        finally:
            for opt in subs:
                del opt.step_with_ready_grads

    @torch.no_grad()
    def _step(self, opt) -> bool:
        if opt.is_stub_optimizer:
            return True
        inner = opt.optimizer
        _check_supported(opt, inner)
        models = {id(main): model for mg, fg in zip(getattr(opt, "float16_groups", []),
                                                    getattr(opt, "fp32_from_float16_groups", []))
                  for model, main in zip(mg, fg)}
        fresh = self._init_states(inner)
        host = self.manager.host_views()
        buckets = self._buckets(inner, models, host)
        steps = {id(p): inner.state[p]["step"].clone() for b in buckets for p in (pc.param for pc in b)}
        self._run(inner, buckets, fresh, steps)
        for p in {id(pc.param): pc.param for b in buckets for pc in b}.values():
            inner.state[p]["step"].add_(1)  # what Adam's own `step_t += 1` leaves (each piece counted a copy)
        pieces = [id(pc.param) for b in buckets for pc in b]
        self.stats = {"buckets": len(buckets), "split_params": len(pieces) - len(set(pieces))}
        return True

    def _init_states(self, inner) -> set:
        """Adam's states of parameters without any (its first step), as `Adam._init_group` makes them; a streamed
        class's are created offloaded (storage released) and handed host buffers. Returns their ids."""
        stream_states = "optimizer_states" in self.manager.streamed
        fresh = set()
        for group in inner.param_groups:
            for p in group["params"]:
                if p.grad is None or len(inner.state[p]) > 0:
                    continue
                state = inner.state[p]
                state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())  # on the CPU, as Adam's default
                for key in ("exp_avg", "exp_avg_sq"):
                    if stream_states and p.numel() > 1:  # the manager streams states of more than one element
                        t = torch.empty_like(p, memory_format=torch.preserve_format)
                        t.untyped_storage().resize_(0)  # one parameter's bytes at a time, never the whole class
                        fresh.add(id(t))
                    else:
                        t = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state[key] = t
        if fresh:
            self.manager.adopt_offloaded("optimizer_states")
        return fresh

    def _buckets(self, inner, models: dict, host: dict) -> list[list[Piece]]:
        """The parameters with a gradient, in the optimizer's order, as pieces of buckets whose streamed bytes stay
        within `bucket_bytes` (a bucket holds at least ALIGN elements of a piece)."""
        buckets, cur, used = [], [], 0
        for group in inner.param_groups:
            for p in (p for p in group["params"] if p.grad is not None):
                views = {r: _host_view(t, host) for r, t in _roles(inner, p).items()}
                per = sum(t.element_size() for r, t in _roles(inner, p).items() if views[r] is not None)
                start, n = 0, p.numel()
                while start < n:
                    room = n - start if per == 0 else (self.bucket_bytes - used) // per
                    take = n - start if room >= n - start else room // ALIGN * ALIGN
                    if take == 0 and cur:  # this bucket is full
                        buckets.append(cur)
                        cur, used = [], 0
                        continue
                    take = max(take, min(ALIGN, n - start))
                    cur.append(Piece(group, p, models.get(id(p)), inner.state[p], start, start + take,
                                     {r: v for r, v in views.items() if v is not None}))
                    used, start = used + take * per, start + take
        return buckets + ([cur] if cur else [])

    def _run(self, inner, buckets: list, fresh: set, steps: dict) -> None:
        """The pipeline: copy in bucket i+1, update bucket i, copy out bucket i, over `slots` device slots."""
        if not buckets:
            return
        sizes = [_layout(b) for b in buckets]
        dev = self.manager.device
        slots = [torch.empty(max(sizes), dtype=torch.uint8, device=dev) for _ in range(min(self.slots, len(buckets)))]
        streams = self._begin()
        free = [None] * len(slots)  # per slot: its last copy-out's event
        ready = self._copy_in(buckets[0], slots[0], fresh, streams, free[0])
        for i, bucket in enumerate(buckets):
            slot = slots[i % len(slots)]
            after = None
            if i + 1 < len(buckets):  # the next bucket's copy runs while this one is updated
                j = (i + 1) % len(slots)
                after = self._copy_in(buckets[i + 1], slots[j], fresh, streams, free[j])
            if streams:
                torch.cuda.current_stream().wait_event(ready)
            self._update(inner, bucket, slot, fresh, steps)
            free[i % len(slots)] = self._copy_out(bucket, slot, streams)
            ready = after
        if streams:  # the slots return to the allocator on the compute stream: the copies out must be done
            for ev in free:
                torch.cuda.current_stream().wait_event(ev)

    def _begin(self) -> dict | None:
        """The copy streams, ordered after the compute stream's work (the slots' allocation, the gradients) and
        after the streamed classes' last offload (it wrote the host buffers read here); None on CPU."""
        m = self.manager
        if not m.cuda:
            return None
        for s in dict.fromkeys(m.copy_streams.values()):
            s.wait_stream(torch.cuda.current_stream())
        for name in m.streamed:
            c = m.classes[name]
            if c.event is not None:
                m.copy_streams["h2d"].wait_event(c.event)
                m.copy_streams["d2h"].wait_event(c.event)
                c.event = None  # the compute stream waits for this step's copies at its end
        return m.copy_streams

    def _copy_in(self, bucket: list, slot, fresh: set, streams, free) -> object:
        """Host to slot for every streamed tensor of `bucket` that has values (a fresh state is zeroed instead)."""
        pairs = [(_slot_view(slot, off, pc, t), view[pc.start:pc.stop]) for pc in bucket
                 for r, (off, view) in pc.staged.items() if id(t := _role(pc, r)) not in fresh]
        return self._copy(pairs, streams, "h2d", free)

    def _copy_out(self, bucket: list, slot, streams) -> object:
        """Slot to host for every streamed tensor of `bucket`, after its update on the compute stream."""
        pairs = [(view[pc.start:pc.stop], _slot_view(slot, off, pc, _role(pc, r))) for pc in bucket
                 for r, (off, view) in pc.staged.items()]
        done = None
        if streams:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream())
        return self._copy(pairs, streams, "d2h", done)

    def _copy(self, pairs: list, streams, kind: str, wait) -> object:
        self.manager.copy_bytes[kind] += sum(src.numel() * src.element_size() for _, src in pairs)
        if not streams:
            for dst, src in pairs:
                dst.copy_(src)
            return None
        stream = streams[kind]
        if wait is not None:
            stream.wait_event(wait)
        with torch.cuda.stream(stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        return ev

    def _update(self, inner, bucket: list, slot, fresh: set, steps: dict) -> None:
        """torch's Adam over the bucket's pieces, one call per param group, then the bf16 weights from the masters."""
        by_group: dict[int, tuple[dict, list]] = {}
        for pc in bucket:
            by_group.setdefault(id(pc.group), (pc.group, []))[1].append(pc)
        for group, pieces in by_group.values():
            t = {r: [self._tensor(pc, r, slot, fresh) for pc in pieces] for r in ROLES}
            grads = [pc.param.grad.view(-1)[pc.start:pc.stop] for pc in pieces]
            counts = [steps[id(pc.param)].clone() for pc in pieces]
            beta1, beta2 = group["betas"]
            adam(t["param"], grads, t["exp_avg"], t["exp_avg_sq"], [], counts, amsgrad=group["amsgrad"],
                 has_complex=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                 eps=group["eps"], maximize=group["maximize"], foreach=group["foreach"],
                 capturable=group["capturable"], differentiable=group["differentiable"], fused=group["fused"],
                 grad_scale=getattr(inner, "grad_scale", None), found_inf=getattr(inner, "found_inf", None),
                 decoupled_weight_decay=group.get("decoupled_weight_decay", False))
            for pc, master in zip(pieces, t["param"]):
                if pc.model is not None:
                    pc.model.view(-1)[pc.start:pc.stop].copy_(master)

    def _tensor(self, pc: Piece, role: str, slot, fresh: set) -> torch.Tensor:
        """The piece's `role` tensor where Adam updates it: its slot view (zeroed when fresh) or the device tensor."""
        t = _role(pc, role)
        if role not in pc.staged:
            return t.view(-1)[pc.start:pc.stop]
        view = _slot_view(slot, pc.staged[role][0], pc, t)
        if id(t) in fresh:
            view.zero_()
        return view


def _roles(inner, p) -> dict:
    state = inner.state[p]
    return {"param": p, "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}


def _role(pc: Piece, role: str) -> torch.Tensor:
    return pc.param if role == "param" else pc.state[role]


def _host_view(t: torch.Tensor, host: dict) -> torch.Tensor | None:
    """`t`'s elements, flat, in its class's host buffer; None where `t` is on the device (not streamed)."""
    buf = host.get(t.untyped_storage()._cdata)
    if buf is None:
        return None
    if not t.is_contiguous():
        raise ValueError(f"memory.optimizer_step=stream needs contiguous optimizer tensors, got strides {t.stride()}")
    off = t.storage_offset()
    return buf.view(t.dtype)[off:off + t.numel()]


def _layout(bucket: list) -> int:
    """Assign each streamed tensor of `bucket` its offset in a slot; the slot bytes the bucket needs."""
    used = 0
    for pc in bucket:
        for r, view in list(pc.staged.items()):  # role -> host view, as `_buckets` left it
            pc.staged[r] = (used, view)
            used += -(-(pc.stop - pc.start) * view.element_size() // SLOT_ALIGN) * SLOT_ALIGN
    return used


def _slot_view(slot: torch.Tensor, offset: int, pc: Piece, t: torch.Tensor) -> torch.Tensor:
    n = (pc.stop - pc.start) * t.element_size()
    return slot[offset:offset + n].view(t.dtype)


def _check_supported(opt, inner) -> None:
    """The streamed update reproduces torch Adam's default path (not amsgrad, capturable, fused or differentiable)
    and megatron's plain copy of the masters into the weights."""
    if not isinstance(inner, torch.optim.Adam):
        raise ValueError(f"memory.optimizer_step=stream needs torch's Adam/AdamW under megatron's optimizer, got "
                         f"{type(inner).__name__} (transformer-engine or apex installed?); set "
                         "memory.optimizer_step=resident")
    for g in inner.param_groups:
        bad = [k for k in ("amsgrad", "capturable", "fused", "differentiable") if g.get(k)]
        if bad:
            raise ValueError(f"memory.optimizer_step=stream does not reproduce Adam with {bad}; set "
                             "memory.optimizer_step=resident")
    if getattr(opt.config, "reuse_grad_buf_for_mxfp8_param_ag", False):
        raise ValueError("memory.optimizer_step=stream does not write mxfp8 parameter buffers; set "
                         "memory.optimizer_step=resident")
