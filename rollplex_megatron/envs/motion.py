"""A small embodied task with a verifiable reward, asked about a short video of coloured squares.

Two questions share the scene, the vocabulary and the reward (1 for the right direction, else 0;
chance level 1/4):
- `motion`: which way did the named object move? The target (named by colour) moves a fixed number
  of pixels per frame in one of four directions; the others stay put or jitter. The image variant
  shows one frame with a fading trail.
- `reach`: which way should the agent go to reach the named object? The agent (a grey marker) sits
  at the centre; the target lies left of, right of, above or below it, off-axis by less than its
  distance, so exactly one action is right. Distractors stand elsewhere and jitter across frames.
The model answers with one direction token; the environment checks it. Seeds make every episode
deterministic; difficulty comes from the number of distractors, the step size, the jitter and the
frame count, so the same task serves as a long-prefix benchmark workload (more frames, larger
frames).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rollplex_megatron.config import TASK_MAX_OBJECTS, TASK_QUESTIONS, MotionTaskConfig
from rollplex_megatron.envs.vision import normalize, patchify
from rollplex_megatron.models.registry import model_spec
from rollplex_megatron.prefix.batch import Prompt

DIRECTIONS = ("left", "right", "up", "down")
COLORS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (50, 80, 220), "yellow": (230, 200, 40),
          "purple": (150, 60, 180), "cyan": (40, 200, 200), "white": (235, 235, 235), "orange": (240, 130, 30)}
_STEP = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}
QUESTIONS = TASK_QUESTIONS
assert len(COLORS) == TASK_MAX_OBJECTS
AGENT_RGB = (128, 128, 128)  # the reach question's agent marker (no object colour is grey)


@dataclass
class Episode:
    """One deterministic episode."""

    seed: int
    frames: torch.Tensor  # [T, 3, H, W] uint8
    color: str  # target colour named in the instruction
    answer: str  # correct direction


def _draw(canvas: np.ndarray, y: int, x: int, size: int, rgb) -> None:
    canvas[:, y:y + size, x:x + size] = np.array(rgb, dtype=np.uint8)[:, None, None]


def _reach_episode(cfg: MotionTaskConfig, seed: int) -> Episode:
    rng = np.random.default_rng(seed)
    colors = list(rng.choice(list(COLORS), size=cfg.num_objects, replace=False))
    answer = DIRECTIONS[int(rng.integers(4))]
    size, obj, half = cfg.image_size, cfg.object_px, cfg.image_size // 2
    dist = int(rng.integers(obj, half - obj // 2 - obj % 2 + 1))  # centre-to-centre along the answer axis
    off = int(rng.integers(-(dist // 2), dist // 2 + 1))  # across it, strictly smaller than dist
    dy, dx = _STEP[answer]
    centre = np.array([half + dy * dist + (off if dx else 0), half + dx * dist + (off if dy else 0)])
    clip = lambda p: np.clip(p, 0, size - obj)  # noqa: E731
    target = clip(centre - obj // 2)
    others = [rng.integers(0, size - obj + 1, size=2) for _ in colors[1:]]
    agent = half - obj // 4
    frames = []
    for _ in range(max(cfg.frames, 1)):
        canvas = np.full((3, size, size), 20, dtype=np.uint8)
        for name, p in zip(colors[1:], others):
            j = rng.integers(-cfg.jitter_px, cfg.jitter_px + 1, size=2) if cfg.jitter_px else (0, 0)
            y, x = clip(p + np.asarray(j))
            _draw(canvas, int(y), int(x), obj, COLORS[name])
        _draw(canvas, int(target[0]), int(target[1]), obj, COLORS[colors[0]])
        _draw(canvas, agent, agent, max(obj // 2, 1), AGENT_RGB)
        frames.append(canvas)
    return Episode(seed, torch.from_numpy(np.stack(frames)), colors[0], answer)


def make_episode(cfg: MotionTaskConfig, seed: int) -> Episode:
    """Render the episode for `seed` (same seed, same pixels and answer)."""
    if cfg.question == "reach":
        return _reach_episode(cfg, seed)
    rng = np.random.default_rng(seed)
    colors = list(rng.choice(list(COLORS), size=cfg.num_objects, replace=False))
    answer = DIRECTIONS[int(rng.integers(4))]
    n_steps = max(cfg.frames - 1, 2)
    margin = cfg.step_px * n_steps
    lo, hi = margin, cfg.image_size - cfg.object_px - margin
    pos = [np.array([rng.integers(lo, hi + 1), rng.integers(lo, hi + 1)]) for _ in colors]
    dy, dx = _STEP[answer]
    frames = []
    trail = cfg.frames == 1
    for f in range(max(cfg.frames, 1)):
        canvas = np.full((3, cfg.image_size, cfg.image_size), 20, dtype=np.uint8)
        for i, (name, p) in enumerate(zip(colors, pos)):
            if i == 0:
                steps = range(n_steps + 1) if trail else [f]
                for k, s in enumerate(steps):  # image variant: a fading trail ending at the target
                    shade = 0.35 + 0.65 * (k + 1) / len(steps) if trail else 1.0
                    rgb = tuple(int(c * shade) for c in COLORS[name])
                    _draw(canvas, p[0] + dy * cfg.step_px * s, p[1] + dx * cfg.step_px * s, cfg.object_px, rgb)
            else:
                j = rng.integers(-cfg.jitter_px, cfg.jitter_px + 1, size=2) if cfg.jitter_px else (0, 0)
                y = int(np.clip(p[0] + j[0], 0, cfg.image_size - cfg.object_px))
                x = int(np.clip(p[1] + j[1], 0, cfg.image_size - cfg.object_px))
                _draw(canvas, y, x, cfg.object_px, COLORS[name])
        frames.append(canvas)
    return Episode(seed, torch.from_numpy(np.stack(frames)), colors[0], answer)


def reward(episode: Episode, answer: str) -> float:
    """1.0 when the answer names the direction the target moved, else 0.0."""
    return 1.0 if answer == episode.answer else 0.0


class TaskVocab:
    """A fixed word <-> token-id table for instructions and answers (ids start at `offset`)."""

    WORDS = ("which", "way", "did", "the", "object", "move", "?", "answer", ":", "look", "at", "video",
             "image", "trail") + tuple(COLORS) + DIRECTIONS + ("go", "to", "reach")

    def __init__(self, offset: int = 10):
        self.ids = {w: offset + i for i, w in enumerate(self.WORDS)}
        self.words = {i: w for w, i in self.ids.items()}

    def encode(self, text: str) -> list[int]:
        """Token ids of space-separated known words (unknown words are an error)."""
        unknown = [w for w in text.split() if w not in self.ids]
        if unknown:
            raise ValueError(f"words not in the task vocabulary: {unknown}")
        return [self.ids[w] for w in text.split()]

    def answer_ids(self) -> list[int]:
        """Token ids of the four direction answers."""
        return [self.ids[d] for d in DIRECTIONS]


def episode_prompt(episode: Episode, model_cfg, vocab: TaskVocab, question: str = "motion"):
    """The episode as a prompt of the model's family (prefix.batch.Prompt): text, vision span(s), question."""
    m = model_cfg.vision.spatial_merge_size
    pixels, grid = patchify(normalize(episode.frames), model_cfg.vision.patch_size, m,
                            model_cfg.vision.temporal_patch_size)
    is_video = episode.frames.shape[0] > 1
    pad = model_cfg.video_token_id if is_video else model_cfg.image_token_id
    # Qwen3-VL holds a video as one span per temporal grid step (its timestamp text left out: the task's vocabulary
    # has none, and text between the spans only shifts the positions as any text does); Qwen2.5-VL as one span
    spans = grid[0] if is_video and model_spec(model_cfg).processor.video_run_per_frame else 1
    span = [model_cfg.vision_start_token_id] + [pad] * (grid[0] * grid[1] * grid[2] // (m * m * spans)) \
        + [model_cfg.vision_end_token_id]
    head = vocab.encode(f"look at the {'video' if is_video else 'image trail'}")
    question = vocab.encode(f"which way did the {episode.color} object move ? answer :" if question == "motion"
                            else f"which way to go to reach the {episode.color} object ? answer :")
    ids = torch.tensor(head + span * spans + question)
    grid_t = torch.tensor([list(grid)])
    if is_video:
        return Prompt(ids, pixel_values_videos=pixels, video_grid_thw=grid_t,
                      second_per_grid_ts=torch.tensor([1.0]))
    return Prompt(ids, pixel_values=pixels, image_grid_thw=grid_t)


class MotionEnv:
    """The task as the trainer sees it: seeds -> prompts, responses -> rewards (chance = 1/4)."""

    chance = 1.0 / len(DIRECTIONS)

    def __init__(self, cfg: MotionTaskConfig, model_cfg):
        self.cfg, self.model_cfg, self.vocab = cfg, model_cfg, TaskVocab()
        v = model_cfg.vision
        unit = v.patch_size * v.spatial_merge_size
        if cfg.image_size % unit:  # the frames must split into whole merged patches
            up = -(-cfg.image_size // unit) * unit
            raise ValueError(f"task.image_size={cfg.image_size} must be a multiple of {unit} for this model "
                             f"(model.vision.patch_size {v.patch_size} x spatial_merge_size {v.spatial_merge_size}): "
                             f"set task.image_size={up} (or another multiple)")
        ids = sorted(self.vocab.ids.values())
        special = {model_cfg.image_token_id, model_cfg.video_token_id, model_cfg.vision_start_token_id,
                   model_cfg.vision_end_token_id}
        if ids[-1] >= model_cfg.vocab_size or special & set(ids):
            raise ValueError(f"the task vocabulary uses token ids {ids[0]}..{ids[-1]}, which must lie inside "
                             f"model.vocab_size ({model_cfg.vocab_size}) and avoid the vision special tokens")
        self.stop_token_ids = tuple(self.vocab.answer_ids())

    def episode(self, seed: int) -> Episode:
        """The deterministic episode of `seed`."""
        return make_episode(self.cfg, seed)

    def prompt(self, episode: Episode):
        """The episode's prompt (prefix.batch.Prompt)."""
        return episode_prompt(episode, self.model_cfg, self.vocab, self.cfg.question)

    def answer(self, tokens: torch.Tensor) -> str | None:
        """The first direction named in a response, if any."""
        for t in tokens.tolist():
            word = self.vocab.words.get(int(t))
            if word in DIRECTIONS:
                return word
        return None

    def answer_reward(self, episode: Episode, said: str | None) -> float:
        """Correctness (1/0) plus `format_reward` when a direction was named at all."""
        return 0.0 if said is None else reward(episode, said) + self.cfg.format_reward

    def reward(self, episode: Episode, tokens: torch.Tensor) -> float:
        """The reward of a response's tokens."""
        return self.answer_reward(episode, self.answer(tokens))
