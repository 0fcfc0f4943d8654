"""The rendered embodied tasks (`envs/motion.py`: `task=reach`, `task=motion`, ...) as a DataSource."""
from __future__ import annotations

import torch

from rollplex_megatron.config import RunConfig
from rollplex_megatron.data.source import Row, Score
from rollplex_megatron.envs.motion import MotionEnv
from rollplex_megatron.schema import refuse_unused_at


class RenderedTask:
    """Episodes drawn from the seed and the step; reward 1 for the right direction plus
    `task.format_reward` for naming any direction (chance: a uniformly random direction)."""

    name = "rendered"

    def __init__(self, cfg: RunConfig):
        self.env = MotionEnv(cfg.task, cfg.model)  # a bad task/model pairing fails here
        # the rendered task scores with its own reward and draws its own prompts: the reward.* and data.* settings
        # of a dataset's rows would be ignored (config.DATASET_REWARD, DATASET_ROWS)
        refuse_unused_at(cfg, "source")
        self.seed = cfg.seed
        self.stop_token_ids = self.env.stop_token_ids
        self.max_new_tokens = cfg.task.max_answer_tokens
        r = cfg.rollout
        if self.max_new_tokens > r.max_response_len:  # the engine would refuse every request of the first step
            raise ValueError(f"task.max_answer_tokens ({self.max_new_tokens}) exceeds rollout.max_response_len "
                             f"({r.max_response_len}); raise rollout.max_response_len or lower task.max_answer_tokens")
        n = self.env.prompt(self.env.episode(0)).input_ids.numel()  # every episode's prompt has this length
        self.longest_prompt = (n, "the rendered task's prompt")  # memory.kv_cache_gib's start-up check
        if n > r.max_prompt_len:
            raise ValueError(f"the rendered task's prompt is {n} tokens (task.image_size, task.frames), over "
                             f"rollout.max_prompt_len={r.max_prompt_len}; raise it or render a smaller task")
        self.chance_accuracy = MotionEnv.chance
        self.chance_reward = MotionEnv.chance + cfg.task.format_reward

    def rows(self, step: int, dp_rank: int, dp_size: int, n: int) -> list[Row]:  # noqa: D102
        base = self.seed * 1_000_003 + step * n * dp_size + dp_rank * n
        episodes = [self.env.episode(base + i) for i in range(n)]
        return [Row(self.env.prompt(e), seed=e.seed * 31 + 17, meta=e) for e in episodes]

    def score(self, row: Row, tokens: torch.Tensor) -> Score:  # noqa: D102
        said = self.env.answer(tokens)
        return Score(self.env.answer_reward(row.meta, said), float(said == row.meta.answer), float(said is not None))

    def shape_prompts(self, k: int) -> list:  # noqa: D102
        return [self.env.prompt(self.env.episode(i)) for i in range(k)]
