"""Prefix K/V a `rollplex` rollout computed in verl's worker process, held there for the scoring phases after it.

Under `rollout.name=rollplex` the rollout decodes on the actor's own modules inside verl's worker process
(`rollout.py`), so two prefix stages of a step are done there before verl scores the batch (docs/design.md §2,
the same rules as the embedded trainer's `rollplex` mode):
- the actor's: the rollout's prefill *is* the actor prefix stage (same modules, same layout, the step's weights),
  so verl's old log-probs (`compute_log_prob`) read its K/V instead of running each prompt again;
- the reference's: run in the engine's decode window (`rollout/window`) between decode steps, on the reference
  engine's modules in the same process, for verl's `compute_ref_log_prob`.
A scoring phase takes the K/V of each group whose prompt equals a held one bit for bit (ids and every processor
tensor) at the same weights (the actor's optimizer-step count), and computes the others itself: a group verl
placed on another DP rank than the replica that sampled it, a rollout that held nothing, weights that moved.
Held K/V live until that phase, or until the next rollout round starts. The update is unchanged.
"""
from __future__ import annotations

import zlib

import torch

from rollplex_megatron.attention.kv_store import KVStore
from rollplex_megatron.integrations.verl.batch import same_prompt
from rollplex_megatron.prefix.batch import Prompt


def ids_key(ids: torch.Tensor) -> int:
    """A prompt's lookup key from its token ids (int64); equality is still checked on the whole prompt."""
    return zlib.crc32(ids.detach().cpu().to(torch.int64).numpy().tobytes())


def prompt_key(prompt: Prompt) -> int:
    """`ids_key` of a prompt."""
    return ids_key(prompt.input_ids)


def held_pins(held: list[tuple[int, list[int]]], uid_keys: dict) -> dict:
    """{uid: DP rank} for each uid whose prompt key ({uid: key}) a rank's rollout holds K/V for ([(DP rank, keys)];
    the lowest such rank where several replicas sampled the prompt)."""
    where: dict = {}
    for rank, keys in sorted(held):
        for k in keys:
            where.setdefault(k, rank)
    return {u: where[k] for u, k in uid_keys.items() if k in where}


class HeldPrefixes:
    """One engine's held prefix K/V ({prompt key: [(prompt, K/V per layer, weights version)]}); see the module."""

    def __init__(self, role: str):
        self.role = role  # actor (the rollout's prefill) | reference (the decode window)
        self.entries: dict[int, list[tuple[Prompt, dict, int]]] = {}
        self.round: int | None = None
        self.last: dict = {}  # the last scoring phase: groups whose prefix came from the rollout, computed
        self.totals = {"held": 0, "from_rollout": 0, "computed": 0, "stale": 0}

    def start_round(self, round_: int) -> None:
        """A rollout round (verl's rollout between two sleeps) starts: what an earlier round held is dropped."""
        if round_ != self.round:
            self.entries.clear()
            self.last = {}
            self.round = round_

    def hold(self, prompt: Prompt, store: KVStore, group: int, version: int, dtype: torch.dtype) -> None:
        """Keep group `group` of `store` for `prompt`, as plain K/V in the compute dtype: the actor's prefill
        records fp32 trainable masters (exact copies of the K/V), which scoring reads without gradients."""
        kv = {layer: (k.detach().to(dtype), v.detach().to(dtype))
              for (layer, g), (k, v) in store.leaves.items() if g == group}
        self.entries.setdefault(prompt_key(prompt), []).append((prompt.to("cpu"), kv, version))
        self.totals["held"] += 1

    def adopt(self, vg, todo: list[int], store: KVStore, version: int) -> list[int]:
        """Put the held K/V of each group in `todo` whose prompt and weights match into `store`; returns the
        groups that still need their prefix stage. Several groups may read one held prompt (verl's uids of one
        prompt); everything held is dropped afterwards (the phase scored every group it will score)."""
        left, stale = [], 0
        for g in todo:
            prompt = vg.groups[g].prompt.to("cpu")
            entry = next((e for e in self.entries.get(prompt_key(prompt), []) if same_prompt(e[0], prompt)), None)
            if entry is None or entry[2] != version:
                stale += entry is not None
                left.append(g)
                continue
            for layer, kv in entry[1].items():
                store.leaves[(layer, g)] = kv
        self.entries.clear()
        self.last = {"from_rollout": len(todo) - len(left), "computed": len(left), "stale": stale}
        for k, v in self.last.items():
            self.totals[k] += v
        return left
