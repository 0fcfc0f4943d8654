"""rollplex: the prefix stages inside the rollout (DESIGN section 2).

The rollout's prefill *is* the actor prefix stage; the reference prefix stage of every group runs
in the decode window; then the reference response stage, the actor response stage (old log-probs
are its own detached forward) and the prefix backward once per group.
"""
from __future__ import annotations

from functools import partial

import torch

from rollplex_megatron.attention.kv_store import KVStore
from rollplex_megatron.memory.classes import PlanInputs, TensorClass
from rollplex_megatron.prefix import batch as B
from rollplex_megatron.prefix import execution as X
from rollplex_megatron.prefix.batch import Group
from rollplex_megatron.rollout.window import DecodeWindow
from rollplex_megatron.trainer.modes.base import Mode, response_stage_activations, scoring_workspaces


def reference_prefix_item(ref, prompt, store: KVStore, group: int) -> None:
    """Decode-window work item: the reference prefix stage of one group (K/V only)."""
    with torch.no_grad():
        X.prefix_forward(ref, [Group(prompt, [], torch.zeros(0))], store, keep_graph=False, group_ids=[group])


class Rollplex(Mode):
    """Prefix stages inside the rollout: prefill = actor prefix, reference prefixes in the decode window."""

    name = "rollplex"
    phases = ("rollout", "ref_logp", "update", "optimizer")
    # the reference stays through `reward`, between its two readers (the window's reference prefixes
    # in the rollout, the reference response stage)
    reference_phases = ("rollout", "reward", "ref_logp")

    def step(self, rt, step, t):  # noqa: D102
        actor_kv, ref_kv = KVStore(), KVStore()
        window = DecodeWindow.from_config(rt.cfg.mode, rt.cfg.parallel)
        rows, reqs = rt.requests(step)
        for i, r in enumerate(reqs):
            window.submit(f"reference_prefix[{i}]", partial(reference_prefix_item, rt.ref, r.prompt, ref_kv, i))
        batch, out = self.rollout(rt, rows, reqs, t, hooks=window, actor_prefix=actor_kv,
                                  recompute_prefix=rt.recompute)
        mbs = rt.micro_batches(batch, "response")
        with t("ref_logp"):
            ref = X.per_response(X.reference_response_logprobs(rt.ref, mbs, ref_kv, rt.backend,
                                                                 rt.score_loss), mbs, batch.groups)
        B.attach_token_data(mbs, "ref_logp", ref)
        with t("update"):
            res, kv_stats = X.actor_response_step(rt.ddp, mbs, actor_kv, out.prefix_states, rt.backend,
                                                  loss_fn=rt.loss(batch))
        return batch, res, {**out.stats, **window.stats(), **kv_stats}

    @staticmethod
    def memory_classes(p: PlanInputs) -> list[TensorClass]:  # noqa: D102
        s = p.shape
        out = [TensorClass("actor_prefix_kv", p.prefix_kv_fp32, ("rollout", "ref_logp", "update"), "free",
                           "fp32 K/V leaves of every group, from the prefill (decode reads them)"),
               TensorClass("reference_prefix_kv", p.prefix_kv, ("rollout", "ref_logp"), "free",
                           "computed in the decode window"),
               TensorClass("prefix_kv_grads", p.prefix_kv_fp32, ("update",), "free", "fp32 gK/gV")]
        if p.keep:
            out.append(TensorClass("actor_prefix_graph", s.prompts * p.prefix_graph, ("rollout", "ref_logp", "update"),
                                   "keep", "every group's saved prefix activations"))
        return out + scoring_workspaces(p, ("ref_logp",), s.mb * s.R) + [response_stage_activations(p)]
