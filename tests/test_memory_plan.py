"""The analytic memory planner: parameter counts against built models, bytes by hand, the 32B figure."""
import json
import subprocess
import sys

import pytest
import torch

from rollplex_megatron.dist import run_local
from rollplex_megatron.memory import auto as A
from rollplex_megatron.memory import planner as M
from rollplex_megatron.memory import tensor_bytes as T
from rollplex_megatron.recipes import load_run_config


def _local_params(tp, pp, tie):
    from rollplex_megatron.dist import init_parallel
    from rollplex_megatron.models.qwen25vl import build_model

    cfg = load_run_config([f"parallel.tp={tp}", f"parallel.pp={pp}", f"model.tie_word_embeddings={tie}"])
    init_parallel(tp, pp)
    return sum(p.numel() for p in build_model(cfg.model).parameters())


@pytest.fixture(scope="module")
def stage_params():
    """The built models' parameter counts per pipeline depth, both tie settings in one job per depth
    (`tests.in_turn`; each case builds its own model)."""
    from tests.in_turn import cases, in_turn

    out = {}
    for pp in (1, 2):
        res = run_local(in_turn, pp, {tie: (_local_params, (1, pp, tie)) for tie in (False, True)}, False)
        out.update({(pp, tie): cases(res, tie) for tie in (False, True)})
    return out


@pytest.mark.parametrize("pp,tie", [(1, False), (1, True), (2, False), (2, True)])
def test_parameter_count_equals_the_built_model(stage_params, pp, tie):
    """Exact at TP=1: the fullest pipeline stage's parameters as megatron builds them."""
    cfg = load_run_config([f"model.tie_word_embeddings={tie}"]).model
    counts = stage_params[pp, tie]
    assert max(counts) == T.params_per_gpu(cfg, 1, pp), (counts, T.params_per_gpu(cfg, 1, pp))


def test_parameter_count_at_tp2_within_replicated_norms():
    cfg = load_run_config([]).model
    counts = run_local(_local_params, 2, 2, 1, False)
    assert abs(max(counts) - T.params_per_gpu(cfg, 2, 1)) / max(counts) < 0.01


def test_kv_and_class_bytes_by_hand():
    cfg = load_run_config(["dtype=bfloat16", "workload.rollout_batch=32", "rollout.group_size=4",
                           "workload.responses_per_micro_batch=2", "plan.prefix_tokens=100",
                           "plan.response_tokens=10", "plan.vision_patches=64"])
    m = cfg.model  # tiny: 4 layers, h 64, 4 heads and 2 KV groups of head dim 16, ffn 128
    assert T.kv_bytes_per_token(m, 1, m.num_layers) == 2 * 4 * 2 * 16 * 2
    assert T.kv_bytes_per_token(m, 4, m.num_layers) == 2 * 4 * 1 * 16 * 2  # KV heads replicate past TP=2
    # norms 2 x (8h + 4), QKV and fc1 inputs 2h each, rotary 8D, q and k after rotary, the QKV buffer,
    # attention output and linear_proj input, log-sum-exp per head, MLP 10f
    assert T.layer_activation_bytes(m, 1, False) == (20 * 64 + 8) + 8 * 16 + 2 * 64 + 2 * 32 + 2 * 128 + 4 * 4 \
        + 2 * 64 + 10 * 128
    # the fused norm (train.norm_kernel=triton) keeps its bf16 input and an fp32 rsqrt: 2 x (2h + 4)
    assert T.layer_activation_bytes(m, 1, False, "triton") == T.layer_activation_bytes(m, 1, False) - 2 * 6 * 64
    assert M.norm_kernel(cfg) == "triton"  # train.norm_kernel=auto: a plan is a GPU run's, which takes the kernel
    torch_cfg = load_run_config(["dtype=bfloat16", "train.norm_kernel=torch"])
    assert M.norm_kernel(torch_cfg) == "torch"
    assert M.runtime_cfg(cfg).train.norm_kernel == ("triton" if torch.cuda.is_available() else "torch")  # resolved
    serial = {c.name: c for c in M.serial_plan(cfg)}
    assert serial["rollout_kv"].bytes == 32 * 110 * 512  # 8 prompts x G=4 samples, prompt + response each
    n = T.params_per_gpu(m, 1, 1)
    assert [serial[k].bytes for k in ("actor_weights", "main_weights", "grads", "optimizer_states",
                                      "rollout_weights")] == [2 * n, 4 * n, 4 * n, 8 * n, 2 * n]
    s = M.summarize(M.serial_plan(cfg), "serial")
    assert s["peak_phase"] == "update"
    assert s["peak_gib"] * M.GIB == pytest.approx(sum(c.bytes for c in serial.values() if "update" in c.resident))
    assert serial["optimizer_workspace"].bytes == 4 * n  # torch Adam's sqrt(exp_avg_sq), fp32 per parameter
    r = M.summarize(M.rollplex_plan(cfg), "rollplex")
    assert {"main_weights", "optimizer_states", "grads"}.isdisjoint(r["by_phase_gib"]["rollout"])
    assert {"main_weights", "optimizer_states", "grads", "actor_weights"} <= set(r["by_phase_gib"]["optimizer"])
    assert "reference_weights" not in r["by_phase_gib"]["update"]
    assert r["classes"]["rollout_kv"]["gib"] * M.GIB == 8 * (100 + 4 * 10) * 512  # one prefix per group
    assert r["classes"]["actor_prefix_kv"]["gib"] * M.GIB == 8 * 100 * 512 * 2  # fp32 leaves, one per group
    assert M.rope_kernel(cfg) == "triton"  # train.rope_kernel=auto: likewise the GPU run's fused RoPE
    graph = T.prefix_graph_bytes(m, 1, 1, True, 100, 64, "triton", "triton")
    want = max(graph, T.training_forward_bytes(m, 1, 1, True, 20, 0, "triton", "triton"))
    assert r["classes"]["update_activations"]["gib"] * M.GIB == want
    keep = {c.name: c for c in M.plan(cfg, "rollplex", "keep", "embedded")}
    assert keep["actor_prefix_graph"].bytes == 8 * graph  # every group's graph, kept from the prefill


def test_small_kv_budget_plans_the_largest_wave():
    cfg = load_run_config(["dtype=bfloat16", "workload.rollout_batch=32", "rollout.group_size=4",
                           "plan.prefix_tokens=100", "plan.response_tokens=10",
                           f"memory.kv_cache_gib={3 * 140 * 512 / 2**30}"])
    r = {c.name: c for c in M.rollplex_plan(cfg)}
    assert r["rollout_kv"].bytes == 3 * 140 * 512  # 3 of the 8 groups per wave, as the engine's waves


@pytest.fixture(scope="module")
def plan_memory_cli():
    """The two `plan-memory` commands of the tests below, started together (the planner only: no model, no
    worker), as completed processes."""
    # the paper setting's record (benchmarks/results/plan_memory_32b.json) counts torch's composite RMSNorm;
    # train.norm_kernel=auto plans the fused norm, whose smaller saved tensors lower the serial update peak
    cmds = {"json": ["model=qwen2_5_vl_32b", "train.norm_kernel=torch", "--json"],
            "budget": ["model=qwen2_5_vl_32b", "memory.budget_gib=40"]}
    procs = {k: subprocess.Popen([sys.executable, "-m", "rollplex_megatron", "plan-memory", *c], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for k, c in cmds.items()}
    outs = {k: p.communicate(timeout=300) for k, p in procs.items()}
    return {k: subprocess.CompletedProcess(cmds[k], p.returncode, *outs[k]) for k, p in procs.items()}


def test_plan_memory_32b_reproduces_the_paper_setting(plan_memory_cli):
    p = plan_memory_cli["json"]
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["gpus"] == 32 and (res["tp"], res["dp"]) == (8, 4)
    assert 160 <= res["serial_peak_gib"] <= 170 and res["rollplex_peak_gib"] <= 80 and res["rollplex_fits"]
    assert res["serial"]["engine"] == "separate" and "rollout_weights" in res["serial"]["classes"]
    assert set(res["serial"]["by_phase_gib"]) == {"setup", "rollout", "old_logp", "ref_logp", "update", "optimizer"}


def test_over_budget_names_the_class_and_the_fix(plan_memory_cli):
    p = plan_memory_cli["budget"]
    assert p.returncode == 1
    # the Rollplex plan's peak is the optimizer step, where Adam's states are the largest class
    assert "optimizer_states" in p.stderr and "memory.budget_gib=40" in p.stderr
    assert "plan.distributed_optimizer=true" in p.stderr


def test_runtime_plan_uses_what_the_trainer_runs():
    """The trainer's budget check ignores plan.* layouts the runtime does not implement."""
    base = ["model=qwen2_5_vl_7b", "dtype=bfloat16", "parallel.tp=2", "workload.rollout_batch=16",
            "rollout.group_size=4", "memory.plan=phase"]
    s = M.workload_shape(load_run_config(base), 1000, 0, 16)
    assert s.patches == 0  # a text-only prompt is 0 patches, not the plan's default
    on = M.summarize(M.runtime_plan(load_run_config(base + ["plan.sequence_parallel=true",
                                                            "plan.distributed_optimizer=true"]), s), "rollplex")
    off = M.summarize(M.runtime_plan(load_run_config(base + ["plan.sequence_parallel=false"]), s), "rollplex")
    assert on["phase_gib"] == off["phase_gib"]


@pytest.mark.parametrize("residency", ["phase", "keep"])
def test_dynamic_sampling_rounds_hold_their_prefixes_until_selection(residency):
    """Rollplex with dynamic sampling: the rollout phase holds every round's actor and reference
    prefix K/V (and, under keep, graphs); after the selection only the trained groups' remain."""
    base = ["model=qwen2_5_vl_3b", "dtype=bfloat16", "task=motion_long", "workload=vlm_gpu", "train.reference=always"]
    one = M.summarize(M.plan(load_run_config(base), "rollplex", residency, "embedded"), "rollplex")
    cfg = load_run_config(base + ["train.dynamic_sampling=true", "train.max_resample_rounds=2"])
    three = M.summarize(M.plan(cfg, "rollplex", residency, "embedded"), "rollplex")
    per_round = sum(one["by_phase_gib"]["rollout"][k] for k in ("actor_prefix_kv", "reference_prefix_kv")
                    + (("actor_prefix_graph",) if residency == "keep" else ()))
    assert three["phase_gib"]["rollout"] == pytest.approx(one["phase_gib"]["rollout"] + 2 * per_round)
    for ph in ("ref_logp", "update", "optimizer"):
        assert three["phase_gib"][ph] == pytest.approx(one["phase_gib"][ph])


def test_kept_decode_state_is_resident_in_every_phase():
    """rollout.keep_decode_state: the engine's cache and the graphs' workspace stay between rollouts, so the
    planner holds them in every phase (the same bytes), and every other phase's total grows by exactly them."""
    base = ["dtype=bfloat16", "workload.rollout_batch=32", "rollout.group_size=4", "plan.prefix_tokens=100",
            "plan.response_tokens=10", "plan.vision_patches=64"]
    off = M.summarize(M.rollplex_plan(load_run_config(base)), "rollplex")
    on = M.summarize(M.rollplex_plan(load_run_config(base + ["rollout.keep_decode_state=true"])), "rollplex")
    held = ("rollout_kv", "decode_workspace")
    steps = {p: cls for p, cls in on["by_phase_gib"].items() if p != "setup"}  # the step's phases (not start-up)
    for name in held:
        assert on["classes"][name]["gib"] == off["classes"][name]["gib"] > 0
        assert set(steps) <= {p for p, cls in steps.items() if name in cls}
        assert set(off["by_phase_gib"]) - {"rollout"} <= {p for p, cls in off["by_phase_gib"].items()
                                                        if name not in cls}
    extra = sum(off["classes"][n]["gib"] for n in held)
    for phase, cls in steps.items():
        grown = sum(cls.values()) - sum(off["by_phase_gib"][phase].values())
        assert grown == pytest.approx(0 if phase == "rollout" else extra, abs=1e-9), phase


def test_window_graph_pool_is_resident_in_every_phase():
    """mode.window_graphs: the captured reference items' pool stays all step, so every phase grows by it; each
    bucket allowed adds one pack's K/V outputs (layers x K and V x query groups x head_dim, bf16, per prefix
    token), and packs of several groups hold that many prefixes."""
    base = ["dtype=bfloat16", "workload.rollout_batch=32", "rollout.group_size=4", "plan.prefix_tokens=100",
            "plan.response_tokens=10", "plan.vision_patches=64", "train.reference=always"]
    summary = lambda *o: M.summarize(M.rollplex_plan(load_run_config(base + list(o))), "rollplex")  # noqa: E731
    off, on = summary(), summary("mode.window_graphs=true")
    assert "reference_prefix_graphs" not in off["classes"]
    pool = on["classes"]["reference_prefix_graphs"]["gib"]
    steps = {p: cls for p, cls in on["by_phase_gib"].items() if p != "setup"}  # the step's phases (not start-up)
    assert pool > 0 and set(on["classes"]["reference_prefix_graphs"]["resident"]) == set(steps)
    for phase, cls in steps.items():
        assert sum(cls.values()) - sum(off["by_phase_gib"][phase].values()) == pytest.approx(pool, abs=1e-9), phase
    m = load_run_config(base).model
    kv_token = m.num_layers * 2 * m.num_query_groups * m.head_dim * 2
    one, two = (summary("mode.window_graphs=true", f"mode.window_graph_buckets={b}")["classes"][
        "reference_prefix_graphs"]["gib"] for b in (1, 2))
    assert (two - one) * 2**30 == pytest.approx(100 * kv_token)  # a bucket: one group's prefix K/V
    packed = summary("mode.window_graphs=true", "workload.prefix_pack_tokens=400")  # 4 prefixes of 100 a pack
    assert packed["classes"]["reference_prefix_graphs"]["gib"] == pytest.approx(4 * pool)


@pytest.mark.parametrize("mode", ["serial", "prefix_shared", "rollplex"])
def test_prefetch_ahead_takes_what_fits_the_phase_before(mode):
    """`ahead_phases` at 3B on video_long's batching under the phase plan: with room for everything, each released
    offload class comes back in the phase before its own (Adam states and masters in the update; the reference
    in the phase before its first read), and exactly that phase grows by exactly its bytes; with a budget just
    under the update's total with Adam's states, the states (tried first) stay out and the masters, which fit
    alone, come early."""
    cfg = load_run_config(["+bench=video_long", "model=qwen2_5_vl_3b", f"mode.name={mode}"])
    s = M.workload_shape(cfg)
    base = M.summarize(M.plan(cfg, mode, "phase", "embedded", s), mode)
    ref_before = {"serial": "old_logp", "prefix_shared": "old_logp", "rollplex": "optimizer"}[mode]
    room = A.ahead_phases(cfg, mode, "phase", s, 1e6)
    assert room == {"optimizer_states": "update", "main_weights": "update", "reference_weights": ref_before}
    got = M.summarize(M.plan(cfg, mode, "phase", "embedded", s, room), mode)
    gib = {n: base["classes"][n]["gib"] for n in room}
    for phase, total in got["phase_gib"].items():
        grown = sum(g for n, g in gib.items() if room[n] == phase)
        assert total == pytest.approx(base["phase_gib"][phase] + grown, abs=1e-9), phase
    tight = base["phase_gib"]["update"] + gib["optimizer_states"] - 0.5
    assert gib["main_weights"] < gib["optimizer_states"] - 0.5  # so the masters fit where the states do not
    some = A.ahead_phases(cfg, mode, "phase", s, tight)
    assert "optimizer_states" not in some and some["main_weights"] == "update"
    assert M.summarize(M.plan(cfg, mode, "phase", "embedded", s, some), mode)["phase_gib"]["update"] <= tight
    assert A.ahead_phases(cfg, mode, "keep", s, 1e6) == {}  # nothing released, nothing to bring back


def test_the_setup_point_is_the_fullest_point_of_start_up_and_of_a_resume():
    """Start-up builds actor, grads, masters, reference, releasing each released class at once; a resume brings the
    masters back with the Adam states its load creates. Sizes of a bf16 actor of n parameters (n = 1)."""
    w = {"actor_weights": 2, "grads": 4, "main_weights": 4, "optimizer_states": 8, "reference_weights": 2}
    every = frozenset(M.RELEASE_ORDER)
    assert sum(w[n] for n in M.setup_classes(w, every, ref=True)) == 6  # actor + grads, or actor + masters
    assert set(M.setup_classes(w, frozenset(), ref=True)) == {"actor_weights", "grads", "main_weights",
                                                              "reference_weights"}  # keep: all built stay
    assert set(M.setup_classes(w, every, ref=True, resume=True)) == {"actor_weights", "main_weights",
                                                                     "optimizer_states"}
    kept_grads = M.setup_classes(w, every - {"grads"}, ref=False, resume=True)
    assert sum(w[n] for n in kept_grads) == 18
    cfg = load_run_config(["dtype=bfloat16", "memory.plan=phase", "train.reference=always"])
    setup = M.summarize(M.rollplex_plan(cfg), "rollplex")["by_phase_gib"]["setup"]
    assert set(setup) == set(M.setup_classes(M._weights(cfg), every, ref=True))


@pytest.mark.parametrize("tp", [1, 2])
def test_the_update_counts_the_output_layers_weight_gradient(tp):
    """autograd makes the output layer's weight gradient in the parameters' dtype at the backward's first op, and
    it lives until DDP's hook adds it to the fp32 main grad (tied embeddings: to the backward's end): the update
    phase holds one, this rank's vocabulary shard, in every mode; no forward-only phase does."""
    cfg = load_run_config(["dtype=bfloat16", f"parallel.tp={tp}"])
    m = cfg.model
    for mode in ("serial", "prefix_shared", "rollplex"):
        c = {x.name: x for x in M.plan(cfg, mode, "phase", "embedded")}["output_weight_grad"]
        assert (c.bytes, c.resident) == (2 * (m.padded_vocab_size(tp) // tp) * m.hidden_size, ("update",)), mode
