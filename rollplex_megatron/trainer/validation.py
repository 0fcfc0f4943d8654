"""Validation runs: the policy answers `data.val_files` (greedy, or at `val.temperature`) and the
rewards are reduced per data_source over the data-parallel ranks. `evaluate` runs inside training
(the trainer's Runtime) and in the `eval` / `generate` commands (`EvalRuntime`: a Hugging Face
checkpoint, the embedded engine, no optimizer or reference)."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from rollplex_megatron.config import RunConfig
from rollplex_megatron.data.dataset import DatasetSource
from rollplex_megatron.dist import init_parallel
from rollplex_megatron.rollout.embedded import check_kv_budget
from rollplex_megatron.rollout.engine import RolloutRequest
from rollplex_megatron.rollout.sampling import SamplingParams
from rollplex_megatron.runtime import device
from rollplex_megatron.trainer.runtime import build_engine, build_policy


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
    rows = src.val_rows(rt.dp_rank, rt.dp_size, v.max_rows)
    sources = src.val_sources(v.max_rows)
    reqs = [RolloutRequest(r.prompt, v.n, src.max_new_tokens, src.stop_token_ids, seed=r.seed) for r in rows]
    sums = torch.zeros(len(sources) + 1, 3, dtype=torch.float64)  # [reward, correct, responses]; last row: all
    if reqs or rt.engine.collective:  # ranks of one TP/PP group share their rows, so they skip together; a
        # collective engine (rollout replicas, rollout ranks) needs every rank, rows or none
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


class EvalRuntime:
    """What `evaluate` needs, for a Hugging Face checkpoint (`train.init_hf`): the model on this rank's
    TP/PP shard, the embedded engine and the dataset source of `data.val_files`."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        init_parallel(cfg.parallel.tp, cfg.parallel.pp, cfg.seed, cfg.parallel.backend)
        self.source = DatasetSource(cfg, training=False)
        check_kv_budget(cfg, self.source, {"val.n": cfg.val.n}, whole_layers=False)  # build_engine: the model's own
        model = build_policy(cfg)
        model.eval()
        self.engine = build_engine(model, cfg)
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.dp_group, self.dev = ps.get_data_parallel_group(), device()


def eval_rank(cfg: RunConfig) -> dict:
    """The `eval` command on one rank: the validation record of the checkpoint."""
    return evaluate(EvalRuntime(cfg), 0)


def generate_rank(cfg: RunConfig, rows: int) -> list[dict]:
    """The `generate` command on one rank: prompt text and decoded responses of the first `rows` rows."""
    rt = EvalRuntime(cfg)
    src = rt.source
    picked = src.val_rows(0, 1, rows)
    reqs = [RolloutRequest(r.prompt, cfg.val.n, src.max_new_tokens, src.stop_token_ids, seed=r.seed) for r in picked]
    with torch.no_grad():
        out = rt.engine.generate(reqs, val_sampling(cfg))
    return [{"row": r.meta.where, "prompt": src.proc.tokenizer.decode(r.prompt.input_ids, skip_special_tokens=False),
             "ground_truth": r.meta.ground_truth,
             "responses": [src.proc.decode(t) for t in res.tokens],
             "rewards": [src.score(r, t).reward for t in res.tokens]} for r, res in zip(picked, out.results)]
