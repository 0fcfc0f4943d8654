"""memory.optimizer_step=stream: the optimizer step streamed from host memory bucket by bucket is megatron's resident
step, bit for bit (weights, fp32 masters, Adam's states and step counts, the gradient norm), over three steps of
fresh gradients of very different magnitudes with clipping and weight decay active, at TP=1 and TP=2, in fp32 and
in bf16 with fp32 masters, with the masters streamed or kept; a checkpoint's state dict loads into it and the next
step still agrees; two mutants (a bucket's copy back skipped, a bucket updated from stale masters) are caught; and
the planner's optimizer phase drops to the bf16 weights, the gradients and the buckets."""
import pytest
import torch

from rollplex_megatron.dist import run_local
from rollplex_megatron.memory import planner as M
from rollplex_megatron.recipes import load_run_config
from tests import stream_optimizer_workers as W
from tests.in_turn import case, in_turn
from tests.memory_workers import plan_steps
from tests.test_trainer import BASE

GIB = 2**30
SMALL = 0.05  # MiB: buckets of about 4096 elements, so the tiny model's larger parameters are split across buckets
CASES = {
    "bf16": dict(dtype="bfloat16", released="phase", bucket_mib=SMALL),
    "fp32": dict(dtype="float32", released="phase", bucket_mib=SMALL),  # megatron's FP32 optimizer: states only
    "bf16_masters_kept": dict(dtype="bfloat16", released=frozenset({"optimizer_states"}), bucket_mib=SMALL),
    "one_bucket": dict(dtype="bfloat16", released="phase", bucket_mib=64.0),
}
MUTANTS = {m: dict(dtype="bfloat16", released="phase", bucket_mib=SMALL, mutant=m)
           for m in ("skip_copy_back", "stale_masters")}


@pytest.fixture(scope="module")
def results():
    """Every case in one spawn per world size: TP=1 all cases and the mutants, TP=2 the three layouts."""
    one = run_local(W.run_cases, 1, 1, {**CASES, **MUTANTS})[0]
    two = run_local(W.run_cases, 2, 2, {k: CASES[k] for k in ("bf16", "fp32", "bf16_masters_kept")})
    return {(1, k): v for k, v in one.items()} | {(2, k): [r[k] for r in two] for k in two[0]}


@pytest.mark.parametrize("tp,name", [(1, n) for n in CASES] + [(2, n) for n in ("bf16", "fp32", "bf16_masters_kept")])
def test_streamed_step_equals_resident_bit_for_bit(results, tp, name):
    for out in results[tp, name] if tp > 1 else [results[tp, name]]:
        assert out["equal"] == {"weights": True, "state_dict": True}, out
        assert out["equal_after_load"] == {"weights": True, "state_dict": True}, out
        norms = out["grad_norms"]
        assert all(a == b for a, b in norms), norms  # the same global norm, so the same clip coefficient
        assert all(a > W.CLIP for a, _ in norms), norms  # clipping scaled every step
        assert all(out["streamed_zero"]), "a streamed class came back to the device whole"
        stats = out["stats"][-1]
        if name == "one_bucket":
            assert stats == {"buckets": 1, "split_params": 0}
        else:
            assert stats["buckets"] > 10 and stats["split_params"] > 0, stats


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_mutants_are_caught(results, mutant):
    out = results[1, mutant]
    assert out["equal"]["state_dict"] is False, out


def test_plan_memory_optimizer_phase_drops_under_streaming():
    """3B on video_long under the phase plan: the resident optimizer phase holds masters, Adam states, gradients
    and Adam's workspace (the run's peak, 76.9 GiB); streamed, it holds the bf16 weights, the gradients, two
    512 MiB buckets and one bucket's workspace, and the run's peak moves to the update."""
    def summary(step):
        cfg = load_run_config(["+bench=video_long", "model=qwen2_5_vl_3b", "mode.name=rollplex", "memory.plan=phase",
                               f"memory.optimizer_step={step}"])
        return M.summarize(M.runtime_plan(cfg, M.workload_shape(cfg)), "rollplex")

    resident, streamed = summary("resident"), summary("stream")
    assert resident["peak_phase"] == "optimizer" and resident["peak_gib"] > 74.7
    opt = streamed["by_phase_gib"]["optimizer"]
    assert set(opt) == {"actor_weights", "grads", "optimizer_buckets", "optimizer_workspace"}, opt
    assert opt["optimizer_buckets"] == pytest.approx(1.0)  # 2 x 512 MiB
    assert opt["optimizer_workspace"] == pytest.approx(4 * 2**29 / 12 / GIB, rel=1e-6)  # sqrt of one bucket
    assert opt["grads"] == pytest.approx(2 * opt["actor_weights"])  # fp32 gradients of bf16 weights
    assert streamed["phase_gib"]["optimizer"] < resident["phase_gib"]["optimizer"] - 50
    assert streamed["peak_phase"] == "update" and streamed["peak_gib"] < 74.7
    for phase in ("rollout", "ref_logp", "update"):  # the other phases are unchanged
        assert streamed["phase_gib"][phase] == pytest.approx(resident["phase_gib"][phase])


def test_stream_needs_a_releasing_plan():
    with pytest.raises(ValueError, match="memory.optimizer_step=stream has no effect without memory.plan"):
        load_run_config(["memory.plan=keep", "memory.optimizer_step=stream"])
    with pytest.raises(ValueError, match="memory.optimizer_bucket_mib=.* has no effect without memory.optimizer_step"):
        load_run_config(["memory.optimizer_step=resident", "memory.optimizer_bucket_mib=64"])
    assert load_run_config(["memory.optimizer_bucket_mib=64"]).memory.optimizer_bucket_mib == 64  # auto may stream


def test_trainer_steps_with_the_streamed_step_equal_the_resident_ones():
    """Two rollplex RL steps through the trainer (bf16 with fp32 masters, the phase plan, two PPO mini-batches: the
    update and the optimizer alternate): the streamed step leaves the same tokens and the same weights, bit for bit,
    and its records show no masters or Adam states on the device at the optimizer's entry."""
    base = [*BASE, "mode.name=rollplex", "dtype=bfloat16", "memory.plan=phase", "train.ppo_mini_batches=2"]
    calls = {step: (plan_steps, (load_run_config([*base, f"memory.optimizer_step={step}"]), 2))
             for step in ("resident", "stream")}
    res = run_local(in_turn, 1, calls)[0]
    resident, streamed = case(res, "resident"), case(res, "stream")
    assert streamed["tokens"] == resident["tokens"]
    assert all(torch.equal(streamed["last"][n], resident["last"][n]) for n in resident["last"])
    assert any(not torch.equal(resident["first"][n], resident["last"][n]) for n in resident["last"])  # it trained
    managed = [r["phase_managed_bytes"]["optimizer"] for r in streamed["records"]]
    assert all(m["main_weights"] == 0 and m["optimizer_states"] == 0 for m in managed), managed
    assert all(r["phase_managed_bytes"]["optimizer"]["optimizer_states"] > 0 for r in resident["records"][1:])
