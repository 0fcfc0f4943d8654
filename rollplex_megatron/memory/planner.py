"""Analytic HBM per GPU and phase, for serial colocation and for the Rollplex plan (docs/design.md §1).

Each tensor class has a size (bytes on the fullest GPU) and the phases of one step in which it is
resident. A phase's bytes are the sum of its resident classes; the plan's peak is the largest phase.
One function, `plan(cfg, mode, residency, engine)`, models every combination:
- the paper's baseline (`serial_plan`): serial phases, everything resident (`keep`), a separate
  inference engine with its own weight copy and a K/V pool where every sample holds its prompt;
- the Rollplex plan (`rollplex_plan`): rollplex phases, residency following producer-consumer
  lifetimes (`phase`, what memory/manager.py does at run time), the embedded engine on the actor's
  weights with one prefix K/V per group, and the actor prefix recomputed one group (or pack) at a time;
- the trainer's own runs (`runtime_plan`): mode and `memory.plan` of the run, embedded engine, and
  the shape of the task's real prompts (checked against `memory.budget_gib` and the machine's free
  memory, on CPU the host's (`check_machine`, memory/machine.py), before the models are built, and
  against the allocator's per-phase peaks on the GPU).
Activations are counted tensor by tensor (memory/tensor_bytes.py) with the RMSNorm that runs
(`train.norm_kernel`, `norm_kernel`) and the RoPE that runs (`train.rope_kernel`, `rope_kernel`); phase
workspaces (the loss's logits, torch Adam's sqrt buffer) are classes of their one phase.

The model's tensor sizes are memory/tensor_bytes.py; the checks against a budget and the machine, with the
errors that name the fix, memory/budget.py; the choices made under a budget (`memory.plan=auto`, the auto sizes,
`memory.prefetch_ahead`, the settings that would fit) memory/auto.py.
"""
from __future__ import annotations

from dataclasses import asdict, replace

from rollplex_megatron.config import RunConfig
from rollplex_megatron.memory.classes import PlanInputs, Shape, TensorClass
from rollplex_megatron.memory.tensor_bytes import (block_activation_bytes, kv_bytes_per_token, layer_activation_bytes,
                                                   logits_bytes, params_per_gpu, prefix_graph_bytes,
                                                   score_logits_bytes, training_forward_bytes, vision_base_bytes,
                                                   vocab_slice)
from rollplex_megatron.runtime import device, kernel_for
from rollplex_megatron.trainer.modes import get_mode
from rollplex_megatron.weights.plan import plan_pairs, rank_pairs, split_gemm_bytes, split_local

GIB = 2**30
# Plan `phase` (what memory/manager.py does at run time): the phases of one step in which each
# managed class is on the device; elsewhere it is offloaded (or, for grads, freed). The reference's
# phases are the mode's declaration (`Mode.reference_phases`).
PHASE_RESIDENCY = {
    "main_weights": ("optimizer",),
    "optimizer_states": ("optimizer",),
    "grads": ("update", "optimizer"),
}


# What a residency plan may release outside its phases, in the order `memory.plan=auto` releases
# them: Adam's states and the fp32 masters first (needed in the optimizer step only: one round trip
# per step), then the reference (read-only: after its first offload only host-to-device copies),
# then the actor prefix graphs (recomputed: one more prefix forward per group), then the gradients
# (freed and re-zeroed every step).
RELEASE_ORDER = ("optimizer_states", "main_weights", "reference_weights", "actor_prefix_graph", "grads")
# memory.optimizer_step=stream: these classes, where released, stay on the host all step and the optimizer step
# streams them through the device bucket by bucket (memory/stream_optimizer.py)
STREAMABLE = frozenset({"optimizer_states", "main_weights"})


def released(residency) -> frozenset:
    """The classes a residency releases: keep none, phase all of RELEASE_ORDER, or an explicit set."""
    if residency == "keep":
        return frozenset()
    if residency == "phase":
        return frozenset(RELEASE_ORDER)
    if isinstance(residency, str) or not set(residency) <= set(RELEASE_ORDER):
        raise ValueError(f"memory.plan (residency) must be keep, phase or a set of {RELEASE_ORDER}, got {residency!r}")
    return frozenset(residency)


def streamed(cfg: RunConfig, rel: frozenset) -> frozenset:
    """The classes the optimizer step streams (`memory.optimizer_step=stream`): the released ones of STREAMABLE.
    `auto` counts as resident here: a run resolves it (`auto_size`) before it plans."""
    return rel & STREAMABLE if cfg.memory.optimizer_step == "stream" else frozenset()


def optimizer_step_bytes(cfg: RunConfig, w: dict[str, int], stream: frozenset) -> tuple[int, int]:
    """The optimizer phase's own bytes: (streamed buckets' slots, Adam's workspace). Resident: no slots, and torch
    Adam's sqrt(exp_avg_sq) over every parameter (0 for a fused Adam). Streamed: `memory.optimizer_buckets` slots of
    `memory.optimizer_bucket_mib` (at most what is streamed), and the workspace of one bucket's elements."""
    n = w["optimizer_states"] // 8  # elements Adam steps on this GPU
    per = 8 * ("optimizer_states" in stream) + 4 * ("main_weights" in stream and w["main_weights"] > 0)
    elems = n if per == 0 else min(n, int(cfg.memory.optimizer_bucket_mib * 2**20) // per)
    slots = min(cfg.memory.optimizer_buckets * elems, n) * per
    return slots, 0 if cfg.plan.fused_adam else 4 * elems


def setup_classes(w: dict[str, int], rel: frozenset, ref: bool, resume: bool = False) -> tuple[str, ...]:
    """The classes on the device at the fullest point of the runtime's start-up. trainer/runtime.py builds the actor,
    then DDP's grad buffers, then the optimizer's fp32 masters, then the reference (a copy of the initial actor),
    and releases each class the plan releases as soon as it exists (`MemoryManager.release_built`); Adam's states
    appear at the first optimizer step. The points: actor + grads; actor + kept grads + masters; actor + kept grads
    + kept masters + reference. `resume` (train.resume): the checkpoint's load then brings the masters back with
    Adam's states, which it creates (`MemoryManager.holding`), beside the kept classes."""
    kept = lambda *names: tuple(n for n in names if n not in rel)  # noqa: E731
    points = [("actor_weights", "grads"), ("actor_weights", *kept("grads"), "main_weights")]
    if ref:
        points.append(("actor_weights", *kept("grads", "main_weights"), "reference_weights"))
    if resume:
        points.append(("actor_weights", *kept("grads", *(("reference_weights",) if ref else ())), "main_weights",
                       "optimizer_states"))
    return max(points, key=lambda names: sum(w[n] for n in names))


def phases(mode: str) -> tuple[str, ...]:
    """The phases of one step of `mode`, in order (the mode's declaration)."""
    return get_mode(mode).phases


def without_reference(classes: list[TensorClass], allp: tuple[str, ...]) -> list[TensorClass]:
    """A run without the reference (`train.reference`): no reference class (weights, prefix K/V) and no
    reference scoring phase; every other class is resident in the phases left (`allp`)."""
    out = []
    for c in classes:
        resident = tuple(p for p in c.resident if p in allp)
        if not c.name.startswith("reference_") and resident:
            out.append(replace(c, resident=resident))
    return out


def releasable(cfg: RunConfig) -> tuple[str, ...]:
    """RELEASE_ORDER's classes the run has (no reference_weights without the reference)."""
    return tuple(n for n in RELEASE_ORDER if n != "reference_weights" or cfg.train.uses_reference)


def resident_phases(name: str, mode: str) -> tuple[str, ...]:
    """The phases in which the `phase` plan keeps a managed class on the device."""
    if name == "reference_weights":
        return get_mode(mode).reference_phases
    return PHASE_RESIDENCY[name]


def planned_kernel(choice: str) -> str:
    """The kernel a plan counts for a `train.*_kernel` setting: torch where set so, else triton (`auto` meaning the
    GPU run's; the trainer's own plan resolves it on its device first: `runtime_cfg`)."""
    return "torch" if choice == "torch" else "triton"


def norm_kernel(cfg: RunConfig) -> str:
    """The RMSNorm a plan counts (`planned_kernel` of `train.norm_kernel`)."""
    return planned_kernel(cfg.train.norm_kernel)


def rope_kernel(cfg: RunConfig) -> str:
    """The RoPE a plan counts (`planned_kernel` of `train.rope_kernel`)."""
    return planned_kernel(cfg.train.rope_kernel)


def logprob_kernel(cfg: RunConfig) -> str:
    """The log-prob kernel a plan counts (`planned_kernel` of `train.logprob_kernel`)."""
    return planned_kernel(cfg.train.logprob_kernel)


def window_graph_bytes(cfg: RunConfig, s: Shape) -> int:
    """The pool of mode.window_graphs' captured reference items (prefix/graphs.py): each kept bucket's K/V outputs
    (a pack of `pack_groups` prefixes), and the transients of one no-grad prefix forward over a pack, bounded by
    one decoder layer's and one vision block's saved tensors per token and patch (a forward without grad frees each
    layer's before the next; the buckets share the pool, so one forward's worth)."""
    m, par, e = cfg.model, cfg.parallel, cfg.param_bytes
    norm, rope, sp = norm_kernel(cfg), rope_kernel(cfg), cfg.plan.sequence_parallel
    pack = pack_groups(cfg, s)
    outputs = cfg.mode.window_graph_buckets * pack * s.P * kv_bytes_per_token(m, par.tp, m.num_layers // par.pp, e)
    transient = pack * (s.P * layer_activation_bytes(m, par.tp, sp, norm, rope)
                        + s.patches * (block_activation_bytes(m, par.tp, norm, rope) + vision_base_bytes(m, par.tp,
                                                                                                       norm)))
    return outputs + transient


def workload_shape(cfg: RunConfig, prefix_tokens: int | None = None, patches: int | None = None,
                   response_tokens: int | None = None, min_prefix_tokens: int = 0) -> Shape:
    """The step's shape from `cfg.plan` (plan-memory) or from a task's real prompt (the trainer; its shortest
    sampled prefix `min_prefix_tokens` bounds how many groups a pack holds)."""
    p = cfg.plan
    pick = lambda given, default: default if given is None else given  # noqa: E731 (0 patches is a real value)
    r = pick(response_tokens, p.response_tokens)
    return Shape(cfg.prompts_per_rank, cfg.rollout.group_size, pick(prefix_tokens, p.prefix_tokens), r,
                 pick(patches, p.vision_patches), micro_batch_responses(cfg, r), min_prefix_tokens)


def pack_groups(cfg: RunConfig, s: Shape) -> int:
    """The most groups one pack of `workload.prefix_pack_tokens` holds: prefixes of the shortest sampled length
    (`s.P_min`, else `s.P`), each counted with the largest group's graph (1 when off), at most the largest PPO
    mini-batch's groups (no pack spans two: `prefix.execution.mini_batch_starts`)."""
    pack = cfg.workload.prefix_pack_tokens
    largest_mini = -(-s.prompts // cfg.train.ppo_mini_batches)
    return 1 if pack <= 0 else max(1, min(largest_mini, pack // max(s.P_min or s.P, 1)))


def micro_batch_responses(cfg: RunConfig, response_tokens: int) -> int:
    """The shape's responses per micro-batch: the count, or under `workload.micro_batch_tokens` enough
    responses of `response_tokens` to cover the budget (mb x R >= max(budget, R), the most response tokens
    a packed micro-batch holds), at most the rank's samples."""
    w = cfg.workload
    if w.micro_batch_tokens <= 0:
        return w.responses_per_micro_batch
    fit = -(-w.micro_batch_tokens // max(response_tokens, 1))
    return max(1, min(fit, cfg.prompts_per_rank * cfg.rollout.group_size))


def full_sequence_responses(cfg: RunConfig, s: Shape) -> int:
    """Responses one full-sequence micro-batch (serial's, each response with its whole prompt) may hold: the count,
    or under `workload.micro_batch_tokens` as many as the budget admits of the shortest response (one token), at
    most the largest PPO mini-batch's samples. The budget counts response tokens only (prefix/batch.pack_responses),
    so short responses come in numbers, each bringing its prompt."""
    w = cfg.workload
    if w.micro_batch_tokens <= 0:
        return s.mb
    largest_mini = -(-s.prompts // cfg.train.ppo_mini_batches) * s.group
    return max(1, min(w.micro_batch_tokens, largest_mini))


def _weights(cfg: RunConfig) -> dict[str, int]:
    m, par = cfg.model, cfg.parallel
    n = params_per_gpu(m, par.tp, par.pp)
    e = cfg.param_bytes
    shard = par.dp if cfg.plan.distributed_optimizer else 1
    out = {"actor_weights": e * n, "main_weights": 4 * n // shard if e == 2 else 0, "grads": 4 * n,
           "optimizer_states": 8 * n // shard, "reference_weights": e * n}
    return out


def _largest_wave(cfg: RunConfig, s: Shape, kv_tok: int) -> int:
    """Bytes of the embedded engine's largest wave: groups fill `memory.kv_cache_gib` in order."""
    per_group = kv_tok * (s.P + s.group * s.R)
    fit = max(1, min(s.prompts, int(cfg.memory.kv_cache_gib * GIB) // per_group))
    return fit * per_group


def shared_rollout_bytes(cfg: RunConfig) -> int:
    """Bytes the rollout model owns on the fullest rank when `rollout.tp` differs from the training TP:
    its rebuilt tensors (local permutations, gathers), less what `rollout.split_gemm` serves from views,
    for the (training TP rank, rollout TP rank) pairs the run's layouts put on its ranks."""
    t, r, e = cfg.parallel.tp, cfg.rollout.tp or cfg.parallel.tp, cfg.param_bytes
    if r == t:
        return 0
    pairs = sorted(set(rank_pairs(t, r, cfg.parallel.world_size)))
    cost = {"all": split_gemm_bytes, "off": lambda p: p.alloc_bytes,
            "local": lambda p: 0 if split_local(p) else p.alloc_bytes}[cfg.rollout.split_gemm]
    return max(sum(cost(p) for p in g) for g in plan_pairs(cfg.model, t, r, pairs, "megatron", e))


def plan(cfg: RunConfig, mode: str, residency: str, engine: str, s: Shape | None = None,
         ahead: dict | None = None) -> list[TensorClass]:
    """Tensor classes of one step on the fullest GPU.

    mode: a registered mode name; the mode declares its phases, where the reference lives and the
    classes of its prefix work, scoring and update (trainer/modes/, docs/design.md §2).
    residency: keep (everything stays) | phase (the plan of memory/manager.py: main weights and Adam
    states on the device only for the optimizer step, gradients from the update on, the reference
    only where it is read, the actor prefix recomputed one group or pack at a time instead of kept) | a set
    of RELEASE_ORDER names released that way, the rest kept (what `memory.plan=auto` chose).
    engine: embedded (rollout on the actor's weights, one prefix K/V per group; at `rollout.tp` !=
    parallel.tp on a rollout model bound to them, whose rebuilt tensors count) | separate (naive
    colocation of an inference engine: its own weight copy at rollout.tp, and every sample
    holds its prompt's K/V).
    Phase workspaces (loss, Adam, the micro-batch's activations) are classes of their one phase.
    ahead: {released class: the phase it comes back in, one before its own} (`ahead_phases`).
    """
    s = s or workload_shape(cfg)
    if get_mode(mode).full_sequences:  # serial's micro-batches carry their prompts: counted as they are formed
        s = replace(s, mb=full_sequence_responses(cfg, s))
    m, par, sp, norm, rope = cfg.model, cfg.parallel, cfg.plan.sequence_parallel, norm_kernel(cfg), rope_kernel(cfg)
    e = cfg.param_bytes
    ref = cfg.train.uses_reference
    allp = phases(mode) if ref else tuple(p for p in phases(mode) if p != "ref_logp")
    w = _weights(cfg)
    rel = released(residency)
    kv_tok = kv_bytes_per_token(m, par.tp, m.num_layers // par.pp, e)
    kv32 = kv_bytes_per_token(m, par.tp, m.num_layers // par.pp, 4)
    ahead = ahead or {}
    stream = streamed(cfg, rel)

    def where(name: str) -> tuple:
        if name not in rel:
            return allp
        if name in stream:  # on the host all step: the optimizer step streams it (optimizer_buckets)
            return ()
        own = resident_phases(name, mode)
        return own if name not in ahead else (ahead[name], *own)
    act = lambda name, how: how if name in rel else "keep"  # noqa: E731
    out = [
        TensorClass("actor_weights", w["actor_weights"], allp, "keep", "the rollout runs on them"
                    if engine == "embedded" else ""),
        TensorClass("main_weights", w["main_weights"], where("main_weights"), act("main_weights", "offload"),
                    "fp32 masters of megatron's Float16 optimizer"),
        TensorClass("optimizer_states", w["optimizer_states"], where("optimizer_states"),
                    act("optimizer_states", "offload"), "Adam exp_avg and exp_avg_sq"),
        TensorClass("grads", w["grads"], where("grads"), act("grads", "free"),
                    "megatron DDP's fp32 grad buffers"),
        TensorClass("reference_weights", w["reference_weights"], where("reference_weights"),
                    act("reference_weights", "offload")),
    ]
    keep = "actor_prefix_graph" not in rel  # the prefix graphs stay (else: recomputed one group at a time)
    held = cfg.rollout.keep_decode_state  # the engine keeps its cache and graphs' pool between rollouts

    def kept(what: str) -> tuple:
        return (allp, "keep", what + "; kept between rollouts (rollout.keep_decode_state)") if held else \
            (("rollout",), "free", what)
    if mode == "disaggregated":  # the rollout ranks decode (rollout_rank_plan): nothing of it here
        pass
    elif engine == "separate":
        rtp = cfg.rollout.tp or par.tp
        out.append(TensorClass("rollout_weights", e * params_per_gpu(m, rtp, 1), allp, "keep",
                               "the inference engine's own weight copy"))
        out.append(TensorClass("rollout_kv", s.samples * (s.P + s.R) * kv_bytes_per_token(m, rtp, m.num_layers, e),
                               allp, "keep", "every sample holds its prompt and response K/V (no prefix sharing)"))
    elif (cfg.rollout.tp or par.tp) != par.tp:  # the embedded engine at its own layout, on shared weights
        r = cfg.rollout.tp
        out.append(TensorClass("rollout_weights", shared_rollout_bytes(cfg), allp, "keep",
                               f"the rollout model's rebuilt tensors at rollout.tp={r} (views cost nothing)"))
        per_replica = replace(s, prompts=max(1, -(-s.prompts * par.dp * r // par.world_size)))
        out.append(TensorClass("rollout_kv", _largest_wave(cfg, per_replica, kv_bytes_per_token(m, r, m.num_layers, e)),
                               *kept("the replica's cache: one prefix per group plus G response slots, largest "
                                     "wave")))
    else:
        out.append(TensorClass("rollout_kv", _largest_wave(cfg, s, kv_tok),
                               *kept("the engine's cache: one prefix per group plus G response slots, largest wave")))
    v = vocab_slice(m, par.tp)
    if mode != "disaggregated":
        out.append(TensorClass("decode_workspace", s.samples * v * 10,
                               *kept("one decode step's logits and sampling uniforms (the graphs' pool)")))
    inputs = PlanInputs(s, keep, prefix_kv_fp32=s.prompts * s.P * kv32, prefix_kv=s.prompts * s.P * kv_tok,
                        prefix_graph=prefix_graph_bytes(m, par.tp, par.pp, sp, s.P, s.patches, norm, rope),
                        logits=lambda tokens: logits_bytes(m, par.tp, tokens),
                        score_logits=lambda tokens: score_logits_bytes(m, par.tp, tokens, logprob_kernel(cfg), e),
                        activations=lambda tokens, patches, packed=False: training_forward_bytes(
                            m, par.tp, par.pp, sp, tokens, patches, norm, rope,
                            logprob_kernel(cfg) if packed else "torch", e),
                        rounds=1 + cfg.train.max_resample_rounds if cfg.train.dynamic_sampling else 1,
                        pack_groups=pack_groups(cfg, s))
    out += get_mode(mode).memory_classes(inputs)
    if "update" in allp:
        out.append(TensorClass("output_weight_grad", e * v * m.hidden_size, ("update",), "free",
                               "autograd's gradient of the output layer's weight in the parameters' dtype, made at "
                               "the first op of the backward (the update's peak) and alive until DDP's hook adds it to "
                               "the fp32 main grad; with tied embeddings until the embedding's backward"))
    if cfg.mode.window_graphs and mode == "rollplex":  # the captured reference items' pool (prefix/graphs.py)
        out.append(TensorClass("reference_prefix_graphs", window_graph_bytes(cfg, s), allp, "keep",
                               f"mode.window_graphs: the K/V outputs of up to {cfg.mode.window_graph_buckets} captured "
                               "buckets and one no-grad prefix forward's transients, resident all step"))
    slots, adam = optimizer_step_bytes(cfg, w, stream)
    if stream:
        out.append(TensorClass("optimizer_buckets", slots, ("optimizer",), "free",
                               f"memory.optimizer_step=stream: {cfg.memory.optimizer_buckets} buckets of "
                               f"{'/'.join(sorted(stream))} on the device at once"))
    out.append(TensorClass("optimizer_workspace", adam, ("optimizer",), "free",
                           "torch Adam (foreach) holds sqrt(exp_avg_sq) for every parameter (streamed: one bucket's); "
                           "fused Adam: 0"))
    out = out if ref else without_reference(out, allp)
    at_setup = setup_classes(w, rel, ref, cfg.train.resume)  # start-up: every phase after it holds what it needs
    return [replace(c, resident=(*c.resident, "setup")) if c.name in at_setup else c for c in out]


def serial_plan(cfg: RunConfig, s: Shape | None = None) -> list[TensorClass]:
    """The paper's baseline: serial phases, everything resident, the engine as `plan.serial_engine`."""
    return plan(cfg, "serial", "keep", cfg.plan.serial_engine, s)


def rollplex_plan(cfg: RunConfig, s: Shape | None = None) -> list[TensorClass]:
    """Rollplex: rollplex phases, phase-aware residency, the embedded engine."""
    return plan(cfg, "rollplex", "phase", "embedded", s)


def runtime_cfg(cfg: RunConfig) -> RunConfig:
    """`cfg` with the plan.* layout the trainer really runs: no sequence parallelism, megatron's
    plain optimizer, torch's Adam unless transformer-engine or apex gives megatron a fused one, and
    `train.norm_kernel` and `train.rope_kernel` resolved on this process's device (auto: torch's on CPU)."""
    try:
        from megatron.core.optimizer import USING_PYTORCH_OPTIMIZER as torch_adam
    except ImportError:  # pragma: no cover - older megatron-core
        torch_adam = True
    norm = kernel_for("train.norm_kernel", cfg.train.norm_kernel, device())
    rope = kernel_for("train.rope_kernel", cfg.train.rope_kernel, device())
    logprob = kernel_for("train.logprob_kernel", cfg.train.logprob_kernel, device())
    return replace(cfg, plan=replace(cfg.plan, sequence_parallel=False, distributed_optimizer=False,
                                     fused_adam=not torch_adam),
                   train=replace(cfg.train, norm_kernel=norm, rope_kernel=rope, logprob_kernel=logprob))


def runtime_plan(cfg: RunConfig, s: Shape, ahead: dict | None = None) -> list[TensorClass]:
    """What the trainer's run of `cfg` holds: its mode and `memory.plan`, the embedded engine (`ahead`: the
    classes `memory.prefetch_ahead` brings back early)."""
    return plan(runtime_cfg(cfg), cfg.mode.name, cfg.memory.plan, "embedded", s, ahead)


def rollout_rank_plan(cfg: RunConfig, s: Shape | None = None) -> dict:
    """mode=disaggregated: a rollout rank's bytes (GiB): its own full weight copy at rollout.tp, its
    replica's largest cache wave and one decode step's workspace."""
    s = s or workload_shape(cfg)
    m, par = cfg.model, cfg.parallel
    e, r = cfg.param_bytes, cfg.rollout.tp or par.tp
    replicas = max(1, par.rollout_ranks // r)
    per_replica = replace(s, prompts=max(1, -(-s.prompts * par.dp // replicas)))
    classes = {"rollout_weights": e * params_per_gpu(m, r, 1),
               "rollout_kv": _largest_wave(cfg, per_replica, kv_bytes_per_token(m, r, m.num_layers, e)),
               "decode_workspace": per_replica.samples * vocab_slice(m, r) * 10}
    return {"peak_gib": sum(classes.values()) / GIB, "classes_gib": {k: v / GIB for k, v in classes.items()},
            "rollout_tp": r, "replicas": replicas}


def summarize(classes: list[TensorClass], mode: str) -> dict:
    """Per-phase bytes by class (GiB) and the peak phase, over the phases the classes live in (`setup`, the fullest
    point of start-up, then `mode`'s, less the reference's scoring phase in a run without the reference)."""
    by_phase = {ph: {c.name: c.bytes / GIB for c in classes if ph in c.resident and c.bytes}
                for ph in ("setup", *phases(mode)) if any(ph in c.resident for c in classes)}
    totals = {ph: sum(v.values()) for ph, v in by_phase.items()}
    peak = max(totals, key=totals.get)
    return {"peak_gib": totals[peak], "peak_phase": peak, "phase_gib": totals, "by_phase_gib": by_phase,
            "classes": {c.name: {"gib": c.bytes / GIB, "resident": list(c.resident), "action": c.action,
                                 "note": c.note} for c in classes}}


def plan_memory(cfg: RunConfig) -> dict:
    """Both plans for `cfg` (the `plan-memory` command's result)."""
    cfg.check_training()
    serial, rollplex = summarize(serial_plan(cfg), "serial"), summarize(rollplex_plan(cfg), "rollplex")
    serial["engine"] = cfg.plan.serial_engine
    par = cfg.parallel
    return {"serial_peak_gib": serial["peak_gib"], "rollplex_peak_gib": rollplex["peak_gib"],
            "budget_gib": cfg.memory.budget_gib,
            "rollplex_fits": cfg.memory.budget_gib <= 0 or rollplex["peak_gib"] <= cfg.memory.budget_gib,
            "model": cfg.model.name, "gpus": par.world_size, "tp": par.tp, "pp": par.pp, "dp": par.dp,
            "workload": {**asdict(workload_shape(cfg)),
                         "prompts_per_step": cfg.workload.rollout_batch // cfg.rollout.group_size,
                         "distributed_optimizer": cfg.plan.distributed_optimizer,
                         "sequence_parallel": cfg.plan.sequence_parallel},
            "serial": serial, "rollplex": rollplex,
            **({"disaggregated": {"training_rank": summarize(plan(cfg, "disaggregated", "keep", "embedded"),
                                                             "disaggregated"),
                                  "rollout_rank": rollout_rank_plan(cfg)}} if par.rollout_ranks else {})}
