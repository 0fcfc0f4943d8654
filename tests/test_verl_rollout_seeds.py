"""The `rollplex` rollout server's sampling seeds (integrations/verl/rollout.py) on prompts of one length.

Prompts whose ids are equal but whose images differ (rows of one image size and wording: verl's agent loop writes
the same ids for each, the pixels differ) are different prompts: each must get its seed from its own content, not
from the order the agent loop's calls reach the server (asyncio, a thread per call's processor). Keyed by the ids
alone, the first to arrive took place 0 and the other place 1, so two runs of one configuration sampled one
prompt's tokens for the other, and verl's whole step (tests/test_verl_e2e_step.py on such rows) gave shared and
full-sequence runs different losses and grad norms."""
import asyncio
import time

import torch

from verl.workers.config import RolloutConfig

from rollplex_megatron.integrations.verl import rollout as R

IDS = [5, 9, 9, 9, 9, 7]  # one prompt's ids, four vision placeholders
DELAY_S = 0.05  # the later call's processor time: decides which call reaches the server first


class _Call:
    """`worker.__ray_call__`: `.remote(fn, requests, params, round)` records the requests, answers one token each."""

    def __init__(self, seen: list):
        self.seen = seen

    async def remote(self, fn, requests, params, round_):
        self.seen.extend(requests)
        return [{"tokens": [[1]] * r["n"], "logprobs": [[0.0]] * r["n"], "finish": ["length"] * r["n"],
                 "global_steps": 0} for r in requests]


class _Worker:
    def __init__(self, seen: list):
        self.__ray_call__ = _Call(seen)


def _inputs(processor, tokenizer, prompt_ids, images, videos) -> dict:
    """`prompt_inputs` as the processor gives it: equal ids, pixels from the image (a name); the call's delay first."""
    name, delay = images[0]
    time.sleep(delay)
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    return {"input_ids": torch.tensor(prompt_ids), "pixel_values": torch.randn(4, 6, generator=gen),
            "image_grid_thw": torch.tensor([[1, 2, 2]])}


def _seeds(first: str, second: str) -> dict:
    """{image: the seed its request got}, for two calls (one per image, equal ids) where `first` arrives first."""
    seen: list = []
    cfg = RolloutConfig(name="rollplex", tensor_model_parallel_size=1, prompt_length=16, response_length=2)
    server = R.RollplexServer(cfg, None, [_Worker(seen)], 0, tools=(None, None, (3,)))
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}

    async def run():
        return await asyncio.gather(server.generate(IDS, dict(params), "a", image_data=[(first, 0.0)]),
                                    server.generate(IDS, dict(params), "b", image_data=[(second, DELAY_S)]))

    asyncio.run(run())
    assert len(seen) == 2 and not torch.equal(seen[0]["pixel_values"], seen[1]["pixel_values"]), seen
    by_pixels = {image: _inputs(None, None, IDS, [(image, 0.0)], None)["pixel_values"] for image in (first, second)}
    return {image: next(r["seed"] for r in seen if torch.equal(r["pixel_values"], px))
            for image, px in by_pixels.items()}


def test_equal_length_prompts_get_their_seeds_whatever_the_arrival_order(monkeypatch):
    monkeypatch.setattr(R, "prompt_inputs", _inputs)
    red_first, blue_first = _seeds("red", "blue"), _seeds("blue", "red")
    assert red_first == blue_first, (red_first, blue_first)
    assert red_first["red"] != red_first["blue"], red_first  # two prompts, two seeds


def test_a_prompt_seed_reads_its_processor_tensors():
    ids = torch.tensor(IDS)
    a = {"input_ids": ids, "pixel_values": torch.zeros(4, 6)}
    b = {"input_ids": ids, "pixel_values": torch.ones(4, 6)}
    assert R.prompt_seed(a, 1, 0) != R.prompt_seed(b, 1, 0)
    assert R.prompt_seed(a, 1, 0) == R.prompt_seed({k: v.clone() for k, v in a.items()}, 1, 0)
    # a text-only prompt keeps the seed of its ids
    assert R.prompt_seed({"input_ids": ids}, 1, 0) == R.prompt_seed({"input_ids": ids.clone()}, 1, 0)

