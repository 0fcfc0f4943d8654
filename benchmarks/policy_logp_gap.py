"""CPU: the gap between the trainer's and the sampler's log-probs on the main job's first step, with the
trainer's softmax as it is (the sampler's banned vision tokens excluded) and as it was before (included).

    python benchmarks/policy_logp_gap.py OUT_JSON
"""
from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

from rollplex_megatron.dist import run_local
from rollplex_megatron.prefix import execution as X
from rollplex_megatron.recipes import load_run_config
from rollplex_megatron.rl.grpo import GRPOLoss
from rollplex_megatron.runtime import environment_record
from rollplex_megatron.trainer.loop import run_step
from rollplex_megatron.trainer.modes import get_mode
from rollplex_megatron.trainer.runtime import Runtime

OVERRIDES = ["mode.name=serial", "train.progress=false"]  # the root recipe otherwise (tiny, reach task, 8 x G=16)


def _gap(cfg, banned_in_loss: bool) -> float:
    rt = Runtime(cfg)
    if not banned_in_loss:  # the trainer before the fix: vision tokens inside its softmax
        t = cfg.train
        rt.score_loss = partial(X.logprob_loss, temperature=cfg.rollout.temperature)
        rt.loss = lambda batch: GRPOLoss(t.kl_coef, t.clip_low, t.clip_high, batch.total_tokens, rt.tp_group,
                                         t.entropy_coef, cfg.rollout.temperature, t.kl_estimator)
    return run_step(rt, get_mode("serial")(), 0)["rollout_logp_diff"]


def main(out: str) -> None:
    cfg = load_run_config(OVERRIDES)
    rec = {"command": f"python benchmarks/policy_logp_gap.py {out}", "overrides": OVERRIDES,
           "what": "mean |trainer log-prob - sampler log-prob| per response token, step 1 of the main job",
           **environment_record(),
           "banned_tokens_out_of_the_loss": run_local(_gap, 1, cfg, True)[0],
           "banned_tokens_in_the_loss": run_local(_gap, 1, cfg, False)[0]}
    Path(out).write_text(json.dumps(rec, indent=1))
    print(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
