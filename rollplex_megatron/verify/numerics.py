"""The norm-relative error of docs/design.md §3, for the checks, benchmarks and tests alike."""
from __future__ import annotations

from collections.abc import Sequence

import torch


def rel_err(a: torch.Tensor | Sequence[torch.Tensor], b: torch.Tensor | Sequence[torch.Tensor]) -> float:
    """||a - b|| / ||b|| in float64 (b is the reference); a sequence of tensors counts as its elements flattened
    and concatenated (e.g. all tokens of all samples)."""
    a, b = _flat(a), _flat(b)
    if a.shape != b.shape:  # broadcasting would compare something else
        raise ValueError(f"rel_err compares tensors of one shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    # clamped: a zero reference gives 0 for an equal tensor, a huge value for any other
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _flat(x: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """`x` detached in float64 on its device; a sequence as its elements flattened and concatenated."""
    if isinstance(x, torch.Tensor):
        return x.detach().double()
    return torch.cat([torch.as_tensor(t).detach().double().flatten() for t in x])
