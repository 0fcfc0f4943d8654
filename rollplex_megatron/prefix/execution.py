"""Prefix forward before megatron's schedule, response micro-batches through it, prefix backward after.

Actor step (docs/design.md §2):
  1. `prefix_forward(keep_graph=True)`: once per group, the vision tower and the LLM run over
     prompt[:-1] on every pipeline stage; each layer's K/V become autograd leaves (KVStore).
  2. `run_schedule(response micro-batches)`: megatron's `get_forward_backward_func()` (no
     pipelining or 1F1B) runs the packed responses, which read the leaves; backward accumulates
     gK/gV on them. `finalize_model_grads_func` is held back meanwhile.
  3. `prefix_backward`: per group, the accumulated gK/gV (plus, with PP, the gradient of the
     stage output received from the next stage) go once through the saved prefix graph; then
     `finalize_model_grads` (DP reduction, tied-embedding sync) sees every gradient exactly once.
The reference variant runs step 1 without a graph and step 2 forward-only.
The full-sequence path (serial baseline) runs packed [prompt, response] sequences through the same
schedule, model and loss.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch
from megatron.core import parallel_state as ps
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.utils import get_model_config

from rollplex_megatron.attention.kv_store import KVStore
from rollplex_megatron.attention.prefix import PrefixContext
from rollplex_megatron.prefix.batch import Group, MicroBatch, split_token_values
from rollplex_megatron.rl.grpo import policy_logprob_entropy, rows_at
from rollplex_megatron.runtime import device
from rollplex_megatron.spans import span


def unwrap(model):
    """The stage model inside DDP / Float16Module wrappers: it implements the PrefixModel contract."""
    while hasattr(model, "module"):
        model = model.module
    return model


class PrefixModel(Protocol):
    """What the prefix execution needs of a stage model (Qwen25VLModel, api.PrefixGPT).

    `forward(input_ids, position_ids, attention_context, **vision)` is what megatron's schedule calls
    (vocab-parallel logits [B,T,V/TP] on the last stage, hidden [T,B,H] elsewhere), and
    `prefix_stage(prompts, ctx, input_tensor)` runs each prompt[:-1], packed in order, on this stage and
    returns [sum(P-1),1,H].
    """

    config: object  # megatron TransformerConfig (hidden_size)
    pre_process: bool
    post_process: bool

    def prefix_stage(self, prompts, ctx: PrefixContext, input_tensor=None) -> torch.Tensor:
        """The prefix forward of a list of prompts (one, or a pack) on this stage, packed in order."""


@dataclass
class PrefixPack:
    """Several groups' prefixes run as one forward (`workload.prefix_pack_tokens`): one graph, one stage input
    and output, so one backward for all of them (under the recompute plan, one recomputation too). Their
    PrefixStates share this object."""

    length: int  # packed prefix tokens
    received: torch.Tensor | None  # stage input from the previous stage
    output: torch.Tensor | None  # stage output sent to the next stage (None until recomputed)
    groups: list[Group] | None = None  # recompute plan: the pack's groups, in pack order


@dataclass
class PrefixState:
    """What the prefix backward of one group needs on this stage."""

    group: int  # group id in the K/V store
    length: int  # prefix tokens
    received: torch.Tensor | None  # stage input from the previous stage (grad flows back to it)
    output: torch.Tensor | None  # stage output sent to the next stage (None until recomputed)
    prompt: Group | None = None  # recompute plan: the group whose prefix forward runs again at backward
    pack: PrefixPack | None = None  # set when the group's prefix ran packed with others (received/output there)
    pack_pos: int = 0  # the group's place in its pack


def mini_batch_slices(n: int, m: int) -> list[list[int]]:
    """`m` consecutive slices of `n` groups: the PPO mini-batches (`train.ppo_mini_batches`)."""
    return [list(range(i * n // m, (i + 1) * n // m)) for i in range(m)]


def mini_batch_starts(n: int, m: int) -> frozenset[int]:
    """The groups (of `n`) that open a PPO mini-batch after the first: no prefix pack spans one, so every phase
    that packs the whole batch (the rollout's prefill, the window's reference items, scoring) packs each group
    with the same neighbours as the update of its mini-batch does; the same kernels give the same rounding, and
    a step whose gradient is exactly 0 in serial (all rewards equal at the first step) is 0 here too."""
    return frozenset(sl[0] for sl in mini_batch_slices(n, m)[1:] if sl)


def prefix_packs(lengths: list[int], pack_tokens: int, starts: frozenset[int] = frozenset()) -> list[list[int]]:
    """Consecutive indices of `lengths` in packs of at most `pack_tokens` prefix tokens (a longer prefix goes
    alone); `pack_tokens` 0: one each; an index in `starts` opens a new pack (`mini_batch_starts`). Every
    pipeline stage packs the same groups the same way."""
    packs: list[list[int]] = []
    total = 0
    for i, n in enumerate(lengths):
        if packs and pack_tokens > 0 and total + n <= pack_tokens and i not in starts:
            packs[-1].append(i)
            total += n
        else:
            packs.append([i])
            total = n
    return packs


def p2p_communicator(model) -> P2PCommunicator:
    """Megatron's stage-to-stage communicator for this model's pipeline group."""
    return P2PCommunicator(pp_group=ps.get_pipeline_model_parallel_group(), config=get_model_config(model))


def record_context(store: KVStore, group_ids: list[int], lens: list[int], keep_graph: bool,
                   trainable: bool = False) -> PrefixContext:
    """The record context of one pack of prefixes (one group, or several packed in order with their lengths)."""
    several = len(group_ids) > 1
    return PrefixContext(mode="record", store=store, group=group_ids[0], keep_graph=keep_graph, trainable=trainable,
                         groups=tuple(group_ids) if several else (), lens=tuple(lens) if several else ())


def prefix_forward(model, groups: list[Group], store: KVStore, keep_graph: bool,
                   group_ids: list[int] | None = None, recompute: bool = False,
                   pack_tokens: int = 0, pack_starts: frozenset[int] = frozenset()) -> list[PrefixState]:
    """Step 1 on this stage for every group, in group order (the order every stage uses).

    `group_ids` name the groups in the store (default 0..n-1), e.g. when a rollout prefills in waves.
    `recompute` (actor, instead of `keep_graph`): no graph is saved; the store gets trainable K/V
    leaves, and `prefix_backward` re-runs one group's (or pack's) prefix forward at a time from its stage
    input (the prompt on the first stage, the received hidden states on later ones).
    `pack_tokens` > 0: consecutive groups run as one forward of up to that many prefix tokens (fewer, larger
    kernels; each group still attends to its own prefix alone); under `recompute` the backward recomputes a
    pack at a time, holding one pack's graph. A group whose id is in `pack_starts` opens a new pack.
    """
    m, p2p = unwrap(model), p2p_communicator(model)
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    if keep_graph and recompute:
        raise ValueError("prefix_forward: keep_graph and recompute exclude each other")
    states = []
    ids = list(range(len(groups))) if group_ids is None else list(group_ids)
    lens = [g.prompt.input_ids.numel() - 1 for g in groups]
    for pack in prefix_packs(lens, pack_tokens, frozenset(j for j, i in enumerate(ids) if i in pack_starts)):
        n = sum(lens[i] for i in pack)
        recv = None if first else p2p.recv_forward((n, 1, m.config.hidden_size), first)
        ctx = record_context(store, [ids[i] for i in pack], [lens[i] for i in pack], keep_graph, recompute)
        with torch.set_grad_enabled(keep_graph), span("prefix_forward"):
            out = m.prefix_stage([groups[i].prompt for i in pack], ctx, recv)
        if not last:
            p2p.send_forward(out.detach() if not keep_graph else out, last)
        if recompute:  # the backward re-runs the forward from its stage input: no output kept
            recv, out = None if recv is None else recv.detach(), None
        if len(pack) == 1:
            states.append(PrefixState(ids[pack[0]], n, recv, out, groups[pack[0]] if recompute else None))
        else:
            shared = PrefixPack(n, recv, out, [groups[i] for i in pack] if recompute else None)
            states += [PrefixState(ids[i], lens[i], None, None, groups[i] if recompute else None, shared, j)
                       for j, i in enumerate(pack)]
    return states


def _recompute(m, st: PrefixState, store: KVStore) -> tuple[PrefixState, dict, torch.Tensor]:
    """Re-run one group's prefix forward with a graph; also returns (on the device) the largest
    difference between its K/V and the stored leaves, which must be 0."""
    graph = KVStore(graph_only=True)
    recv = None if st.received is None else st.received.detach().requires_grad_()
    ctx = PrefixContext(mode="record", store=graph, group=st.group, keep_graph=True)
    with torch.enable_grad():
        out = m.prefix_stage([st.prompt.prompt], ctx, recv)
    return PrefixState(st.group, st.length, recv, out), graph.graph, _drift(graph.graph, store)


def _drift(graph: dict, store: KVStore) -> torch.Tensor:
    """The largest difference (on the device) between recomputed K/V and the stored leaves: 0 when the
    forward is deterministic."""
    return torch.stack([(t.detach().float() - leaf.detach()).abs().max()
                        for key, kv in graph.items() for t, leaf in zip(kv, store.leaves[key])]).max()


def _recompute_pack(m, pack: PrefixPack, members: list[PrefixState], store: KVStore):
    """Re-run a pack's prefix forward with a graph (every group of the pack, as the forward ran it); returns
    its state, the graph tensors of the `members` present under their ids, and the drift as `_recompute`."""
    graph = KVStore(graph_only=True)
    recv = None if pack.received is None else pack.received.detach().requires_grad_()
    lens = tuple(g.prompt.input_ids.numel() - 1 for g in pack.groups)
    ctx = PrefixContext(mode="record", store=graph, keep_graph=True, groups=tuple(range(len(lens))), lens=lens)
    with torch.enable_grad():
        out = m.prefix_stage([g.prompt for g in pack.groups], ctx, recv)
    ids = {x.pack_pos: x.group for x in members}  # ids may have changed since the forward (adopted groups)
    kv = {(layer, ids[pos]): t for (layer, pos), t in graph.graph.items() if pos in ids}
    return PrefixState(members[0].group, pack.length, recv, out), kv, _drift(kv, store)


def prefix_backward(model, states: list[PrefixState], store: KVStore) -> None:
    """Step 3 on this stage: one backward per group, or per pack of groups, through its prefix graph (saved
    or recomputed); a pack's backward takes every member in `states` at its first member.

    Recomputed groups hold one group's (or pack's) graph at a time; `store.recompute_drift` records the largest
    difference between recomputed and stored K/V (0 when the forward is deterministic)."""
    m, p2p = unwrap(model), p2p_communicator(model)
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    hidden = m.config.hidden_size
    drifts, done = [], set()
    for st in states:
        graph = None
        if st.pack is not None:
            if id(st.pack) in done:
                continue
            done.add(id(st.pack))
            present = [x for x in states if x.pack is st.pack]
            members = [x.group for x in present]
            if st.pack.groups is not None:
                with span("prefix_recompute"):
                    st, graph, drift = _recompute_pack(m, st.pack, present, store)
                drifts.append(drift)
            else:
                st = PrefixState(members[0], st.pack.length, st.pack.received, st.pack.output)
        else:
            members = [st.group]
            if st.prompt is not None:
                with span("prefix_recompute"):
                    st, graph, drift = _recompute(m, st, store)
                drifts.append(drift)
        with span("prefix_backward"):
            _backward_one(st, members, graph, store, p2p, first, last, hidden)
    if drifts:  # one read for all groups, after the backward work is issued
        store.recompute_drift = max(store.recompute_drift, float(torch.stack(drifts).max()))


def logprob_loss(mb: MicroBatch, logits_BTV: torch.Tensor, temperature: float = 1.0, banned: tuple[int, ...] = (),
                 tp_rank: int = 0, tp_group=None, kernel: str = "torch"):
    """The scoring phases' loss function: log-probs of the labels under the policy the rollout sampled
    from (`rl.grpo.policy_logits`; `kernel`: `rl.grpo.policy_logprob_entropy`'s), and the
    advantage-weighted log-likelihood of `mb.weight`."""
    logp, _ = policy_logprob_entropy(logits_BTV, mb.labels, temperature, banned, tp_rank, tp_group, kernel=kernel)
    loss = -(logp * mb.weight).sum()
    n = mb.label_mask.sum().to(torch.int)
    return loss, n, {"loss": loss.detach(), "logp": rows_at(logp.detach(), mb.label_at)}


def _step(micro_batches: list[MicroBatch], ctx_for, loss_fn, data_iterator, model):
    mb = micro_batches[next(data_iterator)]
    with span("forward"):
        out = model(input_ids=mb.input_ids, position_ids=mb.position_ids, attention_context=ctx_for(mb),
                    **mb.vision)
    return out, partial(_loss, loss_fn, mb)


def _loss(loss_fn, mb: MicroBatch, output):
    with span("loss"):
        return loss_fn(mb, output)


def run_schedule(model, micro_batches: list[MicroBatch], ctx_for, forward_only: bool, loss_fn=None) -> list[dict]:
    """Packed micro-batches through megatron's schedule; returns the last stage's per-micro-batch dicts.

    `loss_fn(mb, logits) -> (loss, tokens, dict)` (megatron's per-token-loss contract); the default
    is `logprob_loss` at temperature 1. Dicts hold at least "loss" and "logp".
    """
    config = get_model_config(model)
    saved = config.finalize_model_grads_func, config.variable_seq_lengths
    config.finalize_model_grads_func = None  # prefix gradients must be in before DP reduction
    config.variable_seq_lengths = True  # packed micro-batches differ in length
    try:
        with span("schedule"):
            return get_forward_backward_func()(
                forward_step_func=partial(_step, micro_batches, ctx_for, loss_fn or logprob_loss),
                data_iterator=iter(range(len(micro_batches))), model=[model],
                num_microbatches=len(micro_batches), seq_length=max(mb.input_ids.shape[1] for mb in micro_batches),
                micro_batch_size=1, forward_only=forward_only)
    finally:
        config.finalize_model_grads_func, config.variable_seq_lengths = saved


def _backward_one(st: PrefixState, members: list[int], graph: dict | None, store: KVStore, p2p, first: bool,
                  last: bool, hidden: int) -> None:
    """The backward through one group's (or pack's) prefix graph on this stage, then its K/V released."""
    outs, grads = [], []
    for g in members:
        o, gr = store.backward_pairs(g, graph)
        outs += o
        grads += gr
    if not last:
        outs.append(st.output)
        grads.append(p2p.recv_backward((st.length, 1, hidden), last))
    if outs:
        torch.autograd.backward(outs, grads)
    if not first:
        g = st.received.grad if st.received.grad is not None else torch.zeros_like(st.received)
        p2p.send_backward(g, first)
    for g in members:
        store.release(g)


def finalize(model) -> None:
    """DP gradient reduction and embedding-group sync, after every backward of the step."""
    with span("finalize_grads"):
        finalize_model_grads([model])


def actor_prefix_step(model, groups: list[Group], micro_batches: list[MicroBatch],
                      backend: str = "auto", loss_fn=None, recompute: bool = False,
                      select: list[int] | None = None, pack_tokens: int = 0) -> list[dict]:
    """Prefix/response forward+backward of the actor; gradients finalised. Returns loss dicts.

    `recompute`: keep no prefix graph; each group's prefix is recomputed at its prefix backward.
    `select`: the micro-batches hold only these groups (a PPO mini-batch); only their prefixes run.
    `pack_tokens`: `prefix_forward`'s packing."""
    dev = device()
    mbs = [mb.to(dev) for mb in micro_batches]
    store = KVStore()
    ids = list(range(len(groups))) if select is None else list(select)
    states = prefix_forward(model, [groups[i] for i in ids], store, keep_graph=not recompute, recompute=recompute,
                            group_ids=ids, pack_tokens=pack_tokens)
    res = run_schedule(model, mbs, lambda mb: PrefixContext(mode="use", layout=mb.layout, store=store,
                                                            backend=backend), forward_only=False, loss_fn=loss_fn)
    prefix_backward(model, states, store)
    finalize(model)
    return res


def reference_prefix_logprobs(model, groups: list[Group], micro_batches: list[MicroBatch],
                              backend: str = "auto", loss_fn=None, pack_tokens: int = 0,
                              pack_starts: frozenset[int] = frozenset()) -> list[dict]:
    """Reference variant: prefix K/V without a graph (`pack_tokens`, `pack_starts`: `prefix_forward`'s
    packing), response stage forward-only."""
    dev = device()
    mbs = [mb.to(dev) for mb in micro_batches]
    store = KVStore()
    with torch.no_grad():
        prefix_forward(model, groups, store, keep_graph=False, pack_tokens=pack_tokens, pack_starts=pack_starts)
        return run_schedule(model, mbs, lambda mb: PrefixContext(mode="use", layout=mb.layout, store=store,
                                                                 backend=backend), forward_only=True,
                            loss_fn=loss_fn)


def full_sequence_step(model, micro_batches: list[MicroBatch], forward_only: bool = False,
                       backend: str = "auto", loss_fn=None) -> list[dict]:
    """The serial baseline: every response with its whole prompt, same schedule, model and loss."""
    dev = device()
    mbs = [mb.to(dev) for mb in micro_batches]
    res = run_schedule(model, mbs, lambda mb: PrefixContext(mode="packed", layout=mb.layout, backend=backend),
                       forward_only=forward_only, loss_fn=loss_fn)
    if not forward_only:
        finalize(model)
    return res


def per_response(results: list[dict], mbs: list[MicroBatch], groups: list[Group]) -> dict | None:
    """Per-response log-probs {(group, response): [R]}; None on pipeline stages before the last."""
    if not ps.is_pipeline_last_stage():
        return None
    return split_token_values(results, mbs, groups, "logp")


def response_logprobs(model, micro_batches: list[MicroBatch], store: KVStore, backend: str = "auto",
                      loss_fn=None, release: bool = True) -> list[dict]:
    """A forward-only response stage over prefix K/V computed earlier: the reference's (the decode
    window's; `release`: the store is emptied after, its last consumer) or the rollout's actor
    prefix (the old log-probs of later PPO mini-batches; the store stays for the update)."""
    dev = device()
    mbs = [mb.to(dev) for mb in micro_batches]
    with torch.no_grad():
        res = run_schedule(model, mbs, lambda mb: PrefixContext(mode="use", layout=mb.layout, store=store,
                                                                backend=backend), forward_only=True,
                           loss_fn=loss_fn)
    if release:
        store.leaves.clear()
    return res


def actor_response_step(model, micro_batches: list[MicroBatch], store: KVStore, states: list[PrefixState],
                        backend: str = "auto", loss_fn=None) -> tuple[list[dict], dict]:
    """The Rollplex update after a rollout whose prefill was the actor prefix stage: response
    micro-batches through the schedule over the stored K/V leaves, the prefix backward once per
    group, then the gradient finalisation. Returns the loss dicts and the prefix K/V byte counts."""
    dev = device()
    mbs = [mb.to(dev) for mb in micro_batches]
    res = run_schedule(model, mbs, lambda mb: PrefixContext(mode="use", layout=mb.layout, store=store,
                                                            backend=backend), forward_only=False, loss_fn=loss_fn)
    kv_bytes, kv_grad_bytes = store.nbytes()
    prefix_backward(model, states, store)
    finalize(model)
    return res, {"actor_prefix_kv_bytes": kv_bytes, "prefix_kv_grad_bytes": kv_grad_bytes,
                 "prefix_recompute_drift": store.recompute_drift}
