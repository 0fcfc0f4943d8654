"""prefix_shared: the serial phase order; every phase computes the prefix once per group."""
from __future__ import annotations

from rollplex_megatron.memory.classes import PlanInputs, TensorClass
from rollplex_megatron.prefix import execution as X
from rollplex_megatron.trainer.modes.base import Mode, Prepared, response_stage_activations, scoring_workspaces


class PrefixShared(Mode):
    """Same phases as serial; prefix stage once per group + packed response stage in each."""

    name = "prefix_shared"
    phases = ("rollout", "old_logp", "ref_logp", "update", "optimizer")
    reference_phases = ("ref_logp",)

    def prepare(self, rt, step, t):  # noqa: D102
        batch, _, _, stats = self.rollout(rt, t)
        minis = rt.mini_batches(batch)
        prep = Prepared(batch, minis, [rt.micro_batches(batch, "response", m) for m in minis], None, stats)
        mbs = prep.flat()
        with t("old_logp"):
            # the actor scores in the packs its update runs (the same kernels: ratio 1 at the first update): an
            # update packs only its own mini-batch's groups, so no scoring pack spans two mini-batches
            starts = rt.pack_starts(len(batch.groups))
            prep.record_old(X.per_response(X.reference_prefix_logprobs(rt.ddp, batch.groups, mbs, rt.backend,
                                                                       rt.score_loss, rt.actor_pack_tokens, starts),
                                           mbs, batch.groups))
        if rt.ref is None:  # no reference (train.reference): no scoring phase of it
            return prep
        with t("ref_logp"):
            prep.attach("ref_logp", X.per_response(X.reference_prefix_logprobs(rt.ref, batch.groups, mbs, rt.backend,
                                                                               rt.score_loss, rt.pack_tokens, starts),
                                                   mbs, batch.groups))
        return prep

    def update(self, rt, prep, m, fresh):  # noqa: D102
        return X.actor_prefix_step(rt.ddp, prep.batch.groups, prep.mbs[m], rt.backend, loss_fn=rt.loss(prep.minis[m]),
                                   recompute=rt.recompute, select=prep.minis[m].groups,
                                   pack_tokens=rt.actor_pack_tokens)

    @staticmethod
    def memory_classes(p: PlanInputs) -> list[TensorClass]:  # noqa: D102
        s = p.shape
        out = [TensorClass("scoring_prefix_kv", p.prefix_kv, ("old_logp", "ref_logp"), "free",
                           "each scoring phase's prefix K/V, one group each"),
               TensorClass("actor_prefix_kv", p.prefix_kv_fp32, ("update",), "free", "fp32 K/V leaves"),
               TensorClass("prefix_kv_grads", p.prefix_kv_fp32, ("update",), "free", "fp32 gK/gV")]
        if p.keep:
            out.append(TensorClass("actor_prefix_graph", s.prompts * p.prefix_graph, ("update",), "keep",
                                   "every group's saved prefix activations"))
        return out + scoring_workspaces(p, ("old_logp", "ref_logp"), s.mb * s.R) + [response_stage_activations(p)]
