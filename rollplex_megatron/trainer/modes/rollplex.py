"""rollplex: the prefix stages inside the rollout (docs/design.md §2).

The rollout's prefill *is* the actor prefix stage; the reference prefix stage of every group runs
in the decode window; then the reference response stage, the actor response stage (old log-probs
are its own detached forward) and the prefix backward once per group.

With PPO mini-batches only the first update reads the rollout's actor prefix; the old log-probs of
the other mini-batches come from a forward-only response stage over that prefix before any
optimizer step (`old_logp`), and their updates recompute the prefix at the updated weights. With
dynamic sampling every round has its own stores; the kept groups' K/V are gathered into one, and
the prefix work of the groups not trained on is reported (`dropped_prefix_*`).
"""
from __future__ import annotations

import dataclasses
import itertools
from functools import partial

import torch
import torch.distributed as dist

from rollplex_megatron.attention.kv_store import KVStore
from rollplex_megatron.memory.classes import PlanInputs, TensorClass
from rollplex_megatron.prefix import execution as X
from rollplex_megatron.prefix.batch import Group
from rollplex_megatron.prefix.graphs import PrefixGraphs
from rollplex_megatron.rollout.window import DecodeWindow
from rollplex_megatron.rollout.window.jobs import PrefixJob
from rollplex_megatron.trainer.modes.base import (Mode, Prepared, response_stage_activations, scoring_workspaces,
                                                  sum_stats)


def reference_prefix_item(ref, prompts: list, store: KVStore, groups: list[int], pack_tokens: int = 0,
                          graphs: PrefixGraphs | None = None) -> None:
    """Decode-window work item: the reference prefix stage of one group, or of a pack of groups as one
    forward (`workload.prefix_pack_tokens`) (K/V only); with `graphs` (mode.window_graphs) each pack is a replay
    of its bucket's CUDA graph."""
    rest = list(range(len(prompts)))  # the prompts left for the plain path
    if graphs is not None:
        m = X.unwrap(ref)
        packs = X.prefix_packs([p.input_ids.numel() - 1 for p in prompts], pack_tokens)
        for n, pack in enumerate(packs):
            if graphs.why_plain(m):  # no CUDA, or a capture failed (also one of this item's): the plain path
                graphs.ran_plain(len(packs) - n)
                rest = [i for later in packs[n:] for i in later]
                break
            graphs.record(m, [prompts[i] for i in pack], store, [groups[i] for i in pack])
        else:
            return
    with torch.no_grad():
        X.prefix_forward(ref, [Group(prompts[i], [], torch.zeros(0)) for i in rest], store, keep_graph=False,
                         group_ids=[groups[i] for i in rest], pack_tokens=pack_tokens)


def actor_prefix_item(actor, prompts: list, store: KVStore, groups: list[int], recompute: bool, states: list,
                      pack_tokens: int = 0) -> None:
    """Decode-window work item where the rollout's prefill cannot be the actor prefix stage (rollout at
    its own layout): the actor prefix stage of one group, or of a pack of groups as one forward, at the training
    layout, as the engine's prefill would run it (trainable K/V leaves; the graph kept unless the prefix backward
    recomputes it, a pack at a time)."""
    with torch.set_grad_enabled(not recompute):
        states += X.prefix_forward(actor, [Group(p, [], torch.zeros(0)) for p in prompts], store,
                                   keep_graph=not recompute, group_ids=groups, recompute=recompute,
                                   pack_tokens=pack_tokens)


def _pack_name(stage: str, rnd: int, pack: list[int]) -> str:
    """A window item's name: `reference_prefix[0.3]` for group 3 of round 0, `[0.0-7]` for a pack of groups 0-7."""
    return f"{stage}[{rnd}.{pack[0]}{f'-{pack[-1]}' if len(pack) > 1 else ''}]"


class Rollplex(Mode):
    """Prefix stages inside the rollout: prefill = actor prefix, reference prefixes in the decode window."""

    name = "rollplex"
    phases = ("rollout", "ref_logp", "old_logp", "update", "optimizer")  # old_logp: train.ppo_mini_batches > 1
    # the reference stays through `reward`, between its two readers (the window's reference prefixes
    # in the rollout, the reference response stage)
    reference_phases = ("rollout", "reward", "ref_logp")

    def prepare(self, rt, step, t):  # noqa: D102
        stores, windows, round_states = [], [], []
        in_prefill = rt.engine.prefill_is_actor_prefix  # else the actor prefix stage is window work too

        def round_kwargs(r, reqs):
            actor_kv, ref_kv, states = KVStore(), KVStore(), []
            window = DecodeWindow.from_config(rt.cfg.mode, rt.cfg.parallel, rt.cfg.rollout.tp)
            # items that run in this process may take several groups' prefixes as one forward (a pack: fewer,
            # larger kernels); an engine elsewhere runs jobs as data, one group a job
            here = not rt.engine.window_items_elsewhere
            lens = [q.prompt.input_ids.numel() - 1 for q in reqs]
            # packs end at the PPO mini-batches' bounds, as the engine's prefill and the updates pack (one round:
            # packing with dynamic sampling's rounds is refused)
            starts = rt.pack_starts(len(reqs))
            actor = [] if in_prefill else [  # where the prefill is not the actor prefix stage (rollout at its own TP)
                (_pack_name("actor_prefix", r, pack),
                 partial(actor_prefix_item, rt.ddp, [reqs[i].prompt for i in pack], actor_kv, pack, rt.recompute,
                         states, rt.actor_pack_tokens),
                 PrefixJob("actor", reqs[pack[0]].prompt, actor_kv, pack[0], trainable=True, states=states)
                 if len(pack) == 1 else None)
                for pack in X.prefix_packs(lens, rt.actor_pack_tokens if here else 0, starts)]
            reference = [] if rt.ref is None else [(_pack_name("reference_prefix", r, pack),
                          partial(reference_prefix_item, rt.ref, [reqs[i].prompt for i in pack], ref_kv, pack,
                                  rt.pack_tokens, rt.prefix_graphs if here else None),
                          PrefixJob("reference", reqs[pack[0]].prompt, ref_kv, pack[0]) if len(pack) == 1 else None)
                         for pack in X.prefix_packs(lens, rt.pack_tokens if here else 0, starts)]
            # actor and reference items alternate, in the same order on every rank (TP collectives inside them)
            for item in itertools.chain(*itertools.zip_longest(actor, reference)):
                if item is not None:
                    window.submit(*item)
            stores.append((actor_kv, ref_kv))
            windows.append(window)
            round_states.append(states)
            if not in_prefill:
                return {"hooks": window}
            return {"hooks": window, "actor_prefix": actor_kv, "recompute_prefix": rt.recompute}

        batch, picks, outs, stats = self.rollout(rt, t, round_kwargs)
        if in_prefill:
            round_states[:] = [o.prefix_states for o in outs]
        actor_kv, ref_kv, states = KVStore(), KVStore(), []
        for gi, (r, i) in enumerate(picks):  # the kept groups' K/V under their index in the batch
            actor_kv.adopt(stores[r][0], i, gi)
            ref_kv.adopt(stores[r][1], i, gi)
            states += [dataclasses.replace(st, group=gi) for st in round_states[r] if st.group == i]
        stats.update(sum_stats([w.stats() for w in windows]))
        if rt.prefix_graphs is not None:
            stats.update(rt.prefix_graphs.take_stats())
        if rt.cfg.train.dynamic_sampling:  # global counts, as `_select`'s beside them
            kept = set(picks)
            lost = [st.length for r, rs in enumerate(round_states) for st in rs if (r, st.group) not in kept]
            counts = torch.tensor([len(lost), sum(lost)], dtype=torch.float64, device=rt.dev)
            dist.all_reduce(counts, group=rt.dp_group)
            work = "actor prefill + reference prefix, each" if rt.ref is not None else "actor prefill"
            stats["dynamic_sampling"].update(dropped_prefix_groups=int(counts[0]), dropped_prefix_tokens=int(counts[1]),
                                             dropped_prefix_work=work)
        for store in (x for pair in stores for x in pair):  # what is left there: groups not trained on
            store.leaves.clear()
            store.graph.clear()
        stores.clear()
        windows.clear()  # finished window items reference the rounds' stores
        round_states.clear()
        del outs
        minis = rt.mini_batches(batch)
        prep = Prepared(batch, minis, [rt.micro_batches(batch, "response", m) for m in minis], None, stats,
                        {"actor_kv": actor_kv, "states": states})
        mbs = prep.flat()
        if rt.ref is not None:  # else no reference (train.reference): no window items of it, no scoring phase
            with t("ref_logp"):
                prep.attach("ref_logp", X.per_response(X.response_logprobs(rt.ref, mbs, ref_kv, rt.backend,
                                                                           rt.score_loss), mbs, batch.groups))
        if len(minis) > 1:  # later mini-batches: the rollout policy's log-probs before any optimizer step
            later = list(range(1, len(minis)))
            with t("old_logp"):
                res = X.response_logprobs(rt.ddp, prep.flat(later), actor_kv, rt.backend, rt.score_loss, release=False)
                prep.record_old(X.per_response(res, prep.flat(later), batch.groups), later)
            for m in later:  # their updates recompute the prefix at the updated weights
                for gi in minis[m].groups:
                    actor_kv.release(gi)
        return prep

    def update(self, rt, prep, m, fresh):  # noqa: D102
        mini = prep.minis[m]
        if not fresh:  # the weights moved since the rollout: the prefix is recomputed (docs/design.md §2)
            return X.actor_prefix_step(rt.ddp, prep.batch.groups, prep.mbs[m], rt.backend, loss_fn=rt.loss(mini),
                                       recompute=rt.recompute, select=mini.groups, pack_tokens=rt.actor_pack_tokens)
        own = set(mini.groups)
        states = [st for st in prep.state.pop("states") if st.group in own]
        res, kv_stats = X.actor_response_step(rt.ddp, prep.mbs[m], prep.state.pop("actor_kv"), states, rt.backend,
                                              loss_fn=rt.loss(mini))
        prep.stats.update(kv_stats)
        prep.record_old(X.per_response(res, prep.mbs[m], prep.batch.groups), [m])  # its own detached forward
        return res

    @staticmethod
    def memory_classes(p: PlanInputs) -> list[TensorClass]:  # noqa: D102
        s, k = p.shape, p.rounds
        # dynamic sampling: every round's prefix K/V (and graphs) stay until the batch is selected, at
        # the end of the rollout phase; after it only the kept groups' (one round's worth) remain
        rounds = f", x{k} rollout rounds in the rollout phase" if k > 1 else ""
        out = [TensorClass("actor_prefix_kv", p.prefix_kv_fp32 * k, ("rollout",), "free",
                           "fp32 K/V leaves of every group, from the prefill (decode reads them)" + rounds),
               TensorClass("actor_prefix_kv_kept", p.prefix_kv_fp32, ("reward", "ref_logp", "old_logp", "update"),
                           "free", "the trained groups' fp32 K/V leaves, after the rollout"),
               TensorClass("reference_prefix_kv", p.prefix_kv * k, ("rollout",), "free",
                           "computed in the decode window" + rounds),
               TensorClass("reference_prefix_kv_kept", p.prefix_kv, ("reward", "ref_logp"), "free",
                           "the trained groups' reference K/V, until the reference response stage"),
               TensorClass("prefix_kv_grads", p.prefix_kv_fp32, ("update",), "free", "fp32 gK/gV")]
        if p.keep:
            out.append(TensorClass("actor_prefix_graph", s.prompts * p.prefix_graph * k, ("rollout",), "keep",
                                   "every group's saved prefix activations" + rounds))
            out.append(TensorClass("actor_prefix_graph_kept", s.prompts * p.prefix_graph,
                                   ("reward", "ref_logp", "old_logp", "update"), "keep",
                                   "the trained groups' saved prefix activations"))
        return out + scoring_workspaces(p, ("ref_logp", "old_logp"), s.mb * s.R) + [response_stage_activations(p)]

