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
Activations are what megatron-core's local layers save for backward in bf16, counted tensor by
tensor (the count is tested exactly against autograd's saved tensors), with the RMSNorm that runs
(`train.norm_kernel`, `norm_kernel`) and the RoPE that runs (`train.rope_kernel`, `rope_kernel`); phase
workspaces (the loss's
logits, torch Adam's sqrt buffer) are classes of their one phase.
"""
from __future__ import annotations

from dataclasses import asdict, replace

from rollplex_megatron.config import AUTO_SIZE, ModelConfig, RunConfig
from rollplex_megatron.memory.classes import PlanInputs, Shape, TensorClass
from rollplex_megatron.models.registry import model_spec
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


def param_counts(cfg: ModelConfig, tp: int = 1) -> dict[str, int]:
    """Parameters of the whole model by part, with the vocabulary and vision MLP padded for `tp`; the family's
    layer make-up (`ModelSpec.layers`: QKV bias, q/k norms, the vision norm and MLP) from the model seam.
    `patch_embed`: what every TP rank holds whole (the patch embedding and a learned position table)."""
    lay = model_spec(cfg).layers
    h, f, d = cfg.hidden_size, cfg.ffn_hidden_size, cfg.head_dim
    q, kvd = cfg.num_attention_heads * d, cfg.num_query_groups * d
    v = cfg.vision
    vh, vf, fold = v.hidden_size, cfg.padded_vision_ffn(tp), v.spatial_merge_size**2 * v.hidden_size
    vocab = cfg.padded_vocab_size(tp)
    layer = h * (q + 2 * kvd) + lay.qkv_bias * (q + 2 * kvd) + q * h + 3 * f * h + 2 * h + lay.qk_norm * 2 * d
    norm = lambda width: width * (2 if lay.vision_norm == "LayerNorm" else 1)  # noqa: E731 (LayerNorm's bias)
    mlp = 2 * vf * vh + 2 * vf + vf * vh + vh if lay.vision_gated_mlp else 2 * vf * vh + vf + vh
    block = 3 * vh * vh + 3 * vh + vh * vh + vh + mlp + 2 * norm(vh)
    patch = v.in_channels * v.temporal_patch_size * v.patch_size**2 * vh + lay.vision_patch_bias * vh
    fold_mlp = fold * fold + fold + fold * v.out_hidden_size + v.out_hidden_size
    # DeepStack's mergers normalise the folded width (after the fold), the main merger each patch (before it)
    mergers = norm(vh) + fold_mlp + len(v.deepstack_visual_indexes) * (norm(fold) + fold_mlp)
    return {"patch_embed": patch + v.num_position_embeddings * vh, "vision": v.depth * block + mergers,
            "embedding": vocab * h, "layer": layer, "final_norm": h,
            "output": 0 if cfg.tie_word_embeddings else vocab * h}


def params_per_gpu(cfg: ModelConfig, tp: int, pp: int) -> int:
    """Parameters on the fullest GPU: the first stage (vision, embedding) or the last (output).

    Exact at TP=1. At TP>1 the patch embedding counts whole on every rank (it is replicated); the
    norms and row-parallel biases, also replicated, count as split (under 1% of the tiny model)."""
    c = param_counts(cfg, tp)
    layers = c["layer"] * (cfg.num_layers // pp)
    first = (c["vision"] + c["embedding"] + layers) // tp + c["patch_embed"]
    if pp == 1:
        return first + (c["final_norm"] + c["output"]) // tp
    out = c["embedding"] if cfg.tie_word_embeddings else c["output"]  # tied: the last stage's own copy
    return max(first, (layers + c["final_norm"] + out) // tp)


def kv_bytes_per_token(cfg: ModelConfig, tp: int, layers: int, elem: int = 2) -> int:
    """K and V of one token over `layers` layers, on one GPU (KV heads replicate past TP)."""
    heads = max(cfg.num_query_groups // tp, 1)
    return 2 * layers * heads * cfg.head_dim * elem


def norm_kernel(cfg: RunConfig) -> str:
    """The RMSNorm a plan counts: `train.norm_kernel`, `auto` meaning the GPU run's triton (the trainer's own
    plan resolves it on its device first: `runtime_cfg`)."""
    return "torch" if cfg.train.norm_kernel == "torch" else "triton"


def rope_kernel(cfg: RunConfig) -> str:
    """The RoPE a plan counts: `train.rope_kernel`, `auto` meaning the GPU run's triton (as `norm_kernel`)."""
    return "torch" if cfg.train.rope_kernel == "torch" else "triton"


def rope_bytes(head_dim: int, rope: str) -> tuple[int, int]:
    """What RoPE saves per token: (per layer, once per forward). megatron's rotary saves the cos and sin it
    casts in every layer, for q and for k (8 D in bf16); the fused kernel (models/triton_rope.py) one cos
    and one sin table per forward that every layer's q and k share (4 D)."""
    return (8 * head_dim, 0) if rope == "torch" else (0, 4 * head_dim)


def norm_bytes(width: int, norm: str) -> int:
    """What one RMSNorm saves per row in bf16: torch's composite an fp32 input, its fp32 normalised output
    and an fp32 rsqrt (8 width + 4); the fused kernel (models/triton_norm.py) the bf16 input and the fp32
    rsqrt (2 width + 4)."""
    return (8 if norm == "torch" else 2) * width + 4


def layer_activation_bytes(cfg: ModelConfig, tp: int, sp: bool, norm: str = "torch", rope: str = "torch") -> int:
    """Bytes one decoder layer saves for backward per token in bf16 (megatron-core's local spec).

    Counted from the tensors autograd saves (tests/test_memory_plan.py checks the count exactly, and
    tests/test_memory_runtime.py against autograd): each RMSNorm's saved tensors (`norm_bytes`, twice);
    QKV and fc1 keep their bf16 inputs (2h each); a family with q/k norms (Qwen3-VL) saves theirs
    (`qk_norm_bytes`); rotary keeps cos/sin of q and k (`rope_bytes`); attention keeps
    q and k after rotary, the fused QKV buffer (v is a view of it), its output and an fp32 log-sum-exp per
    head; linear_proj's input is that output; fc1's output (2f wide), the SwiGLU halves and fc2's input
    cost 10f. Sequence parallelism splits the h-wide terms over TP."""
    h, d = cfg.hidden_size, cfg.head_dim
    q = cfg.num_attention_heads * d // tp
    kv_heads = max(cfg.num_query_groups // tp, 1)
    kv = kv_heads * d
    heads = cfg.num_attention_heads // tp
    replicated = (2 * norm_bytes(h, norm) + 4 * h) // (tp if sp else 1)
    qk_norm = qk_norm_bytes(heads, kv_heads, d, norm) if model_spec(cfg).layers.qk_norm else 0
    return (replicated + qk_norm + rope_bytes(d, rope)[0] + 2 * q + 2 * kv + 2 * (q + 2 * kv) + 4 * heads + 2 * q
            + 10 * cfg.ffn_hidden_size // tp)


def qk_norm_bytes(heads: int, kv_heads: int, head_dim: int, norm: str) -> int:
    """What the per-head q and k RMSNorms save per token (`heads`, `kv_heads` on this TP rank): torch's composite
    its fp32 input and output and rsqrt per head (`norm_bytes`); the fused kernel its bf16 input and an fp32 rsqrt,
    where k's input is a view of the QKV buffer the attention keeps anyway, and so is q's when each KV group has one
    query head (with more, megatron's reshape of the grouped q copies it: 2 D per head)."""
    if norm == "torch":
        return (heads + kv_heads) * norm_bytes(head_dim, norm)
    return (2 * head_dim * heads if heads != kv_heads else 0) + 4 * (heads + kv_heads)


def vision_norm_bytes(cfg: ModelConfig, width: int, norm: str) -> int:
    """What one vision norm saves per row: an RMSNorm's (`norm_bytes`), or a LayerNorm's bf16 input and its fp32
    mean and rstd (no kernel of ours replaces a LayerNorm)."""
    return norm_bytes(width, norm) if model_spec(cfg).layers.vision_norm == "RMSNorm" else 2 * width + 8


def block_activation_bytes(cfg: ModelConfig, tp: int, norm: str = "torch", rope: str = "torch") -> int:
    """The same for one vision block, per patch: norms and QKV/fc1 inputs replicated, the attention's q/k/v and
    output in its own layout (windowed: gathered and scattered back) and linear_proj's input (10 vh), and the MLP:
    SwiGLU's 10 f, or fc1's biased output and fc2's input (4 f) for a GELU MLP."""
    v = cfg.vision
    vh, vf = v.hidden_size, cfg.padded_vision_ffn(tp)
    d, heads = vh // v.num_heads, v.num_heads // tp
    mlp = (10 if model_spec(cfg).layers.vision_gated_mlp else 4) * vf // tp
    return 2 * vision_norm_bytes(cfg, vh, norm) + 4 * vh + rope_bytes(d, rope)[0] + (10 * vh) // tp + 4 * heads + mlp


def vision_base_bytes(cfg: ModelConfig, tp: int, norm: str = "torch") -> int:
    """Per patch outside the blocks: the patch embedding's input, a learned position table's blend (4 int64 rows
    and 4 bf16 weights), the merger (norm, MLP) and each DeepStack merger (the norm over the folded width: its
    input is a block's output, saved already, so only its statistics; the MLP as the merger's)."""
    v = cfg.vision
    vh, m2 = v.hidden_size, v.spatial_merge_size**2
    pixels = 2 * v.in_channels * v.temporal_patch_size * v.patch_size**2
    table = 4 * (8 + 2) if v.num_position_embeddings else 0
    stats = vision_norm_bytes(cfg, m2 * vh, norm) - 2 * m2 * vh  # per merge unit, less the input it shares
    deepstack = len(v.deepstack_visual_indexes) * (-(-stats // m2) + 2 * vh + 4 * vh // tp)
    return pixels + table + vision_norm_bytes(cfg, vh, norm) + 2 * vh + 4 * vh // tp + deepstack


def prefix_graph_bytes(cfg: ModelConfig, tp: int, pp: int, sp: bool, tokens: int, patches: int,
                       norm: str = "torch", rope: str = "torch") -> int:
    """What one prefix forward with a graph saves on the fullest stage (vision on the first); `norm` and
    `rope`: the RMSNorm and the RoPE that run (torch | triton)."""
    h = cfg.hidden_size
    llm = tokens * ((cfg.num_layers // pp) * layer_activation_bytes(cfg, tp, sp, norm, rope)
                    + rope_bytes(cfg.head_dim, rope)[1])
    final_norm = tokens * norm_bytes(h, norm) // (tp if sp else 1) if pp == 1 else 0
    vd = cfg.vision.hidden_size // cfg.vision.num_heads
    vis = patches * (cfg.vision.depth * block_activation_bytes(cfg, tp, norm, rope) + vision_base_bytes(cfg, tp, norm)
                     + rope_bytes(vd, rope)[1])
    return llm + final_norm + vis


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


def logits_bytes(cfg: ModelConfig, tp: int, tokens: int) -> int:
    """Loss workspace at the end of a forward: bf16 logits, their fp32 copy and the max-shifted fp32
    logits of megatron's vocab-parallel cross entropy (10 bytes per token and vocabulary entry)."""
    return tokens * (cfg.vocab_size // tp) * 10


def training_forward_bytes(cfg: ModelConfig, tp: int, pp: int, sp: bool, tokens: int, patches: int,
                           norm: str = "torch", rope: str = "torch") -> int:
    """A micro-batch's saved activations plus the loss workspace (the update's peak moment)."""
    out_in = tokens * 2 * cfg.hidden_size // (tp if sp else 1)  # the output layer's input
    return prefix_graph_bytes(cfg, tp, pp, sp, tokens, patches, norm, rope) + out_in + logits_bytes(cfg, tp, tokens)


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
    v = m.vocab_size // par.tp
    if mode != "disaggregated":
        out.append(TensorClass("decode_workspace", s.samples * v * 10,
                               *kept("one decode step's logits and sampling uniforms (the graphs' pool)")))
    inputs = PlanInputs(s, keep, prefix_kv_fp32=s.prompts * s.P * kv32, prefix_kv=s.prompts * s.P * kv_tok,
                        prefix_graph=prefix_graph_bytes(m, par.tp, par.pp, sp, s.P, s.patches, norm, rope),
                        logits=lambda tokens: logits_bytes(m, par.tp, tokens),
                        activations=lambda tokens, patches: training_forward_bytes(m, par.tp, par.pp, sp, tokens,
                                                                                   patches, norm, rope),
                        rounds=1 + cfg.train.max_resample_rounds if cfg.train.dynamic_sampling else 1,
                        pack_groups=pack_groups(cfg, s))
    out += get_mode(mode).memory_classes(inputs)
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
    return out if ref else without_reference(out, allp)


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
    return replace(cfg, plan=replace(cfg.plan, sequence_parallel=False, distributed_optimizer=False,
                                     fused_adam=not torch_adam),
                   train=replace(cfg.train, norm_kernel=norm, rope_kernel=rope))


def runtime_plan(cfg: RunConfig, s: Shape, ahead: dict | None = None) -> list[TensorClass]:
    """What the trainer's run of `cfg` holds: its mode and `memory.plan`, the embedded engine (`ahead`: the
    classes `memory.prefetch_ahead` brings back early)."""
    return plan(runtime_cfg(cfg), cfg.mode.name, cfg.memory.plan, "embedded", s, ahead)


def auto_releasable(cfg: RunConfig) -> tuple[str, ...]:
    """What `memory.plan=auto` may release, in RELEASE_ORDER: the run's releasable classes, the reference's weights
    not under mode.window_graphs (its graphs read them where they were captured)."""
    return tuple(n for n in releasable(cfg) if n != "reference_weights" or not cfg.mode.window_graphs)


def auto_release(cfg: RunConfig, s: Shape, budget_gib: float, gpus: int = 1) -> frozenset:
    """`memory.plan=auto`: the classes to release so the run's peak fits `budget_gib` (none when
    everything fits). Releases classes in RELEASE_ORDER (the reference's weights not under mode.window_graphs, whose
    graphs read them where they were captured) until the peak fits, then keeps again, from the
    last released backwards, every class whose keeping still fits: the set is minimal (keeping any one of
    its classes goes over the budget), and of the releasable classes it prefers the cheap ones. Raises,
    naming the class and each setting that would make it fit (`fit_fixes`; `gpus`: this machine's), when even all
    released do not fit."""
    rc, mode = runtime_cfg(cfg), cfg.mode.name

    def fits(chosen) -> bool:
        return summarize(plan(rc, mode, frozenset(chosen), "embedded", s), mode)["peak_gib"] <= budget_gib

    chosen: list[str] = []
    for name in (None, *auto_releasable(cfg)):
        if name is not None:
            chosen.append(name)
        if fits(chosen):
            break
    else:
        summary = summarize(plan(rc, mode, frozenset(chosen), "embedded", s), mode)
        kept = "; the reference kept for mode.window_graphs" if cfg.mode.window_graphs else ""
        check_budget(summary, budget_gib, f"{mode} (memory.plan=auto, everything releasable released{kept})",
                     runtime=True, fit=lambda: fit_fixes(cfg, s, budget_gib, gpus))
    for name in reversed(chosen[:-1]):  # e.g. rollplex: the prefix graphs alone, the optimizer states kept
        if fits([c for c in chosen if c != name]):
            chosen.remove(name)
    return frozenset(chosen)


# Auto sizes (`workload.micro_batch_tokens`, `workload.prefix_pack_tokens` at -1, `rollout.keep_decode_state` unset,
# `memory.optimizer_step=auto`): the largest of each that fits, given up in this order: the kept decode state first
# (it spares a rollout its cache allocation and graph captures, and holds the cache in every phase), then the prefix
# packs (fewer, larger prefix forwards), then the micro-batch (the update's, the step's longest phase), and last the
# resident optimizer step (streaming adds host-to-device traffic to the step; it is taken only where no size fits
# the optimizer phase without it). Without a device budget: these values.
NO_DEVICE_SIZES = {"workload.micro_batch_tokens": 0, "workload.prefix_pack_tokens": 0,
                   "rollout.keep_decode_state": False, "memory.optimizer_step": "resident"}


def with_settings(cfg: RunConfig, values: dict) -> RunConfig:
    """`cfg` with the dotted settings `values` ({"workload.prefix_pack_tokens": 0, ...}, one section deep) set."""
    by_section: dict[str, dict] = {}
    for key, value in values.items():
        section, name = key.split(".")
        by_section.setdefault(section, {})[name] = value
    return replace(cfg, **{k: replace(getattr(cfg, k), **v) for k, v in by_section.items()})


def ladder(top: int, unit: int) -> list[int]:
    """`unit` x 2^k, largest first, from the first at or above `top` (lowered to `top`) down to `unit` (>= 1)."""
    out = [max(unit, 1)]
    while out[-1] < top:
        out.append(out[-1] * 2)
    out[-1] = max(out[0], min(out[-1], top))
    return out[::-1]


def is_auto(cfg: RunConfig, key: str) -> bool:
    """Whether the size `key` (of NO_DEVICE_SIZES) is left to the planner."""
    if key == "rollout.keep_decode_state":
        return cfg.rollout.keep_decode_state is None
    if key == "memory.optimizer_step":
        return cfg.memory.optimizer_step == "auto" and cfg.memory.plan != "keep"
    return getattr(cfg.workload, key.split(".")[1]) == AUTO_SIZE


def size_candidates(cfg: RunConfig, s: Shape) -> tuple[list[dict], list[dict], list[dict], list[dict]]:
    """The values auto sizing tries, largest first, per size ([{}]: the size is set): the optimizer step resident,
    then streamed (not under a fused Adam, which the streamed step does not reproduce); micro-batches of R x 2^k
    response tokens up to every response of the largest PPO mini-batch (full-sequence modes, whose micro-batches
    carry their prompts: counts from workload.responses_per_micro_batch halving to 1, with no token budget), packs
    of P x 2^k prefix tokens (P: the longest prefix) down to two groups, then none; the decode state kept or not
    (not where this process does not decode: SGLang, the rollout ranks of mode=disaggregated)."""
    w, groups = cfg.workload, -(-s.prompts // cfg.train.ppo_mini_batches)
    steps = mbs = packs = keeps = [{}]
    if is_auto(cfg, "memory.optimizer_step"):
        ways = ("resident",) if runtime_cfg(cfg).plan.fused_adam else ("resident", "stream")
        steps = [{"memory.optimizer_step": way} for way in ways]
    if is_auto(cfg, "workload.micro_batch_tokens"):
        if get_mode(cfg.mode.name).full_sequences:
            mbs = [{"workload.micro_batch_tokens": 0, "workload.responses_per_micro_batch": n}
                   for n in ladder(w.responses_per_micro_batch, 1)]
        else:
            mbs = [{"workload.micro_batch_tokens": b} for b in ladder(groups * s.group * s.R, max(s.R, 1))]
    if is_auto(cfg, "workload.prefix_pack_tokens"):
        sizes = ladder(groups * s.P, 2 * s.P) if groups > 1 else []
        packs = [{"workload.prefix_pack_tokens": t} for t in (*sizes, 0)]
    if is_auto(cfg, "rollout.keep_decode_state"):
        here = cfg.rollout.engine == "embedded" and not cfg.parallel.rollout_ranks
        keeps = [{"rollout.keep_decode_state": k} for k in ((True, False) if here else (False,))]
    return steps, mbs, packs, keeps


def sized_summary(rc: RunConfig, s: Shape) -> dict:
    """The plan of the runtime config `rc` (`runtime_cfg`) at `s` with the micro-batch of its own workload, under
    memory.plan (auto: everything `auto_release` may release released, its last resort)."""
    mode, res = rc.mode.name, rc.memory.plan
    residency = frozenset(auto_releasable(rc)) if res == "auto" else res
    return summarize(plan(rc, mode, residency, "embedded", replace(s, mb=micro_batch_responses(rc, s.R))), mode)


def fits_budget(rc: RunConfig, s: Shape, budget_gib: float) -> bool:
    """Whether `sized_summary`'s peak is within `budget_gib`."""
    return sized_summary(rc, s)["peak_gib"] <= budget_gib


def admissible(cfg: RunConfig) -> bool:
    """Whether the config accepts the candidate (e.g. no prefix packs with dynamic sampling in rollplex)."""
    try:
        cfg.check_training()
    except ValueError:
        return False
    return True


def auto_size(cfg: RunConfig, s: Shape | None, budget_gib: float | None, gpus: int = 1) -> tuple[RunConfig, dict]:
    """`cfg` with its auto sizes resolved, and what was chosen ({setting: value, "budget_gib": ...}; {} when no size
    is auto). Without a budget (no device) NO_DEVICE_SIZES; with one, the first of `size_candidates` (the optimizer
    step outermost, the kept decode state innermost: the order they are given up in) whose run fits under memory.plan
    (`fits_budget`). Raises, naming each setting that would make the run fit, when even the smallest does not."""
    if not cfg.auto_sized:
        return cfg, {}
    if budget_gib is None:
        chosen = {k: v for k, v in NO_DEVICE_SIZES.items() if is_auto(cfg, k)}
        return with_settings(cfg, chosen), {**chosen, "budget_gib": None}
    rc = runtime_cfg(cfg)
    steps, mbs, packs, keeps = size_candidates(cfg, s)
    for chosen in ({**step, **mb, **pack, **keep} for step in steps for mb in mbs for pack in packs for keep in keeps):
        c = with_settings(cfg, chosen)
        if admissible(c) and fits_budget(with_settings(rc, chosen), s, budget_gib):
            return c, {**chosen, "budget_gib": budget_gib}
    least = {**steps[-1], **mbs[-1], **packs[-1], **keeps[-1]}
    check_budget(sized_summary(with_settings(rc, least), s), budget_gib, f"{cfg.mode.name} at its smallest auto "
                 f"sizes ({settings_text(least)}; memory.plan={cfg.memory.plan})", runtime=True,
                 fit=lambda: fit_fixes(with_settings(cfg, least), s, budget_gib, gpus))
    raise RuntimeError(f"auto_size: no candidate fits {budget_gib:g} GiB, yet the smallest's plan does")


def auto_size_text(chosen: dict, released: list | None = None) -> str:
    """The start-up line of what `auto_size` chose (and, under memory.plan=auto, what it releases)."""
    budget = chosen["budget_gib"]
    why = "no device: the fixed values" if budget is None else f"the largest that fit {gib_text(budget)} GiB"
    rel = "" if released is None else f"; memory.plan=auto releases {', '.join(released) or 'nothing'}"
    return f"auto: {settings_text({k: v for k, v in chosen.items() if k != 'budget_gib'})} ({why}{rel})"


def settings_text(values: dict) -> str:
    """Dotted settings as overrides are written (`rollout.keep_decode_state=false workload.prefix_pack_tokens=0`)."""
    return " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in values.items())


def smaller_settings(cfg: RunConfig, s: Shape) -> list[list[dict]]:
    """Per setting of `cfg` that shrinks the plan, its smaller values, largest first: the kept decode state off, a
    smaller prefix pack, a smaller micro-batch (token budget or count; full-sequence modes: counts), memory.plan=auto
    for keep (its bytes with everything released are phase's), else the streamed optimizer step for a resident one,
    no window graphs."""
    w, out = cfg.workload, []
    if cfg.rollout.keep_decode_state:
        out.append([{"rollout.keep_decode_state": False}])
    if w.prefix_pack_tokens > 0:
        out.append([{"workload.prefix_pack_tokens": t} for t in (*ladder(w.prefix_pack_tokens // 2, 2 * s.P), 0)
                    if t < w.prefix_pack_tokens])
    if get_mode(cfg.mode.name).full_sequences or w.micro_batch_tokens <= 0:
        now = full_sequence_responses(cfg, s) if get_mode(cfg.mode.name).full_sequences else w.responses_per_micro_batch
        out.append([{"workload.micro_batch_tokens": 0, "workload.responses_per_micro_batch": n}
                    for n in ladder(max(now // 2, 1), 1) if n < now])
    else:
        out.append([{"workload.micro_batch_tokens": b} for b in ladder(w.micro_batch_tokens // 2, max(s.R, 1))
                    if b < w.micro_batch_tokens])
    if cfg.memory.plan == "keep":
        out.append([{"memory.plan": "auto"}])
    elif cfg.memory.optimizer_step == "resident" and not runtime_cfg(cfg).plan.fused_adam:
        out.append([{"memory.optimizer_step": "stream"}])
    if cfg.mode.window_graphs:
        out.append([{"mode.window_graphs": False}])
    return [o for o in out if o]


def fit_fixes(cfg: RunConfig, s: Shape, budget_gib: float, gpus: int = 1) -> str:
    """What makes the run of `cfg` fit `budget_gib`: each setting that alone does (at its largest value that does),
    else all of them together at their smallest; a larger parallel layout where this machine has more GPUs, and as
    the last resort where nothing else does."""
    rc, options = runtime_cfg(cfg), smaller_settings(cfg, s)
    fits = lambda values: fits_budget(with_settings(rc, values), s, budget_gib)  # noqa: E731
    alone = [next((v for v in values if fits(v)), None) for values in options]
    out = [settings_text(v) for v in alone if v is not None]
    least = {k: v for values in options for k, v in values[-1].items()}
    if not out and options and fits(least):
        out.append(f"together {settings_text(least)}")
    if gpus > 1:
        out.append(f"a larger parallel.tp/pp ({gpus} GPUs here)")
    elif not out:
        out.append("more GPUs (a larger parallel.tp/pp) or a smaller model")
    return ", or ".join(out)


AHEAD_CLASSES = ("optimizer_states", "main_weights", "reference_weights")  # offloaded: their prefetch is a copy


def phase_before(name: str, mode: str) -> str:
    """The phase just before the first of `name`'s own phases in `mode`'s step (the step repeats: the optimizer
    step comes before the next rollout)."""
    allp, own = phases(mode), resident_phases(name, mode)
    first = min(allp.index(p) for p in own if p in allp)
    return allp[first - 1]


def ahead_phases(cfg: RunConfig, mode: str, residency, s: Shape, budget_gib: float) -> dict:
    """`memory.prefetch_ahead`: the released offload classes that come back one phase early, {class: phase}. A
    class comes back at the entry of `phase_before` its own phases (Adam states and master weights during the
    update, a reference the rollout reads during the optimizer step) when that phase's planned bytes with it
    stay within `budget_gib`; the classes are tried in RELEASE_ORDER, each on top of those already taken. Its
    copy then runs beside that phase's work, and its own phase waits only for what is left of the copy."""
    rel = released(residency)
    chosen: dict = {}
    for name in (n for n in releasable(cfg) if n in AHEAD_CLASSES and n in rel - streamed(cfg, rel)):
        trial = {**chosen, name: phase_before(name, mode)}
        summary = summarize(plan(cfg, mode, residency, "embedded", s, trial), mode)
        if summary["phase_gib"][trial[name]] <= budget_gib:
            chosen = trial
    return chosen


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
               "decode_workspace": per_replica.samples * (m.vocab_size // r) * 10}
    return {"peak_gib": sum(classes.values()) / GIB, "classes_gib": {k: v / GIB for k, v in classes.items()},
            "rollout_tp": r, "replicas": replicas}


def summarize(classes: list[TensorClass], mode: str) -> dict:
    """Per-phase bytes by class (GiB) and the peak phase, over the phases the classes live in (`mode`'s, less
    the reference's scoring phase in a run without the reference)."""
    by_phase = {ph: {c.name: c.bytes / GIB for c in classes if ph in c.resident and c.bytes}
                for ph in phases(mode) if any(ph in c.resident for c in classes)}
    totals = {ph: sum(v.values()) for ph, v in by_phase.items()}
    peak = max(totals, key=totals.get)
    return {"peak_gib": totals[peak], "peak_phase": peak, "phase_gib": totals, "by_phase_gib": by_phase,
            "classes": {c.name: {"gib": c.bytes / GIB, "resident": list(c.resident), "action": c.action,
                                 "note": c.note} for c in classes}}


FIXES = {  # what shrinks each class, in the config's terms
    "optimizer_states": "plan.distributed_optimizer=true (shard over DP) or a larger parallel.tp/pp",
    "main_weights": "plan.distributed_optimizer=true (shard over DP) or a larger parallel.tp/pp",
    "optimizer_workspace": "a fused Adam (plan.fused_adam=true where transformer-engine or apex is installed) or "
                           "a larger parallel.tp/pp",
    "grads": "a larger parallel.tp/pp",
    "reference_weights": "a larger parallel.tp/pp",
    "rollout_kv": "a smaller memory.kv_cache_gib (more waves), fewer prompts per DP rank or a larger parallel.tp",
    "actor_prefix_graph": "fewer prompts per DP rank",
    "reference_prefix_graphs": "a smaller mode.window_graph_buckets or workload.prefix_pack_tokens, or "
                               "mode.window_graphs=false",
    "actor_prefix_kv": "fewer prompts per DP rank or shorter prompts",
    "update_activations": "fewer workload.responses_per_micro_batch (or a smaller workload.micro_batch_tokens "
                          "when set), a smaller workload.prefix_pack_tokens (a recomputed pack's graph), "
                          "plan.sequence_parallel=true or a larger parallel.tp",
}
RUNTIME_FIXES = {  # the trainer honours no plan.* setting: only what its own config changes
    "optimizer_states": "memory.optimizer_step=stream (streamed from host memory through the step) or a larger "
                        "parallel.tp/pp",
    "main_weights": "memory.optimizer_step=stream (streamed from host memory through the step) or a larger "
                    "parallel.tp/pp",
    "optimizer_workspace": "memory.optimizer_step=stream (one bucket's workspace) or a larger parallel.tp/pp (or "
                           "transformer-engine/apex installed: a fused Adam)",
    "update_activations": "fewer workload.responses_per_micro_batch (or a smaller workload.micro_batch_tokens "
                          "when set), a smaller workload.prefix_pack_tokens (a recomputed pack's graph) or a "
                          "larger parallel.tp",
}
RELEASED_BY_PHASE_PLAN = {"main_weights", "optimizer_states", "grads", "reference_weights", "actor_prefix_graph"}


def gib_text(x: float) -> str:
    """A GiB figure for a message: one decimal, or three significant digits below 1 GiB (never a bare 0.0)."""
    return f"{x:.1f}" if x >= 1 else f"{x:.3g}"


def check_budget(summary: dict, budget_gib: float, mode: str, runtime: bool = False, fit=None) -> None:
    """Fail, naming the largest class of the peak phase and what would free it, when over budget.

    `runtime`: the trainer's check (its fixes name only settings the trainer honours); `fit`: a callable giving
    the settings that would make the run fit (`fit_fixes`), asked only when over, in place of the class's fix."""
    if budget_gib <= 0 or summary["peak_gib"] <= budget_gib:
        return
    phase = summary["peak_phase"]
    top = max(summary["by_phase_gib"][phase].items(), key=lambda kv: kv[1])
    fixes = {**FIXES, **RUNTIME_FIXES} if runtime else FIXES
    fix = fixes.get(top[0], "a larger parallel.tp/pp or a smaller workload")
    if top[0] in RELEASED_BY_PHASE_PLAN and summary["classes"][top[0]]["action"] == "keep":
        fix = f"memory.plan=phase (releases it outside its phases), or {fix}"
    fix = (fit() if fit is not None else "") or fix
    raise ValueError(f"{mode} plan needs {gib_text(summary['peak_gib'])} GiB in phase {phase!r}, over "
                     f"memory.budget_gib={budget_gib:g}; the largest class there is {top[0]} ({gib_text(top[1])} "
                     f"GiB); to fit: {fix}")


# Classes the batch does not size: over the machine, the model or its layout is the fix, not the batch.
MODEL_CLASSES = ("actor_weights", "main_weights", "grads", "optimizer_states", "reference_weights",
                 "optimizer_workspace", "rollout_weights")


def machine_need_gib(summary: dict, cuda: bool) -> float:
    """What the plan holds at its peak on the memory that backs the device: the peak phase; on CPU, where that is
    host memory, also the host copies of the classes it offloads (memory/manager.py keeps them all run)."""
    if cuda:
        return summary["peak_gib"]
    return summary["peak_gib"] + sum(c["gib"] for c in summary["classes"].values() if c["action"] == "offload")


def check_machine(summary: dict, need_gib: float, free_gib: float, what: str, batch: str) -> None:
    """Fail when the plan cannot fit the memory this rank has (`free_gib` of `what`), naming the largest class of
    the peak phase and, when the batch sizes it, the batch's settings (`batch`: the shape and what lowers it)."""
    if need_gib <= free_gib:
        return
    phase = summary["peak_phase"]
    top, gib = max(summary["by_phase_gib"][phase].items(), key=lambda kv: kv[1])
    if top in MODEL_CLASSES:
        fix = f"to fit: {RUNTIME_FIXES.get(top, FIXES.get(top, 'a larger parallel.tp/pp'))}, or a smaller model"
    else:  # the update's micro-batches have a setting of their own
        fix = batch + (f"; or {RUNTIME_FIXES[top]}" if top in RUNTIME_FIXES else "")
    raise ValueError(f"this run needs {gib_text(need_gib)} GiB per rank ({need_gib * GIB:.3g} bytes; peak phase "
                     f"{phase!r}, largest class {top} {gib_text(gib)} GiB), over the {gib_text(free_gib)} GiB of "
                     f"{what}; {fix}")


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
