"""Validation runs: the policy answers `data.val_files` (greedy, or at `val.temperature`) and the
rewards are reduced per data_source over the data-parallel ranks."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from rollplex_megatron.rollout.engine import RolloutRequest
from rollplex_megatron.rollout.sampling import SamplingParams


def val_sampling(cfg) -> SamplingParams:
    """Greedy decoding (top-1) at `val.temperature=0`, else the rollout's filters at `val.temperature`."""
    if cfg.val.temperature == 0:
        return SamplingParams(1.0, 1.0, 1)
    return SamplingParams(cfg.val.temperature, cfg.rollout.top_p, cfg.rollout.top_k)


def evaluate(rt, step: int) -> dict:
    """The validation record after `step` optimizer steps: `val/reward_mean`, `val/accuracy` and
    `val/<data_source>/reward_mean` (every rank returns the same record)."""
    t0 = time.perf_counter()
    src, v = rt.source, rt.cfg.val
    rt.memory.enter("rollout")  # the residency the engine decodes under
    rows = src.val_rows(rt.dp_rank, rt.dp_size, v.max_rows)
    sources = src.val_sources(v.max_rows)
    reqs = [RolloutRequest(r.prompt, v.n, src.max_new_tokens, src.stop_token_ids, seed=r.seed) for r in rows]
    sums = torch.zeros(len(sources) + 1, 3, dtype=torch.float64)  # [reward, correct, responses]; last row: all
    if reqs:  # ranks of one TP/PP group share their rows, so they skip together
        with torch.no_grad():
            out = rt.engine.generate(reqs, val_sampling(rt.cfg))
        for row, res in zip(rows, out.results):
            k = sources.index(row.meta.data_source)
            for tokens in res.tokens:
                s = src.score(row, tokens)
                for i in (k, -1):
                    sums[i] += torch.tensor([s.reward, s.correct, 1.0], dtype=torch.float64)
    sums = sums.to(rt.dev)
    dist.all_reduce(sums, group=rt.dp_group)
    sums = sums.cpu()
    rec = {"kind": "val", "step": step, "val/reward_mean": float(sums[-1, 0] / sums[-1, 2]),
           "val/accuracy": float(sums[-1, 1] / sums[-1, 2]), "val/responses": int(sums[-1, 2])}
    for k, name in enumerate(sources):
        rec[f"val/{name}/reward_mean"] = float(sums[k, 0] / sums[k, 2])
        rec[f"val/{name}/accuracy"] = float(sums[k, 1] / sums[k, 2])
    rec["val_time_s"] = time.perf_counter() - t0
    return rec
