"""verl's CPU platform and the `rollplex` rollout backend (integrations/verl/platform.py, rollout.py).

The rollout runs in-process here: the server's calls reach a stand-in for verl's worker actor (`__ray_call__`
runs the function on it, as Ray does), whose actor engine is the `rollplex` engine verl builds. The rollout's
log-probs must equal that engine's scoring of the same samples (on-policy, fp32, docs/design.md §3: 1e-5
norm-relative over all tokens of all samples): both are the sampled policy's, at the rollout's temperature with
the vision placeholders out of the softmax. The whole verl step through its driver is tests/test_verl_e2e_step.py."""
import asyncio
import inspect
import os
import subprocess
import sys

import pytest
import torch

from rollplex_megatron.dist import free_port, run_local
from tests.numerics import rel_err

TOL = 1e-5


def test_cpu_platform_is_verls_platform_without_an_accelerator():
    code = ("import os, warnings; warnings.filterwarnings('ignore')\n"
            "import verl\n"
            "from verl.utils.device import get_device_name, get_nccl_backend, get_resource_name, get_torch_device\n"
            "from verl.utils.distributed import initialize_global_process_group_ray\n"
            "import torch.distributed as dist\n"
            "os.environ.update(RANK='0', WORLD_SIZE='1', MASTER_ADDR='127.0.0.1', MASTER_PORT=os.environ['PORT'])\n"
            "initialize_global_process_group_ray()\n"  # verl's own string: cpu:gloo,cpu:gloo
            "m = get_torch_device()\n"
            "m.empty_cache(); m.set_rng_state(m.get_rng_state()); m.manual_seed(1)\n"
            "print(get_device_name(), get_nccl_backend(), get_resource_name(), dist.get_backend(),\n"
            "      m.memory_allocated(), m.mem_get_info()[1] > 0)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PORT": str(free_port())})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["cpu", "gloo", "GPU", "cpu:gloo", "0", "True"], out.stdout


def test_unique_backend_keeps_the_first_mapping_of_each_device():
    from rollplex_megatron.integrations.verl.platform import unique_backend

    assert unique_backend("cpu:gloo,cpu:gloo") == "cpu:gloo"
    assert unique_backend("cpu:gloo,cuda:nccl") == "cpu:gloo,cuda:nccl"
    assert unique_backend("gloo") == "gloo" and unique_backend(None) is None


class _Call:
    """`worker.__ray_call__` of a stand-in worker: `.remote(fn, *args)` runs fn(worker, *args), awaitably."""

    def __init__(self, worker):
        self.worker = worker

    async def remote(self, fn, *args):
        return fn(self.worker, *args)


class _Worker:
    """verl's hybrid worker as the rollout sees it: its rollout, its actor's engine and its reference's."""

    def __init__(self, rollout, engine, ref=None):
        self.rollout, self.actor = rollout, type("Actor", (), {"engine": engine})()
        self.ref = type("Ref", (), {"engine": ref})() if ref is not None else None
        self.__ray_call__ = _Call(self)


def _score(engine, prompts: list, outs: list, temperature: float) -> list:
    """The actor engine's log-probs of each (prompt, response) (verl's compute_log_prob on one batch)."""
    from verl.utils import tensordict_utils as tu

    from rollplex_megatron.integrations.verl.batch import as_nested

    rows = []
    for i, (p, o) in enumerate(zip(prompts, outs)):
        p, r = torch.tensor(p), torch.tensor(o.token_ids)
        rows.append({"prompts": p, "responses": r, "input_ids": torch.cat([p, r]),
                     "attention_mask": torch.ones(p.numel() + r.numel(), dtype=torch.int64),
                     "response_mask": torch.ones(r.numel(), dtype=torch.int64),
                     "loss_mask": torch.ones(r.numel(), dtype=torch.int64), "uid": f"u{i}"})
    data = tu.list_of_dict_to_tensordict(rows)
    for k in ("prompts", "responses", "input_ids", "attention_mask", "response_mask", "loss_mask"):
        data[k] = as_nested([r[k] for r in rows])  # verl's jagged layout, also where lengths happen to be equal
    tu.assign_non_tensor(data, temperature=temperature, micro_batch_size_per_gpu=4)
    with engine.eval_mode():
        out = engine.forward_backward_batch(data, loss_function=None, forward_only=True)
    lp = out["model_output"]["log_probs"].unbind()
    return [x[len(p) - 1:len(p) - 1 + len(o.token_ids)] for x, p, o in zip(lp, prompts, outs)]


def _score_unbanned(engine, prompts: list, outs: list, temperature: float) -> list:
    """Mutation: `_score` with the engine's banned tokens (the vision placeholders) left in the softmax."""
    from rollplex_megatron.integrations.verl import engine as E

    kept = E.policy_logits
    E.policy_logits = lambda logits, t, banned, tp_rank: kept(logits, t, (), tp_rank)
    try:
        return _score(engine, prompts, outs, temperature)
    finally:
        E.policy_logits = kept


def _swapped(entries: dict) -> dict:
    """Mutation: held K/V answered to the other prompt (two prompts of one length, so the shapes fit)."""
    (ka, [(pa, kva, va)]), (kb, [(pb, kvb, vb)]) = entries.items()
    return {ka: [(pa, kvb, va)], kb: [(pb, kva, vb)]}


def _vs_rollout(outs, logp) -> float:
    """Scored log-probs against the rollout's own, norm-relative over all tokens of all samples."""
    return rel_err(logp, [torch.tensor(o.log_probs) for o in outs])


def held_checks(engine, ref, actor_held: dict, ref_held: dict, prompts, outs) -> dict:
    """The scoring phases over what the rollout held (held.py) against the same phases computing every prefix:
    the actor's old log-probs from the prefill's K/V, the reference's from the decode window's; mutations: the
    two prompts' K/V swapped; K/V held at other weights (an optimizer step since) are not read."""
    out = {"actor_window": dict(engine.last_window)}  # the first scoring (rollout_case) read the held K/V
    out["ref_held"] = _score(ref, prompts, outs, 0.7)
    out["ref_window"] = dict(ref.last_window)
    ref.window.entries = _swapped(ref_held)
    out["ref_swapped"] = _score(ref, prompts, outs, 0.7)
    held, ref.window = ref.window, None
    out["ref_plain"] = _score(ref, prompts, outs, 0.7)
    ref.window = held
    engine.window.entries = _swapped(actor_held)
    out["actor_swapped"] = _vs_rollout(outs, _score(engine, prompts, outs, 0.7))
    engine.window.entries, engine.updates = dict(actor_held), engine.updates + 1
    out["stale"] = _vs_rollout(outs, _score(engine, prompts, outs, 0.7)), dict(engine.window.last)
    engine.updates -= 1
    return out


def rollout_case(hf_dir: str) -> dict:
    """Two prompts x 3 samples through the server (arriving interleaved), the rollout on the actor engine's modules
    with the reference prefix stages in its decode window; the samples scored by the engine (the actor's old
    log-probs from the prefill's K/V) and by the reference (`held_checks`); sleep; update_weights."""
    os.environ["VERL_ENGINE_VENDOR"] = "rollplex"
    import verl  # noqa: F401  (the plugin registers the backend)
    from verl.workers.config import HFModelConfig, RolloutConfig
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import get_rollout_replica_class

    from rollplex_megatron.integrations.verl import rollout as R
    from tests.verl_workers import new_engine

    engine = new_engine(hf_dir, 1, share_prefix=True)
    ref = new_engine(hf_dir, 1, share_prefix=True, forward_only=True)
    cfg = RolloutConfig(name="rollplex", tensor_model_parallel_size=1, prompt_length=16, response_length=6,
                        free_cache_engine=True)
    rollout = get_rollout_class("rollplex", "async")(config=cfg, model_config=HFModelConfig(path=hf_dir,
                                                     load_tokenizer=False), device_mesh=None)
    server = R.RollplexServer(cfg, None, [_Worker(rollout, engine, ref)], 0, tools=(None, None, (3,)))
    gen = torch.Generator().manual_seed(5)
    base = [torch.randint(10, 60, (n,), generator=gen).tolist() for n in (7, 7)]
    prompts = [base[i % 2] for i in range(6)]
    params = {"temperature": 0.7, "top_p": 1.0, "top_k": -1, "logprobs": True}

    async def run():
        return await asyncio.gather(*[server.generate(p, dict(params), f"r{i}") for i, p in enumerate(prompts)])

    outs = asyncio.run(run())
    actor_held, ref_held = dict(engine.window.entries), dict(ref.window.entries)
    logp = _score(engine, prompts, outs, 0.7)
    held = held_checks(engine, ref, actor_held, ref_held, prompts, outs)
    diff = _vs_rollout(outs, logp)
    swapped = _score(engine, prompts[1:] + prompts[:1], outs, 0.7)  # mutation: samples answered to the wrong call
    same = [(o, x) for o, x in zip(outs, swapped) if len(x) == len(o.log_probs)]  # where the lengths let it compare
    mutant = _vs_rollout([o for o, _ in same], [x for _, x in same])
    unbanned_diff = _vs_rollout(outs, _score_unbanned(engine, prompts, outs, 0.7))
    kept = rollout.engine._state is not None
    asyncio.run(server.sleep())

    def unreadable():
        raise AssertionError("update_weights read the weights")
        yield

    asyncio.run(rollout.update_weights(unreadable()))
    return {"diff": diff, "mutant": mutant, "unbanned_diff": unbanned_diff, "kept": kept, **held,
            "ref_vs_plain": rel_err(held["ref_held"], held["ref_plain"]),
            "ref_swapped_vs_plain": rel_err(held["ref_swapped"], held["ref_plain"]),
            "stats": asyncio.run(server.get_stats()),
            "dropped": rollout.engine._state is None and rollout.released == 1, "round": server.round,
            "lens": [len(o.token_ids) for o in outs], "stops": [o.stop_reason for o in outs],
            "lazy_export": inspect.isgenerator(engine.get_per_tensor_param()[0]),
            "replica": get_rollout_replica_class("rollplex").__name__,
            "same_within_group": [o.token_ids for o in outs[0::2]] != [o.token_ids for o in outs[0::2][:1]] * 3}


@pytest.fixture(scope="module")
def rollout_run(tiny_hf):
    return run_local(rollout_case, 1, tiny_hf)[0]


def test_rollplex_rollout_merges_groups_and_keeps_no_weight_copy(rollout_run):
    r = rollout_run
    assert r["replica"] == "RollplexReplica"
    # 6 calls, 2 prompts: one batch of 2 merged requests (each prompt prefilled once)
    assert r["stats"] == {"requests": 6, "merged_requests": 2, "batches": 1}, r["stats"]
    assert all(1 <= n <= 6 for n in r["lens"]) and set(r["stops"]) == {"completed"}, r
    assert r["kept"] and r["dropped"] and r["round"] == 1, r  # sleep with free_cache_engine drops the decode state
    assert r["lazy_export"], r  # verl's weight sync gets a generator the rollplex rollout never reads
    assert r["mutant"] > 100 * TOL, r  # scoring a sample against another prompt is far off (the check can fail)


def test_rollplex_rollout_log_probs_equal_the_actors(rollout_run):
    assert rollout_run["diff"] <= TOL, rollout_run  # on-policy: the rollout's log-probs are the actor's
    # mutation: the engine scoring with the vision placeholders in the softmax (the sampler never emits them) is
    # off by -log(1 - their mass) at every position (1.4e-2 norm-relative on the tiny checkpoint; equal: 5e-7)
    assert rollout_run["unbanned_diff"] > 100 * TOL, rollout_run


def test_the_rollouts_prefixes_serve_the_scoring_phases(rollout_run):
    """The actor's old log-probs read the prefill's K/V, the reference's the decode window's (held.py): every group
    (6 uids, 2 prompts) takes them and computes none, with the log-probs of the plain path."""
    r = rollout_run
    assert r["actor_window"] == {"from_window": 6, "computed": 0}, r["actor_window"]
    assert r["ref_window"] == {"from_window": 6, "computed": 0}, r["ref_window"]
    assert r["ref_vs_plain"] <= TOL, r["ref_vs_plain"]
    # held K/V at other weights (an optimizer step since the rollout) are not read: computed again, same log-probs
    diff, last = r["stale"]
    assert last == {"from_rollout": 0, "computed": 6, "stale": 6} and diff <= TOL, r["stale"]


def test_held_prefixes_of_the_other_prompt_are_caught(rollout_run):
    # mutation: each prompt's held K/V answered with the other's (same length): the log-probs move far
    assert rollout_run["ref_swapped_vs_plain"] > 100 * TOL, rollout_run["ref_swapped_vs_plain"]
    assert rollout_run["actor_swapped"] > 100 * TOL, rollout_run["actor_swapped"]
