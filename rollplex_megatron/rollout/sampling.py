"""Token sampling from explicit generators: temperature, top-k, top-p (pure tensor code).

Legend: B = rows (samples), V = vocabulary. Sampling is the Gumbel-max trick on the filtered,
temperature-scaled logits with uniforms drawn from a per-request generator, so a sample's tokens
depend only on its request's seed and the model's logits, not on which other requests share the
batch or when they finish.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of a request (validated on construction)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_p, self.top_k, "sampling ")


def check_sampling(temperature: float, top_p: float, top_k: int, where: str) -> None:
    """Range checks shared by SamplingParams and the rollout config; `where` prefixes the names."""
    if not temperature > 0:
        raise ValueError(f"{where}temperature must be > 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"{where}top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"{where}top_k must be >= 0 (0 keeps all tokens), got {top_k}")


def filter_logits(logits_BV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Logits with everything outside the top-k / top-p set at -inf (the most likely token stays)."""
    x = logits_BV
    if top_k and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        drop_sorted = probs.cumsum(-1) - probs >= top_p  # mass before this token already >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def sample_tokens(logits_BV: torch.Tensor, params: SamplingParams, uniform_BV: torch.Tensor):
    """(tokens [B], log-probs [B]): Gumbel-max draw; log-probs of the temperature-scaled logits."""
    scaled = logits_BV.float() / params.temperature
    filtered = filter_logits(scaled, params.top_k, params.top_p)
    gumbel = -torch.log(-torch.log(uniform_BV.clamp(1e-20, 1.0 - 1e-7)))
    tokens = torch.argmax(filtered + gumbel, dim=-1)
    logp = torch.log_softmax(scaled, dim=-1).gather(-1, tokens[:, None])[:, 0]
    return tokens, logp


def request_generator(seed: int, device) -> torch.Generator:
    """The generator of one request (same seed, same uniforms on the same device type)."""
    return torch.Generator(device=device).manual_seed(seed)
