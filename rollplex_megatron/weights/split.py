"""Split GEMMs: run a rollout linear layer over [local views | received pieces] without a copy.

For a `gather`-class weight, the rollout shard is a sequence of runs: stretches that sit
contiguously in the local training storage, and stretches that live on other GPUs. Instead of
copying the local stretches into a new full buffer, the layer keeps views of them and allocates
only the remote stretches, then runs one GEMM per run:
- column-parallel (runs along output rows): out = cat_i(x @ W_i^T);
- row-parallel (runs along input columns): out = sum_i(x[..., cols_i] @ W_i^T), then the TP
  all-reduce megatron's RowParallelLinear would do.
This is a rollout-only (no-grad) executor; biases keep their own small rebuilt tensors.
"""
from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear


def runs(pos: torch.Tensor) -> list[tuple[str, int, int]]:
    """Split per-element positions into runs: ("local", start, n) for contiguous ascending local
    positions, ("remote", offset_in_remote_buffer, n) for consecutive non-local elements."""
    out: list[tuple[str, int, int]] = []
    remote_seen = 0
    p = pos.tolist()
    i = 0
    while i < len(p):
        j = i + 1
        if p[i] >= 0:
            while j < len(p) and p[j] == p[j - 1] + 1:
                j += 1
            out.append(("local", p[i], j - i))
        else:
            while j < len(p) and p[j] < 0:
                j += 1
            out.append(("remote", remote_seen, j - i))
            remote_seen += j - i
        i = j
    return out


def supports(module) -> bool:
    """Only megatron's tensor-parallel linears get the split executor."""
    return isinstance(module, (ColumnParallelLinear, RowParallelLinear))


def _column_forward(self, input_, weight=None, runtime_gather_output=None):
    out = torch.cat([F.linear(input_, w) for w in self._split_pieces()], dim=-1)
    if self.bias is not None and not self.skip_bias_add:
        out = out + self.bias
    return out, (self.bias if self.skip_bias_add else None)


def _row_forward(self, input_):
    out, col = None, 0
    for w in self._split_pieces():
        part = F.linear(input_.narrow(-1, col, w.shape[1]), w)
        out = part if out is None else out + part
        col += w.shape[1]
    if self.tp_group.size() > 1:
        dist.all_reduce(out, group=self.tp_group)
    if self.skip_bias_add:
        return out, self.bias
    return (out + self.bias if self.bias is not None else out), None


def install(module, local: torch.Tensor, remote: torch.Tensor, plan_runs, dim: int) -> None:
    """Make `module` compute with [local views | remote pieces] along `dim` of its weight."""
    def pieces(self):
        return [(local if kind == "local" else remote).narrow(dim, start, n) for kind, start, n in plan_runs]

    module._split_pieces = types.MethodType(pieces, module)
    fwd = _column_forward if isinstance(module, ColumnParallelLinear) else _row_forward
    module.forward = types.MethodType(fwd, module)
