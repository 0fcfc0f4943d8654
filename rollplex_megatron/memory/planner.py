"""Analytic HBM per GPU and phase, for serial colocation and for the Rollplex plan (DESIGN section 1).

Each tensor class has a size (bytes on one GPU) and the phases of one step in which it is resident.
A phase's bytes are the sum of its resident classes; the plan's peak is the largest phase.
- serial: naive colocation, the paper's baseline. Everything the step allocates stays resident for
  the whole step: actor, fp32 main weights, gradients, Adam states, reference, a separate
  rollout-engine weight copy, the rollout KV pool (one prompt + response per sample), and the
  full-sequence activations of one update micro-batch.
- rollplex: residency follows producer-consumer lifetimes. The rollout runs on the actor's weights
  (no copy). Main weights and Adam states are offloaded from the rollout to the optimizer step.
  Gradients exist from the update on. The reference is offloaded after its last use. The prefix
  K/V is held once per group. The actor prefix keeps only layer inputs; one group's layers are
  recomputed at a time in the prefix backward.
Activations are bf16 with flash-style attention (no score matrix), counted per token and layer
from the tensors a layer saves for backward. Sequence parallelism divides them by TP. Logits are
fp32 for the loss, plus their gradient.
"""
from __future__ import annotations

from dataclasses import dataclass

from rollplex_megatron.config import ModelConfig, RunConfig

GIB = 2**30
PHASES = {"serial": ("rollout", "old_logp", "ref_logp", "update", "optimizer"),
          "rollplex": ("rollout", "ref_logp", "update", "optimizer")}


@dataclass(frozen=True)
class TensorClass:
    """One class of tensors: bytes on one GPU, where it lives per phase, and why."""

    name: str
    bytes: int
    resident: tuple[str, ...]  # phases in which it occupies HBM
    action: str  # keep | offload | free | recompute (what the plan does outside `resident`)
    note: str = ""


def param_counts(cfg: ModelConfig, tp: int = 1) -> dict[str, int]:
    """Parameters of the whole model by part, with the vocabulary and vision MLP padded for `tp`."""
    h, f, kvd = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_query_groups * cfg.head_dim
    v = cfg.vision
    vh, vf, m2 = v.hidden_size, cfg.padded_vision_ffn(tp), v.spatial_merge_size**2
    vocab = cfg.padded_vocab_size(tp)
    layer = h * (h + 2 * kvd) + (h + 2 * kvd) + h * h + 3 * f * h + 2 * h
    block = 3 * vh * vh + 3 * vh + vh * vh + vh + 2 * vf * vh + 2 * vf + vf * vh + vh + 2 * vh
    patch = v.in_channels * v.temporal_patch_size * v.patch_size**2 * vh
    merger = vh + (m2 * vh) ** 2 + m2 * vh + m2 * vh * v.out_hidden_size + v.out_hidden_size
    return {"patch_embed": patch, "vision": v.depth * block + merger, "embedding": vocab * h, "layer": layer,
            "final_norm": h, "output": 0 if cfg.tie_word_embeddings else vocab * h}


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


def layer_activation_bytes(cfg: ModelConfig, tp: int, sp: bool) -> int:
    """bf16 bytes one decoder layer saves for backward per token: norms' inputs, QKV, attention
    output, MLP input, gate/up and SwiGLU output."""
    h, f, kvd = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_query_groups * cfg.head_dim
    replicated = 4 * h // (tp if sp else 1)
    return 2 * (replicated + (h + 2 * kvd) // tp + h // tp + 3 * f // tp)


def block_activation_bytes(cfg: ModelConfig, tp: int, sp: bool) -> int:
    """The same for one vision block, per patch."""
    v = cfg.vision
    return 2 * (4 * v.hidden_size // (tp if sp else 1) + 3 * v.hidden_size // tp + v.hidden_size // tp
                + 3 * v.ffn_hidden_size // tp)


def _shape(cfg: RunConfig) -> dict[str, int]:
    p = cfg.plan
    prompts = cfg.prompts_per_rank
    return {"prompts": prompts, "samples": prompts * cfg.rollout.group_size, "P": p.prefix_tokens,
            "R": p.response_tokens, "patches": p.vision_patches, "mb": cfg.workload.responses_per_micro_batch}


def _activations(cfg: RunConfig, tokens: int, patches: int) -> int:
    m, tp, pp, sp = cfg.model, cfg.parallel.tp, cfg.parallel.pp, cfg.plan.sequence_parallel
    llm = tokens * (m.num_layers // pp) * layer_activation_bytes(m, tp, sp)
    vis = patches * m.vision.depth * block_activation_bytes(m, tp, sp)
    logits = tokens * (m.vocab_size // tp) * 8  # fp32 logits and their gradient
    return llm + vis + logits


def _weights(cfg: RunConfig) -> dict[str, int]:
    m, par = cfg.model, cfg.parallel
    n = params_per_gpu(m, par.tp, par.pp)
    shard = par.dp if cfg.plan.distributed_optimizer else 1
    rtp = cfg.plan.rollout_tp or par.tp
    return {"actor_weights": 2 * n, "main_weights": 4 * n // shard, "grads": 4 * n,
            "optimizer_states": 8 * n // shard, "reference_weights": 2 * n,
            "rollout_weights": 2 * params_per_gpu(m, rtp, 1)}


def serial_plan(cfg: RunConfig) -> list[TensorClass]:
    """Naive colocation: every class resident in every phase."""
    s, w, m, par = _shape(cfg), _weights(cfg), cfg.model, cfg.parallel
    rtp = cfg.plan.rollout_tp or par.tp
    allp = PHASES["serial"]
    mb_tokens = s["mb"] * (s["P"] + s["R"])
    out = [TensorClass(k, v, allp, "keep") for k, v in w.items()]
    out.append(TensorClass("rollout_kv", s["samples"] * (s["P"] + s["R"]) * kv_bytes_per_token(m, rtp, m.num_layers), allp,
                           "keep", "every sample holds its prompt and response K/V"))
    out.append(TensorClass("full_activations", _activations(cfg, mb_tokens, s["mb"] * s["patches"]), allp, "keep",
                           "one update micro-batch: whole sequences, vision tower included"))
    return out


def rollplex_plan(cfg: RunConfig) -> list[TensorClass]:
    """The phase-aware plan (module docstring)."""
    s, w, m, par = _shape(cfg), _weights(cfg), cfg.model, cfg.parallel
    kv = kv_bytes_per_token(m, par.tp, m.num_layers // par.pp)
    sp = cfg.plan.sequence_parallel
    inputs = (s["P"] * (m.num_layers // par.pp) * 2 * m.hidden_size
              + s["patches"] * m.vision.depth * 2 * m.vision.hidden_size) // (par.tp if sp else 1)
    return [
        TensorClass("actor_weights", w["actor_weights"], PHASES["rollplex"], "keep", "rollout decodes on them in place"),
        TensorClass("main_weights", w["main_weights"], ("optimizer",), "offload", "pinned host memory until the step"),
        TensorClass("optimizer_states", w["optimizer_states"], ("optimizer",), "offload", "as main_weights"),
        TensorClass("grads", w["grads"], ("update", "optimizer"), "free", "allocated when the update starts"),
        TensorClass("reference_weights", w["reference_weights"], ("rollout", "ref_logp"), "offload",
                    "used by the window's reference prefixes and the reference response stage"),
        TensorClass("rollout_kv", s["samples"] * s["R"] * kv, ("rollout",), "free",
                    "response K/V only; decode reads the group's prefix K/V"),
        TensorClass("actor_prefix_kv", s["prompts"] * s["P"] * kv * 2, ("rollout", "ref_logp", "update"), "free",
                    "fp32 leaves, one per group (the decode reads them)"),
        TensorClass("prefix_kv_grads", s["prompts"] * s["P"] * kv * 2, ("update",), "free", "fp32 gK/gV"),
        TensorClass("reference_prefix_kv", s["prompts"] * s["P"] * kv, ("rollout", "ref_logp"), "free"),
        TensorClass("prefix_layer_inputs", s["prompts"] * inputs, ("rollout", "ref_logp", "update"), "recompute",
                    "the actor prefix graph keeps layer inputs only"),
        TensorClass("prefix_recompute", _activations(cfg, s["P"], s["patches"]) - s["P"] * (m.vocab_size // par.tp) * 8,
                    ("update",), "free", "one group's prefix layers, recomputed at its prefix backward"),
        TensorClass("response_activations", _activations(cfg, s["mb"] * s["R"], 0), ("update",), "free",
                    "one response micro-batch"),
    ]


def summarize(plan: list[TensorClass], mode: str) -> dict:
    """Per-phase bytes by class (GiB) and the peak phase."""
    by_phase = {ph: {c.name: c.bytes / GIB for c in plan if ph in c.resident} for ph in PHASES[mode]}
    totals = {ph: sum(v.values()) for ph, v in by_phase.items()}
    peak = max(totals, key=totals.get)
    return {"peak_gib": totals[peak], "peak_phase": peak, "phase_gib": totals, "by_phase_gib": by_phase,
            "classes": {c.name: {"gib": c.bytes / GIB, "resident": list(c.resident), "action": c.action,
                                 "note": c.note} for c in plan}}


FIXES = {  # what shrinks each class, in the config's terms
    "optimizer_states": "plan.distributed_optimizer=true (shard over DP) or a larger parallel.tp/pp",
    "main_weights": "plan.distributed_optimizer=true (shard over DP) or a larger parallel.tp/pp",
    "grads": "a larger parallel.tp/pp",
    "rollout_kv": "fewer prompts per DP rank (workload.rollout_batch, parallel.dp) or a larger parallel.tp",
    "prefix_layer_inputs": "plan.sequence_parallel=true, a larger parallel.tp, or fewer prompts per DP rank",
    "actor_prefix_kv": "fewer prompts per DP rank or shorter prompts (plan.prefix_tokens)",
    "full_activations": "fewer workload.responses_per_micro_batch or plan.sequence_parallel=true",
    "response_activations": "fewer workload.responses_per_micro_batch",
}


def check_budget(summary: dict, budget_gib: float, mode: str) -> None:
    """Fail, naming the largest class of the peak phase and what would free it, when over budget."""
    if budget_gib <= 0 or summary["peak_gib"] <= budget_gib:
        return
    phase = summary["peak_phase"]
    top = max(summary["by_phase_gib"][phase].items(), key=lambda kv: kv[1])
    fix = FIXES.get(top[0], "a larger parallel.tp/pp or a smaller workload")
    raise ValueError(f"{mode} plan needs {summary['peak_gib']:.1f} GiB in phase {phase!r}, over memory.budget_gib="
                     f"{budget_gib:g}; the largest class there is {top[0]} ({top[1]:.1f} GiB); to fit: {fix}")


def plan_memory(cfg: RunConfig) -> dict:
    """Both plans for `cfg` (the `plan-memory` command's result)."""
    cfg.check_training()
    serial, rollplex = summarize(serial_plan(cfg), "serial"), summarize(rollplex_plan(cfg), "rollplex")
    par = cfg.parallel
    return {"serial_peak_gib": serial["peak_gib"], "rollplex_peak_gib": rollplex["peak_gib"],
            "budget_gib": cfg.memory.budget_gib,
            "rollplex_fits": cfg.memory.budget_gib <= 0 or rollplex["peak_gib"] <= cfg.memory.budget_gib,
            "model": cfg.model.name, "gpus": par.world_size, "tp": par.tp, "pp": par.pp, "dp": par.dp,
            "workload": {**_shape(cfg), "group_size": cfg.rollout.group_size,
                         "prompts_per_step": cfg.workload.rollout_batch // cfg.rollout.group_size,
                         "distributed_optimizer": cfg.plan.distributed_optimizer,
                         "sequence_parallel": cfg.plan.sequence_parallel},
            "serial": serial, "rollplex": rollplex}
