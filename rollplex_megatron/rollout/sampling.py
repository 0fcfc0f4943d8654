"""Token sampling from explicit generators: temperature, top-k, top-p (pure tensor code).

Legend: B = rows (samples), V = vocabulary. Sampling is the Gumbel-max trick on the filtered,
temperature-scaled logits. The uniforms are a counter-based hash of (request seed, sample index,
step, token id), so a sample's tokens depend only on its request's seed and the model's logits,
not on which other requests share the batch, when they finish, or the device; and a decode step
draws them inside a CUDA graph with no generator state.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rollplex_megatron.config import check_sampling


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of a request (validated on construction)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_p, self.top_k, "sampling ")


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


def inverse_temperature(temperature: float) -> float:
    """1/T as the fp32 reciprocal: logits are scaled by one fp32 multiply, on every device and kernel
    (torch's CUDA division by a scalar multiplies by this reciprocal; CPU division would not)."""
    return float(np.float32(1.0) / np.float32(temperature))


def sample_tokens(logits_BV: torch.Tensor, params: SamplingParams, uniform_BV: torch.Tensor):
    """(tokens [B], log-probs [B]): Gumbel-max draw; log-probs of the temperature-scaled logits."""
    scaled = logits_BV.float() * inverse_temperature(params.temperature)
    filtered = filter_logits(scaled, params.top_k, params.top_p)
    gumbel = -torch.log(-torch.log(uniform_BV.clamp(1e-20, 1.0 - 1e-7)))
    tokens = torch.argmax(filtered + gumbel, dim=-1)
    logp = torch.log_softmax(scaled, dim=-1).gather(-1, tokens[:, None])[:, 0]
    return tokens, logp


_M64 = (1 << 64) - 1


def _i64(x: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _MIX1, _MIX2 = _i64(0x9E3779B97F4A7C15), _i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 bits (multiplication wraps modulo 2^64)."""
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def row_uniforms(seed_B: torch.Tensor, sample_B: torch.Tensor, step, vocab: int) -> torch.Tensor:
    """Uniforms in (0, 1) [B, V] for sample `sample_B` of the request seeded `seed_B` at `step`.

    `step` is an int or a 0-d/1-element int64 tensor (a CUDA graph's step counter). Pure integer
    arithmetic: the same numbers on every device and batch layout.
    """
    step = step.reshape(()) if torch.is_tensor(step) else torch.tensor(step, dtype=torch.long, device=seed_B.device)
    key = _splitmix(seed_B.long() * _GOLDEN + sample_B.long())
    key = _splitmix(key + (step + 1) * _GOLDEN)  # [B]
    ids = torch.arange(vocab, device=seed_B.device, dtype=torch.long)
    bits = _splitmix(key[:, None] + ids[None, :] * _GOLDEN)
    return (_shr(bits, 41).float() + 0.5) * (1.0 / (1 << 23))  # 23 bits + 1/2: exact in float32, never 0 or 1


def request_uniforms(seed: int, n: int, step: int, vocab: int, device="cpu") -> torch.Tensor:
    """The uniforms of a request's `n` samples at `step` (what the engine draws for them)."""
    return row_uniforms(torch.full((n,), seed, device=device), torch.arange(n, device=device), step, vocab)
