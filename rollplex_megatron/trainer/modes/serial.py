"""serial: verl-style colocation; every phase re-runs whole sequences (the baseline)."""
from __future__ import annotations

import torch

from rollplex_megatron.memory.classes import PlanInputs, TensorClass
from rollplex_megatron.prefix import execution as X
from rollplex_megatron.trainer.modes.base import Mode, Prepared, scoring_workspaces


class Serial(Mode):
    """rollout -> old log-probs -> reference log-probs -> update, all over [prompt, response]."""

    name = "serial"
    phases = ("rollout", "old_logp", "ref_logp", "update", "optimizer")
    reference_phases = ("ref_logp",)
    full_sequences = True

    def prepare(self, rt, step, t):  # noqa: D102
        batch, _, _, stats = self.rollout(rt, t)
        minis = rt.mini_batches(batch)
        prep = Prepared(batch, minis, [rt.micro_batches(batch, "full", m) for m in minis], None, stats)
        mbs = prep.flat()
        with t("old_logp"), torch.no_grad():
            prep.record_old(X.per_response(X.full_sequence_step(rt.ddp, mbs, forward_only=True, backend=rt.backend,
                                                                loss_fn=rt.score_loss), mbs, batch.groups))
        if rt.ref is None:  # no reference (train.reference): no scoring phase of it
            return prep
        with t("ref_logp"), torch.no_grad():
            prep.attach("ref_logp", X.per_response(X.full_sequence_step(rt.ref, mbs, forward_only=True,
                                                                        backend=rt.backend, loss_fn=rt.score_loss),
                                                   mbs, batch.groups))
        return prep

    def update(self, rt, prep, m, fresh):  # noqa: D102
        return X.full_sequence_step(rt.ddp, prep.mbs[m], loss_fn=rt.loss(prep.minis[m]), backend=rt.backend)

    @staticmethod
    def memory_classes(p: PlanInputs) -> list[TensorClass]:  # noqa: D102
        s = p.shape
        return scoring_workspaces(p, ("old_logp", "ref_logp"), s.mb * (s.P + s.R), packed=False) + [
            TensorClass("update_activations", p.activations(s.mb * (s.P + s.R), s.mb * s.patches), ("update",),
                        "free", "one micro-batch's whole sequences, vision tower included")]
