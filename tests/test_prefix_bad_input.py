"""Bad rollout batches fail before any model work, naming the group and response."""
import pytest
import torch

from rollplex_megatron.prefix.batch import Group, Prompt, check_group_prompts, validate_groups
from rollplex_megatron.recipes import load_run_config

CFG = load_run_config([]).model


def _group(responses, prompt=None):
    ids = torch.tensor([1, 2, 3, 4]) if prompt is None else prompt
    return Group(Prompt(ids), responses, torch.zeros(len(responses)))


def test_empty_response():
    with pytest.raises(ValueError, match="group 1 response 0: empty response"):
        validate_groups(CFG, [_group([torch.tensor([5])]), _group([torch.tensor([], dtype=torch.long)])], 8)


def test_response_longer_than_maximum():
    with pytest.raises(ValueError, match=r"group 0 response 1: 9 tokens exceed rollout.max_response_len=8"):
        validate_groups(CFG, [_group([torch.tensor([5]), torch.arange(9)])], 8)


def test_vision_token_in_response():
    with pytest.raises(ValueError, match="group 0 response 0: contains vision placeholder"):
        validate_groups(CFG, [_group([torch.tensor([5, CFG.image_token_id])])], 8)


def test_prompt_ending_in_vision_token():
    with pytest.raises(ValueError, match="group 0: the prompt's last token is a vision placeholder"):
        validate_groups(CFG, [_group([torch.tensor([5])], torch.tensor([1, CFG.video_token_id]))], 8)


def test_group_members_with_different_prompts():
    a, b = _group([torch.tensor([5])]), _group([torch.tensor([6])], torch.tensor([1, 2, 9, 4]))
    with pytest.raises(ValueError, match="samples 0 and 1 are in one group but have different prompts"):
        check_group_prompts([a, b], [[0, 1]])


def test_verify_response_length_above_rollout_maximum():
    with pytest.raises(ValueError, match=r"verify.max_response_len \(40\) exceeds rollout.max_response_len \(32\)"):
        load_run_config(["verify.max_response_len=40", "rollout.max_response_len=32"]).check_verify()


def test_placeholder_count_against_the_grid():
    """The host-side check the prefix stage runs before issuing any work (and `embed` by default)."""
    from rollplex_megatron.models.qwen25vl.model import check_placeholders

    merge2 = CFG.vision.spatial_merge_size ** 2
    grid = torch.tensor([[2, 4, 4]])  # 32 patches -> 32 / merge2 embeddings
    n = 32 // merge2
    pix = torch.zeros(32, 1)
    ok = torch.tensor([[1] + [CFG.video_token_id] * n + [2]])
    check_placeholders(CFG, ok, None, None, pix, grid)  # matches: no error
    short = torch.tensor([[1] + [CFG.video_token_id] * (n - 1) + [2]])
    with pytest.raises(ValueError, match=f"{n - 1} video tokens but the video grids give {n} embeddings"):
        check_placeholders(CFG, short, None, None, pix, grid)
    with pytest.raises(ValueError, match="input_ids hold image tokens but no image pixels were given"):
        check_placeholders(CFG, torch.tensor([[1, CFG.image_token_id, 2]]), None, None, None, None)
