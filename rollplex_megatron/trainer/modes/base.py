"""The contract of an execution mode: its phases, what it keeps in memory, and its step.

A mode is chosen once from `mode.name` (registry: `trainer/modes/__init__.py`). It declares the
phases of one step in order (the timer's and the memory planner's), where the phase plan keeps the
reference weights, and the tensor classes only it holds (`memory_classes`, read by the planner).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from rollplex_megatron.dist import train_world
from rollplex_megatron.memory.classes import PlanInputs, TensorClass
from rollplex_megatron.prefix import batch as B


@dataclass
class Prepared:
    """A step after its rollout and scoring phases: what its updates read."""

    batch: object  # trainer.runtime.StepBatch: the groups trained on
    minis: list  # trainer.runtime.MiniBatch, in update order
    mbs: list  # per mini-batch: its micro-batches (token data attached)
    old: dict | None  # {(group, response): [R]} the rollout policy's log-probs where known (None off the last stage)
    stats: dict  # rollout and mode statistics for the record
    state: dict = field(default_factory=dict)  # the mode's own (K/V stores, prefix states)

    def flat(self, minis=None) -> list:
        """The micro-batches of `minis` (indices; default all) in update order."""
        return [mb for m in (range(len(self.mbs)) if minis is None else minis) for mb in self.mbs[m]]

    def attach(self, name: str, per_response: dict | None, minis=None) -> None:
        """Lay per-response values on the micro-batches of `minis` (default all)."""
        B.attach_token_data(self.flat(minis), name, per_response)

    def record_old(self, per_response: dict | None, minis=None) -> None:
        """The rollout policy's log-probs of `minis`: kept for the record and laid on their
        micro-batches (every update after the first of a mini-batch reads them)."""
        if per_response is None:
            return
        self.old = {**(self.old or {}), **per_response}
        self.attach("old_logp", per_response, minis)


class Mode(ABC):
    """One execution strategy of the GRPO step; every mode computes the same update.

    `prepare` runs the rollout and the scoring phases; `update` runs one mini-batch's forward and
    backward (the loop steps the optimizer after each, `train.ppo_epochs` passes over the
    mini-batches). `fresh` marks the step's first update, the only one at the rollout's weights.
    """

    name: str
    phases: tuple[str, ...]  # the phases of one step, in order
    reference_phases: tuple[str, ...]  # where memory.plan=phase keeps the reference weights
    full_sequences = False  # micro-batches carry each response's whole prompt (planner.full_sequence_responses)

    @abstractmethod
    def prepare(self, rt, step: int, t) -> Prepared:
        """Rollout, reward and scoring phases of one step."""

    @abstractmethod
    def update(self, rt, prep: Prepared, m: int, fresh: bool) -> list[dict]:
        """Forward and backward of mini-batch `m` (gradients finalised); its loss dicts."""

    @staticmethod
    @abstractmethod
    def memory_classes(p: PlanInputs) -> list[TensorClass]:
        """The tensor classes of this mode's prefix work, scoring workspaces and update activations."""

    @staticmethod
    def rollout(rt, t, round_kwargs=None):
        """Rollout and scoring, shared by every mode: one round, or with `train.dynamic_sampling`
        rounds of fresh prompts until this rank has `prompts_per_rank` groups whose rewards are not all
        equal (or `train.max_resample_rounds` extra rounds ran).

        `round_kwargs(round, requests)` gives the engine's keyword arguments of a round (the decode
        window, the actor prefix store). Returns the batch trained on, the (round, group) of each of
        its groups, the engine outputs per round and the statistics. Advances `rt.data_cursor` by the
        largest round count over the ranks, so the stream stays the same on every rank and resumes."""
        tc = rt.cfg.train
        need = rt.cfg.prompts_per_rank
        rounds, outs = [], []
        for r in range(1 + (tc.max_resample_rounds if tc.dynamic_sampling else 0)):
            rows, reqs = rt.requests(rt.data_cursor + r)
            kw = round_kwargs(r, reqs) if round_kwargs is not None else {}
            with t("rollout"):
                out = rt.engine.generate(reqs, rt.sampling, **kw)
            with t("reward"):
                rounds.append(rt.score(rows, reqs, out))
            outs.append(out)
            enough = not tc.dynamic_sampling or sum(sum(b.informative()) for b in rounds) >= need
            if rt.engine.collective:  # the rollout replicas' generate is collective: every rank samples each round
                flag = torch.tensor([int(enough)], device=rt.dev)
                dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=train_world())
                enough = bool(flag)
            if enough:
                break
        picks = [(r, i) for r, b in enumerate(rounds) for i in range(len(b.groups))]
        stats = sum_stats([o.stats for o in outs])
        if tc.dynamic_sampling:
            used = torch.tensor([len(rounds)], device=rt.dev)
            dist.all_reduce(used, op=dist.ReduceOp.MAX, group=train_world())
            rt.data_cursor += int(used)
            picks, stats["dynamic_sampling"] = _select(rt, rounds, need)
        else:
            rt.data_cursor += 1
        at = {p: k for k, p in enumerate((r, i) for r, b in enumerate(rounds) for i in range(len(b.groups)))}
        batch = type(rounds[0]).concat(rounds).take([at[p] for p in picks])
        return batch, picks, outs, stats


def sum_stats(per_round: list[dict]) -> dict:
    """Rounds' statistics added up (numbers), or the first round's (anything else)."""
    out = dict(per_round[0])
    for st in per_round[1:]:
        for k, v in st.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k in out:
                out[k] += v
    return out


def _select(rt, rounds: list, need: int) -> tuple[list, dict]:
    """DAPO's filter: the first `need` informative groups in sampling order; when the rounds ran out,
    the batch is filled with uninformative groups (advantage 0: only the KL and entropy terms act on
    them) so every step trains on the same number of groups. Global counts for the record."""
    flags = [(r, i, ok) for r, b in enumerate(rounds) for i, ok in enumerate(b.informative())]
    good = [(r, i) for r, i, ok in flags if ok]
    fill = [(r, i) for r, i, ok in flags if not ok][:max(need - len(good), 0)]
    picks = sorted(good[:need] + fill)
    rewards = torch.cat([b.rewards for b in rounds])
    vals = torch.tensor([len(flags), len(flags) - len(good), len(fill), max(len(good) - need, 0),
                         float(rewards.sum()), float(rewards.numel()), len(rounds)],
                        dtype=torch.float64, device=rt.dev)
    dist.all_reduce(vals, group=rt.dp_group)
    n = vals.tolist()
    return picks, {"sampled_groups": int(n[0]), "uninformative_groups": int(n[1]), "filled_groups": int(n[2]),
                   "surplus_groups": int(n[3]), "sampled_reward_mean": n[4] / max(n[5], 1.0),
                   "rounds_mean": n[6] / rt.dp_size}


def scoring_workspaces(p: PlanInputs, phases: tuple[str, ...], tokens: int, packed: bool = True) -> list[TensorClass]:
    """One micro-batch's loss workspace per forward-only scoring phase: packed rows (one row of responses over
    stored prefix K/V) count the log-prob kernel that runs (`PlanInputs.score_logits`); serial's whole sequences
    (`packed=False`) count the training loss's workspace, their measured peaks being above the kernel's logits and
    copy (docs/concepts/memory.md)."""
    return [TensorClass(f"{ph}_workspace", p.score_logits(tokens) if packed else p.logits(tokens), (ph,), "free",
                        "one micro-batch's loss workspace (forward only)") for ph in phases]


def response_stage_activations(p: PlanInputs) -> TensorClass:
    """The update's activations when responses run as a response stage over stored prefix K/V."""
    s = p.shape
    act, note = p.activations(s.mb * s.R, 0, packed=True), "one response micro-batch"
    if not p.keep:
        act, note = max(act, p.pack_groups * p.prefix_graph), note + ", or one recomputed pack's prefix graph " \
            f"({p.pack_groups} group(s); the larger)"
    return TensorClass("update_activations", act, ("update",), "free", note)
