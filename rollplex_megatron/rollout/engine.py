"""The RolloutEngine contract: what the trainer asks of any rollout engine (embedded, SGLang).

Legend: G = samples per request (a GRPO group), R = generated tokens of one sample.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Protocol

import torch

from rollplex_megatron.prefix.batch import Prompt
from rollplex_megatron.rollout.sampling import SamplingParams


@dataclass
class RolloutRequest:
    """One prompt to sample `n` responses for."""

    prompt: Prompt
    n: int  # G samples sharing this prompt
    max_new_tokens: int  # per-request length limit
    stop_token_ids: tuple[int, ...] = ()  # a sample ends after emitting one of these (kept in its tokens)
    seed: int = 0  # sampling seed of this request (same seed, same tokens)


@dataclass
class RolloutResult:
    """The `n` samples of one request."""

    tokens: list[torch.Tensor]  # G tensors [R] long (CPU)
    logprobs: list[torch.Tensor]  # G tensors [R] float32: log-probs of the temperature-scaled logits
    finish_reasons: list[str]  # "stop" (stop token) or "length" (max_new_tokens reached)


@dataclass
class RolloutOutput:
    """What `generate` returns: results in request order, plus what the trainer may reuse."""

    results: list[RolloutResult]
    prefix_states: list = field(default_factory=list)  # actor prefix states when prefill recorded them
    stats: dict = field(default_factory=dict)  # decode steps, waves, seconds per part


class DecodeHooks:
    """Callbacks of the decode loop; every method is a no-op here (the decode window overrides them),
    so the engine calls them unconditionally."""

    def on_wave(self, samples: int) -> None:
        """A wave starts decoding `samples` samples."""

    def decode_stream(self):
        """The CUDA stream to decode on (None: the current one)."""
        return None

    def capture_guard(self):
        """A context manager held while the engine captures a CUDA graph (side work issued from other
        threads pauses there)."""
        return nullcontext()

    def on_decode_step(self, step: int, active: int) -> None:
        """Called after every decode step with the number of still-active samples."""

    def on_idle(self) -> None:
        """Called once when decoding is over (drain whatever is left)."""

    def abort(self) -> None:
        """The rollout failed: stop side work now."""

    def take_items(self) -> list:
        """The queued side work, handed to an engine that runs it elsewhere (SGLang's scheduler); none here."""
        return []

    def ran_elsewhere(self, items: list) -> None:
        """The items `take_items` handed out, run and marked done by that engine."""


class RolloutEngine(Protocol):
    """Generate G samples per request. The trainer depends on this contract only.

    `actor_prefix`, when given (a `KVStore`), asks the engine to run its prefill as the actor's
    prefix stage: with autograd recording, storing the K/V leaves under the request index, and
    returning the prefix states for the later prefix backward. With `recompute_prefix` the prefill
    keeps no graph, only trainable K/V leaves, and the prefix backward recomputes the graph.
    Engines that cannot (external ones, or the embedded engine at its own layout) say so with
    `prefill_is_actor_prefix = False` and raise NotImplementedError when asked, and the trainer
    schedules the actor prefix stage itself (decode-window work).
    """

    prefill_is_actor_prefix: bool
    # the decode window's items run in another process (SGLang's scheduler, `take_items`): each is a `PrefixJob`,
    # one group an item; else they run here as functions, several groups' prefixes an item where packed
    window_items_elsewhere: bool
    # the loop's phase after a step's optimizer steps in which `sync_weights()` brings the rollout's
    # weights up to date (weight_refresh: rebuilt views; weight_transfer: sent to other ranks), or None
    weights_phase: str | None
    collective: bool  # generate is collective over every rank (ranks must agree on how often they call it)

    def sync_weights(self) -> float:
        """Bring the rollout's weights to the training weights after an optimizer step; seconds."""

    def generate(self, requests: list[RolloutRequest], params: SamplingParams,
                 hooks: DecodeHooks | None = None, actor_prefix=None,
                 recompute_prefix: bool = False) -> RolloutOutput:
        """Sample every request; results in request order."""
