"""The DataSource contract: what the trainer asks of any source of prompts and rewards.

A source hands each data-parallel rank its rows of a step (deterministic in seed, step and rank),
says when a response ends, and scores responses. Rendered tasks (`rendered.py`) are one source;
datasets on disk are others. A new source is one file in this folder plus one line in `SOURCES`
(`data/__init__.py`); `data.source` selects it. Validation runs (`trainer/validation.py`) also ask
for `val_rows(dp_rank, dp_size, max_rows)` and `val_sources(max_rows)`, which the dataset source has
(`data.val_files` requires it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from rollplex_megatron.prefix.batch import Prompt


@dataclass
class Row:
    """One prompt of a step, with what scoring it needs."""

    prompt: Prompt
    seed: int  # sampling seed of the row's group (same seed, same tokens)
    meta: Any = None  # the source's own record (ground truth, episode, ...)


@dataclass(frozen=True)
class Score:
    """One response's reward, whether it was right, and whether it gave an answer at all."""

    reward: float
    correct: float  # 1.0 / 0.0
    answered: float  # 1.0 / 0.0
    extra: dict = field(default_factory=dict)


class DataSource(Protocol):
    """Rows and rewards for the GRPO loop."""

    stop_token_ids: tuple[int, ...]  # a response ends after one of these
    max_new_tokens: int  # longest response
    longest_prompt: tuple[int, str]  # the longest prompt's tokens (after truncation) and what it is, for errors
    chance_reward: float | None  # reward of a random valid answer (reported next to the curve), if known
    chance_accuracy: float | None

    def rows(self, step: int, dp_rank: int, dp_size: int, n: int) -> list[Row]:
        """This rank's `n` rows of `step`."""

    def score(self, row: Row, tokens: torch.Tensor) -> Score:
        """The score of one response (its tokens, stop token included)."""

    def shape_prompts(self, k: int) -> list[Prompt]:
        """`k` representative prompts (the memory planner sizes the run by the largest)."""
