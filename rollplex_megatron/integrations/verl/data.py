"""verl's reward hook for this project's datasets (`make-example`'s format is verl's).

`compute_score` (`reward.custom_reward_function.path=pkg://rollplex_megatron.integrations.verl.data`): verl's
reward-function signature over this project's built-in rewards (`data/rewards.py`), chosen by the row's
`data_source`.
"""
from __future__ import annotations

from rollplex_megatron.data.rewards import BUILTINS


def compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None, **kwargs) -> dict:
    """verl's reward function: the built-in reward named by `data_source` (its `score` is verl's reward)."""
    fn = BUILTINS.get(data_source)
    if fn is None:
        raise ValueError(f"rollplex reward: data_source {data_source!r} names no built-in reward (one of "
                         f"{', '.join(sorted(BUILTINS))})")
    return fn(solution_str, ground_truth, dict(extra_info or {}))
