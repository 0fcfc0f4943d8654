"""GRPO as pure tensor functions (legend: N prompts, G samples per prompt, T response tokens).

The trainer's loss (`GRPOLoss`) combines them per token on the last pipeline stage; every function
here takes tensors and returns tensors, so it tests on the CPU.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

from rollplex_megatron.runtime import kernel_for


def policy_logits(logits_BTV: torch.Tensor, temperature: float = 1.0, banned: tuple[int, ...] = (),
                  tp_rank: int = 0) -> torch.Tensor:
    """The sampled policy's logits from this TP rank's vocabulary shard: fp32, divided by the sampling
    temperature, with the tokens the sampler never emits (`banned`: the vision placeholders) at the
    fp32 minimum, so the loss and the scoring phases see the distribution the rollout drew from."""
    lowest = torch.finfo(torch.float32).min
    x = (logits_BTV.float() / temperature).clamp_min(lowest)  # padding / T: the minimum, not -inf
    local = x.shape[-1]
    for t in banned:  # integer columns: no index tensor copied to the device per micro-batch
        if 0 <= t - tp_rank * local < local:
            x[..., t - tp_rank * local] = lowest  # x is this function's own tensor (clamp_min's output)
    return x


def group_advantages(rewards_NG: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-normalised advantages: reward minus the group mean, divided by the group std (unbiased=False).

    A group whose rewards are all equal gets zero advantages (no signal), never NaN.
    """
    if rewards_NG.dim() != 2:
        raise ValueError(f"rewards must be [prompts, group_size], got shape {tuple(rewards_NG.shape)}")
    centred = rewards_NG - rewards_NG.mean(dim=1, keepdim=True)
    if not normalize_std:
        return centred
    return centred / (rewards_NG.std(dim=1, unbiased=False, keepdim=True) + eps)


def clipped_ratio_loss(logp_T: torch.Tensor, old_logp_T: torch.Tensor, adv_T: torch.Tensor,
                       clip_low: float = 0.2, clip_high: float = 0.2, clip_ratio_c: float = 0.0) -> torch.Tensor:
    """Per-token PPO/GRPO surrogate: -min(r A, clip(r, 1-low, 1+high) A), r = exp(logp - old_logp); with
    dual clip (`clip_ratio_c` > 1) a negative-advantage token's loss is at most -clip_ratio_c * A."""
    ratio = torch.exp(logp_T - old_logp_T)
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = -torch.minimum(ratio * adv_T, clipped * adv_T)
    if clip_ratio_c:
        loss = torch.where(adv_T < 0, torch.minimum(loss, -clip_ratio_c * adv_T), loss)
    return loss


def kl_k3(logp_T: torch.Tensor, ref_logp_T: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy || reference): exp(d) - d - 1 with d = ref_logp - logp (>= 0)."""
    d = ref_logp_T - logp_T
    return torch.exp(d) - d - 1.0


def kl_low_var(logp_T: torch.Tensor, ref_logp_T: torch.Tensor) -> torch.Tensor:
    """k3 clamped as verl's `low_var_kl` clamps it: the log-ratio to [-20, 20], the estimate to [-10, 10]
    (one token the policy has made very unlikely under the reference cannot dominate the mean)."""
    d = (ref_logp_T - logp_T).clamp(-20.0, 20.0)
    return (torch.exp(d) - d - 1.0).clamp(-10.0, 10.0)


KL_ESTIMATORS = {
    "k1": lambda logp, ref: logp - ref,  # unbiased, high variance, can be negative per token
    "k2": lambda logp, ref: 0.5 * (logp - ref) ** 2,
    "k3": kl_k3,
    "low_var_kl": kl_low_var,
}


def check_kl_estimator(name: str) -> None:
    """`train.kl_estimator` names one of `KL_ESTIMATORS`."""
    if name not in KL_ESTIMATORS:
        raise ValueError(f"train.kl_estimator must be one of {tuple(KL_ESTIMATORS)}, got {name!r}")


def kl_estimate(logp_T: torch.Tensor, ref_logp_T: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) with one of `KL_ESTIMATORS`."""
    check_kl_estimator(estimator)
    return KL_ESTIMATORS[estimator](logp_T, ref_logp_T)


def loss_weights(lengths: list[int], mode: str, responses: int, total_tokens: int, max_len: int) -> list[float]:
    """Per-token loss weight of each response under verl's `loss_agg_mode` (`responses` and
    `total_tokens` are global counts, over every micro-batch and data-parallel rank):
    token-mean 1/T; seq-mean-token-sum 1/S; seq-mean-token-mean 1/(S n_i); seq-mean-token-sum-norm
    1/(S L_max) (Dr. GRPO's constant normaliser, L_max = the longest response the run generates)."""
    if mode == "token-mean":
        return [1.0 / total_tokens] * len(lengths)
    if mode == "seq-mean-token-sum":
        return [1.0 / responses] * len(lengths)
    if mode == "seq-mean-token-mean":
        return [1.0 / (responses * n) for n in lengths]
    if mode == "seq-mean-token-sum-norm":
        return [1.0 / (responses * max_len)] * len(lengths)
    raise ValueError(f"train.loss_agg_mode: unknown mode {mode!r}")


def token_mean(values_T: torch.Tensor, mask_T: torch.Tensor, total_tokens: float | None = None) -> torch.Tensor:
    """Token-mean aggregation over masked tokens; `total_tokens` is the global count (across micro-batches and DP)."""
    denom = float(mask_T.sum()) if total_tokens is None else float(total_tokens)
    return (values_T * mask_T).sum() / max(denom, 1.0)


def grpo_token_loss(logp_T, old_logp_T, ref_logp_T, adv_T, kl_coef: float, clip_low: float = 0.2,
                    clip_high: float = 0.2, kl_estimator: str = "k3", clip_ratio_c: float = 0.0) -> torch.Tensor:
    """Per-token GRPO loss: clipped surrogate plus `kl_coef` times the estimated KL to the reference."""
    loss = clipped_ratio_loss(logp_T, old_logp_T, adv_T, clip_low, clip_high, clip_ratio_c)
    if kl_coef:
        loss = loss + kl_coef * kl_estimate(logp_T, ref_logp_T, kl_estimator)
    return loss


def vocab_parallel_entropy(logits_local: torch.Tensor, group=None) -> torch.Tensor:
    """Entropy of softmax(logits) when the vocabulary is split over a TP group (no full gather).

    H = log Z + m - sum(e^(l - m) l) / Z with m the global max and Z the global sum of e^(l - m).
    Masked (dtype-minimum) padding columns contribute nothing. Differentiable when the logits
    require grad: the sums are reduced with megatron's reduce-from-TP-region (forward all-reduce,
    backward identity: each TP rank's loss copy is the same), and m is a constant shift.
    """
    x = logits_local.float()
    m = x.detach().max(dim=-1, keepdim=True).values
    split = group is not None and dist.get_world_size(group) > 1
    if split:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(x - m)
    z = e.sum(dim=-1, keepdim=True)
    ex = (e * torch.where(e > 0, x, torch.zeros_like(x))).sum(dim=-1, keepdim=True)
    if split and torch.is_grad_enabled() and x.requires_grad:
        z = reduce_from_tensor_model_parallel_region(z, group)
        ex = reduce_from_tensor_model_parallel_region(ex, group)
    elif split:
        dist.all_reduce(z, group=group)
        dist.all_reduce(ex, group=group)
    return (torch.log(z) + m - ex / z).squeeze(-1)


def logprob_kernel_for(kernel: str, device) -> str:
    """`train.logprob_kernel` resolved on `device`: `auto` is the fused kernel on CUDA (GPU-tested, and 6.0-6.9x
    faster than the torch path with a twelfth of its memory at 4k-16k rows: benchmarks/results/
    logprob_kernel_h200.json) and the torch path elsewhere (`runtime.kernel_for`)."""
    return kernel_for("train.logprob_kernel", kernel, device)


def rows_at(t: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """The rows of `t` ([B, T, ...]) at the positions `where`, in order: a bool mask [B, T] (`t[where]`,
    which on CUDA waits for the device to count them) or flat indices into B*T (a gather, no wait)."""
    if where.dtype == torch.bool:
        return t[where]
    return t.reshape(-1, *t.shape[2:]).index_select(0, where)


def policy_logprob_entropy(logits_BTV: torch.Tensor, labels_BT: torch.Tensor, temperature: float = 1.0,
                           banned: tuple[int, ...] = (), tp_rank: int = 0, tp_group=None,
                           entropy_mask: torch.Tensor | None = None, entropy_grad: bool = False,
                           kernel: str = "torch") -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the labels [B, T] and the entropy of the tokens `entropy_mask` selects (a bool mask or flat
    indices, as `rows_at` takes them; None: no entropy) under the sampled policy (`policy_logits`).
    `kernel`: "torch" (policy_logits, megatron's vocab_parallel_cross_entropy, `vocab_parallel_entropy`;
    the entropy differentiable only with `entropy_grad`) or "triton" (`triton_logprob.fused_logprob_entropy`:
    one read of the logits)."""
    if kernel == "triton":
        from rollplex_megatron.rl.triton_logprob import fused_logprob_entropy

        logp, ent = fused_logprob_entropy(logits_BTV, labels_BT, temperature, banned, tp_rank, tp_group)
        if entropy_mask is None:
            return logp, None
        return logp, rows_at(ent if entropy_grad else ent.detach(), entropy_mask)
    logits = policy_logits(logits_BTV, temperature, banned, tp_rank)
    entropy = None
    if entropy_mask is not None:  # before the cross-entropy, which overwrites its input in place
        with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
            entropy = vocab_parallel_entropy(rows_at(logits, entropy_mask), tp_group)  # a copy
    return -tensor_parallel.vocab_parallel_cross_entropy(logits, labels_BT), entropy


class GRPOLoss:
    """Megatron loss function of one packed micro-batch (per-token-loss contract).

    Reads `mb.token_data`: "adv" (always), "ref_logp" (when kl_coef > 0), "old_logp" (absent on
    the single on-policy update that takes old log-probs from its own forward: then old = detached
    current log-probs, ratio 1) and "loss_w" (per-token weights of `loss_weights`; absent: token-mean,
    pre-normalised by the global response-token count). The logged kl, entropy and clip fraction are
    token means whatever the aggregation.
    Log-probs and entropy are those of the policy the rollout sampled from (`policy_logits`: the
    temperature and the banned vision placeholders; the scoring phases use the same). "kl" is the
    mean of `kl_estimator` (what the loss adds), "kl_k1" the plain mean log-ratio beside it.
    `kernel` computes them (`policy_logprob_entropy`: "torch" or "triton").
    """

    def __init__(self, kl_coef: float, clip_low: float, clip_high: float, total_tokens: int, tp_group=None,
                 entropy_coef: float = 0.0, temperature: float = 1.0, kl_estimator: str = "low_var_kl",
                 banned: tuple[int, ...] = (), clip_ratio_c: float = 0.0, kernel: str = "torch"):
        check_kl_estimator(kl_estimator)
        self.kernel = kernel
        self.kl_coef, self.clip_low, self.clip_high = kl_coef, clip_low, clip_high
        self.total_tokens, self.tp_group, self.entropy_coef = total_tokens, tp_group, entropy_coef
        self.temperature, self.kl_estimator, self.banned = temperature, kl_estimator, tuple(banned)
        self.clip_ratio_c = clip_ratio_c
        self.tp_rank = dist.get_rank(tp_group) if tp_group is not None and dist.is_initialized() else 0

    def __call__(self, mb, logits_BTV: torch.Tensor):
        """(loss, tokens, {"loss", "logp", "kl", "kl_k1", "entropy", "clipfrac"}) for megatron's schedule."""
        mask, at = mb.label_mask, mb.label_at
        logp, entropy = policy_logprob_entropy(logits_BTV, mb.labels, self.temperature, self.banned, self.tp_rank,
                                               self.tp_group, at, self.entropy_coef > 0, self.kernel)
        # Off the loss positions (a full sequence's prompt) old/ref equal logp: no exp() of a stray log-ratio.
        old = torch.where(mask, mb.token_data["old_logp"], logp.detach()) if "old_logp" in mb.token_data \
            else logp.detach()
        ref = torch.where(mask, mb.token_data["ref_logp"], logp.detach()) if "ref_logp" in mb.token_data \
            else logp.detach()
        per_token = grpo_token_loss(logp, old, ref, mb.token_data["adv"], self.kl_coef, self.clip_low, self.clip_high,
                                    self.kl_estimator, self.clip_ratio_c)
        w = mask.float() / self.total_tokens  # token mean: the logged statistics
        lw = mb.token_data.get("loss_w", w)  # the loss's aggregation
        loss = (per_token * lw).sum()
        if self.entropy_coef > 0:  # entropy bonus, aggregated as the loss, against the policy collapsing
            loss = loss - self.entropy_coef * (entropy * rows_at(lw, at)).sum()
        entropy = entropy.detach()
        with torch.no_grad():
            ratio = torch.exp(logp - old)
            clipped = ((ratio < 1 - self.clip_low) | (ratio > 1 + self.clip_high)).float()
            stats = {"loss": loss.detach(), "logp": rows_at(logp.detach(), at),
                     "kl": (kl_estimate(logp, ref, self.kl_estimator) * w).sum(),
                     "kl_k1": ((logp - ref) * w).sum(), "clipfrac": (clipped * w).sum(),
                     "entropy": (entropy * rows_at(w, at)).sum()}
        return loss, mask.sum().to(torch.int), stats
