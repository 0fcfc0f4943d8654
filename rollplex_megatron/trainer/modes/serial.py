"""serial: verl-style colocation; every phase re-runs whole sequences (the baseline)."""
from __future__ import annotations

import torch

from rollplex_megatron.memory.classes import PlanInputs, TensorClass
from rollplex_megatron.prefix import batch as B
from rollplex_megatron.prefix import execution as X
from rollplex_megatron.trainer.modes.base import Mode, scoring_workspaces


class Serial(Mode):
    """rollout -> old log-probs -> reference log-probs -> update, all over [prompt, response]."""

    name = "serial"
    phases = ("rollout", "old_logp", "ref_logp", "update", "optimizer")
    reference_phases = ("ref_logp",)

    def step(self, rt, step, t):  # noqa: D102
        batch, out = self.rollout(rt, *rt.requests(step), t)
        mbs = rt.micro_batches(batch, "full")
        with t("old_logp"), torch.no_grad():
            old = X.per_response(X.full_sequence_step(rt.ddp, mbs, forward_only=True, backend=rt.backend,
                                                      loss_fn=rt.score_loss), mbs,
                               batch.groups)
        with t("ref_logp"), torch.no_grad():
            ref = X.per_response(X.full_sequence_step(rt.ref, mbs, forward_only=True, backend=rt.backend,
                                                      loss_fn=rt.score_loss), mbs,
                               batch.groups)
        B.attach_token_data(mbs, "old_logp", old)
        B.attach_token_data(mbs, "ref_logp", ref)
        with t("update"):
            res = X.full_sequence_step(rt.ddp, mbs, loss_fn=rt.loss(batch), backend=rt.backend)
        return batch, res, out.stats

    @staticmethod
    def memory_classes(p: PlanInputs) -> list[TensorClass]:  # noqa: D102
        s = p.shape
        return scoring_workspaces(p, ("old_logp", "ref_logp"), s.mb * (s.P + s.R)) + [
            TensorClass("update_activations", p.activations(s.mb * (s.P + s.R), s.mb * s.patches), ("update",),
                        "free", "one micro-batch's whole sequences, vision tower included")]
