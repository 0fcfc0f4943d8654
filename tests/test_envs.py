"""The motion task: deterministic episodes, verifiable rewards, processor-exact patches."""
import numpy as np
import pytest
import torch

from rollplex_megatron.envs import motion
from rollplex_megatron.envs.vision import normalize, patchify
from rollplex_megatron.recipes import load_run_config


def test_patchify_matches_the_qwen2_vl_image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    proc = Qwen2VLImageProcessorPil()
    img = torch.randn(3, 56, 84)
    ours, grid = patchify(img[None])
    ref, gh, gw = proc.patchify(img.numpy(), patch_size=14, merge_size=2, temporal_patch_size=2)
    assert grid == (1, gh, gw) and np.array_equal(ours.numpy(), ref)
    assert np.allclose(normalize(torch.full((1, 3, 2, 2), 255, dtype=torch.uint8))[0, :, 0, 0].numpy(),
                       (1 - np.array(proc.image_mean)) / np.array(proc.image_std), atol=1e-6)


def test_video_patchify_by_definition():
    """Each row is [C, temporal, p, p] of one patch; rows go frame pair, merge block, then 2x2 inside."""
    g = torch.Generator().manual_seed(0)
    v = torch.randn(4, 3, 56, 28, generator=g)
    rows, (gt, gh, gw) = patchify(v)
    assert (gt, gh, gw) == (2, 4, 2)
    k = 0
    for t in range(gt):
        for bh in range(gh // 2):
            for bw in range(gw // 2):
                for mh in range(2):
                    for mw in range(2):
                        y, x = (bh * 2 + mh) * 14, (bw * 2 + mw) * 14
                        want = v[2 * t:2 * t + 2, :, y:y + 14, x:x + 14].permute(1, 0, 2, 3).reshape(-1)
                        assert torch.equal(rows[k], want)
                        k += 1


def test_episodes_are_deterministic_and_rewards_verifiable():
    cfg = motion.MotionTaskConfig(frames=4, num_objects=3)
    a, b, c = motion.make_episode(cfg, 7), motion.make_episode(cfg, 7), motion.make_episode(cfg, 8)
    assert torch.equal(a.frames, b.frames) and a.answer == b.answer and a.color == b.color
    assert not torch.equal(a.frames, c.frames)
    assert motion.reward(a, a.answer) == 1.0
    assert all(motion.reward(a, d) == 0.0 for d in motion.DIRECTIONS if d != a.answer)


def test_target_really_moves_in_the_answer_direction():
    cfg = motion.MotionTaskConfig(frames=4, num_objects=1, step_px=4)
    for seed in range(20):
        ep = motion.make_episode(cfg, seed)
        rgb = torch.tensor(motion.COLORS[ep.color], dtype=torch.uint8)[:, None, None]
        centers = []
        for f in ep.frames:
            ys, xs = torch.nonzero((f == rgb).all(0), as_tuple=True)
            centers.append((ys.float().mean().item(), xs.float().mean().item()))
        dy, dx = centers[-1][0] - centers[0][0], centers[-1][1] - centers[0][1]
        seen = ("down" if dy > 0 else "up") if abs(dy) > abs(dx) else ("right" if dx > 0 else "left")
        assert seen == ep.answer and max(abs(dy), abs(dx)) == 4 * 3


def test_answers_are_balanced_across_seeds():
    cfg = motion.MotionTaskConfig()
    counts = {d: 0 for d in motion.DIRECTIONS}
    for s in range(400):
        counts[motion.make_episode(cfg, s).answer] += 1
    assert all(70 < c < 130 for c in counts.values()), counts  # chance level is 1/4


def test_prompt_runs_through_the_tiny_model_positions():
    from rollplex_megatron.prefix.batch import prompt_positions

    model = load_run_config([]).model
    vocab = motion.TaskVocab()
    for frames in (4, 1):
        ep = motion.make_episode(motion.MotionTaskConfig(frames=frames), 3)
        pr = motion.episode_prompt(ep, model, vocab)
        special = {model.image_token_id, model.video_token_id, model.vision_start_token_id, model.vision_end_token_id}
        assert set(pr.input_ids.tolist()) - set(range(model.image_token_id)) <= special
        pos = prompt_positions(model, pr)
        assert pos.shape == (3, 1, pr.input_ids.numel())
    assert len(set(vocab.answer_ids())) == 4


def _centre(frame, rgb):
    ys, xs = torch.nonzero((frame == torch.tensor(rgb, dtype=torch.uint8)[:, None, None]).all(0), as_tuple=True)
    return ys.float().mean().item(), xs.float().mean().item(), ys.numel()


@pytest.mark.parametrize("size,objects,jitter", [(56, 1, 0), (84, 4, 3)])
def test_reach_target_lies_on_the_answer_side_of_the_agent(size, objects, jitter):
    cfg = motion.MotionTaskConfig(question="reach", image_size=size, frames=2, num_objects=objects,
                                  object_px=12, jitter_px=jitter)
    counts = {d: 0 for d in motion.DIRECTIONS}
    for seed in range(200):
        ep = motion.make_episode(cfg, seed)
        assert torch.equal(ep.frames, motion.make_episode(cfg, seed).frames)
        counts[ep.answer] += 1
        for f in ep.frames:
            ay, ax, n_agent = _centre(f, motion.AGENT_RGB)
            ty, tx, n_target = _centre(f, motion.COLORS[ep.color])
            assert n_agent == 36 and abs(ay - (size // 2 - 0.5)) <= 1 and abs(ax - (size // 2 - 0.5)) <= 1
            assert n_target > 0
            dy, dx = ty - ay, tx - ax
            seen = ("down" if dy > 0 else "up") if abs(dy) > abs(dx) else ("right" if dx > 0 else "left")
            assert seen == ep.answer, (seed, dy, dx, ep.answer)
    assert all(30 < c < 70 for c in counts.values()), counts


def test_reach_prompt_asks_the_reach_question():
    model = load_run_config([]).model
    vocab = motion.TaskVocab()
    cfg = motion.MotionTaskConfig(question="reach", frames=2, num_objects=1, object_px=12)
    env = motion.MotionEnv(cfg, model)
    ep = env.episode(4)
    words = [vocab.words[i] for i in env.prompt(ep).input_ids.tolist() if i in vocab.words]
    question = f"which way to go to reach the {ep.color} object ? answer :".split()
    assert words[-len(question):] == question
    wrong = next(d for d in motion.DIRECTIONS if d != ep.answer)
    assert env.reward(ep, torch.tensor([vocab.ids[ep.answer]])) == 1.0 + cfg.format_reward
    assert env.reward(ep, torch.tensor([vocab.ids[wrong]])) == cfg.format_reward


@pytest.mark.parametrize("kw,match", [({"image_size": 0}, "task.image_size must be >= 1"), ({"frames": 3}, "even"),
                                      ({"num_objects": 9}, "num_objects"), ({"step_px": 20}, "leaves"),
                                      ({"question": "reach", "object_px": 20}, "object_px"),
                                      ({"question": "where"}, "task.question")])
def test_bad_task_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        motion.MotionTaskConfig(**kw)


def _episode_logits(frames):
    from rollplex_megatron.dist import init_parallel
    from rollplex_megatron.models.qwen25vl import build_model
    from rollplex_megatron.prefix.batch import prompt_positions

    init_parallel()
    model = load_run_config([]).model
    net = build_model(model)
    episode = motion.make_episode(motion.MotionTaskConfig(frames=frames), 5)
    pr = motion.episode_prompt(episode, model, motion.TaskVocab())
    with torch.no_grad():
        out = net(input_ids=pr.input_ids[None], position_ids=prompt_positions(model, pr),
                  pixel_values=pr.pixel_values, image_grid_thw=pr.image_grid_thw,
                  pixel_values_videos=pr.pixel_values_videos, video_grid_thw=pr.video_grid_thw)
    return out.shape, bool(torch.isfinite(out[..., :model.vocab_size]).all())


EPISODE_FRAMES = [4, 1]


@pytest.fixture(scope="module")
def episode_logits():
    """The model forward of every frame count in one job (`tests.in_turn`)."""
    from rollplex_megatron.dist import run_local
    from tests.in_turn import in_turn

    return run_local(in_turn, 1, {f: (_episode_logits, (f,)) for f in EPISODE_FRAMES})[0]


@pytest.mark.parametrize("frames", EPISODE_FRAMES)
def test_episode_prompt_runs_through_the_model(episode_logits, frames):
    from tests.in_turn import case

    shape, finite = case(episode_logits, frames)
    assert shape[0] == 1 and finite
