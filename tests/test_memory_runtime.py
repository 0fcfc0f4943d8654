"""The memory manager at run time: bit-exact offload round trips, the same update with the phase plan
as with everything resident, prefix recompute against the saved graph, the budget check, and the
planner's activation count against autograd's saved tensors."""
import re
import subprocess
import sys

import pytest
import torch

from rollplex_megatron.dist import run_local
from rollplex_megatron.recipes import load_run_config
from tests import memory_workers as W
from tests.in_turn import case, in_turn
from tests.test_trainer import TOL, _param_err

STEPS = ["workload.rollout_batch=16", "rollout.group_size=4", "workload.responses_per_micro_batch=4",
         "task.max_answer_tokens=4"]


ACTIVATION_CASES = [
    ["model=tiny"],
    ["model=qwen2_5_vl_3b", "model.num_layers=1", "model.vision.depth=2", "model.vision.fullatt_block_indexes=[1]"],
    ["model=tiny", "train.norm_kernel=triton"],  # the fused RMSNorm (interpreted on CPU) saves x and an fp32 rsqrt
    ["model=tiny", "train.rope_kernel=triton"],  # the fused RoPE: one cos/sin table per forward, not per layer
]


def _recompute_cfg(tp, pp):
    return load_run_config([f"parallel.tp={tp}", f"parallel.pp={pp}", "rollout.group_size=3", "verify.seed=21"])


@pytest.fixture(scope="module")
def one_rank(tiny_hf):
    """This file's one-process runs without a mutation, in one job (`tests.in_turn`), each on its own fresh
    objects: the offload round trip, the activation counts, the recompute check at TP=PP=1 and the keep-plan
    run and the prefetch-ahead run (compared only with runs of other processes)."""
    base = ["model=tiny", "dtype=bfloat16", "mode.name=rollplex", "train.reference=always"] + STEPS
    cfg = load_run_config(base + ["memory.plan=phase"])  # the reference's weights are one offloaded class
    calls = {"round_trip": (W.round_trip, (cfg,))}
    for plan in ("phase", "keep"):
        calls["setup", plan] = (W.setup_points, (load_run_config(base + [f"memory.plan={plan}"]),))
    calls["setup", "no_release"] = (W.setup_points, (cfg, "no_release"))
    for i, overrides in enumerate(ACTIVATION_CASES):
        calls["activations", i] = (saved_prefix_bytes, (overrides,))
    calls["recompute", 1, 1] = (W.recompute_vs_saved, (_recompute_cfg(1, 1), tiny_hf))
    calls["keep"] = (W.plan_steps, (_cfg_of("keep", tiny_hf), 3))
    ahead = _cfg_of("phase", tiny_hf, "memory.prefetch_ahead=true", "memory.budget_gib=64")
    calls["ahead"] = (W.plan_steps, (ahead, 3))
    return run_local(in_turn, 1, calls)[0]


def test_offload_round_trip_is_bit_exact_and_frees_the_device_storage(one_rank):
    out = case(one_rank, "round_trip")
    assert all(n > 0 for n in out["counts"].values()), out["counts"]  # bf16: main weights and Adam states exist
    assert out["released_update"] == {"main_weights": 0, "optimizer_states": 0, "reference_weights": 0}
    assert out["grads_rollout"] == 0
    assert out["bit_exact"] == {"main_weights": True, "optimizer_states": True, "reference_weights": True}
    assert out["grads_zero_after_restore"]
    managed = out["managed"]
    assert managed["optimizer"]["optimizer_states"] > 0 and managed["rollout"]["optimizer_states"] == 0


@pytest.mark.parametrize("plan", ["phase", "keep"])
def test_start_up_holds_what_the_planners_setup_point_counts(one_rank, plan):
    """The runtime builds the actor, DDP's grads, the masters and the reference in the order the planner counts,
    releasing each released class as soon as it exists: the fullest construction point holds exactly the
    planner's `setup` classes (at the real tensors' sizes), and at the end every released class is off the device.
    Mutation: start-up releasing nothing holds more than the plan's setup point."""
    from rollplex_megatron.memory.planner import setup_classes

    out = case(one_rank, ("setup", plan))
    w, rel = out["sizes"], frozenset(out["released"])
    assert (plan == "phase") == bool(rel) and all(w[n] > 0 for n in w), (rel, w)
    want = sum(w[n] for n in setup_classes(w, rel, ref=True))
    assert max(sum(p.values()) for p in out["points"]) == want
    end = out["points"][-1]
    assert all(end[n] == 0 for n in rel & set(end)) and end["actor_weights"] == w["actor_weights"]
    if plan == "phase":
        mutant = case(one_rank, ("setup", "no_release"))
        assert max(sum(p.values()) for p in mutant["points"]) > want


@pytest.fixture(scope="module")
def keep_run(one_rank):
    return case(one_rank, "keep")


def _cfg_of(plan, hf, *extra):
    from tests.test_trainer import _cfg

    return _cfg("rollplex", *([f"memory.plan={plan}"] if plan else []), *extra, hf=hf)


def _plan_run(hf, plan, *extra, mutant=""):
    from tests.test_trainer import _cfg

    return run_local(W.plan_steps, 1, _cfg("rollplex", f"memory.plan={plan}", *extra, hf=hf), 3, mutant)[0]


def test_phase_plan_gives_the_same_update_as_keeping_everything(tiny_hf, keep_run, rollplex_run):
    """Offloaded Adam states and reference, freed gradients and the recomputed prefix: same 3 steps. The
    phase run is conftest's rollplex_run: test_trainer's BASE names memory.plan=phase, so it is this config."""
    assert _cfg_of("phase", tiny_hf) == _cfg_of(None, tiny_hf)
    run = rollplex_run
    assert run["tokens"] == keep_run["tokens"]
    err, name = _param_err(run, keep_run)
    assert err <= TOL, (name, err)
    rec = run["records"][-1]
    assert rec["offload_bytes"]["d2h"] > 0 and rec["offload_bytes"]["h2d"] > 0  # the plan did move tensors
    assert rec["phase_managed_bytes"]["rollout"]["optimizer_states"] == 0
    assert rec["phase_managed_bytes"]["optimizer"]["optimizer_states"] > 0
    assert rec["rollout"]["prefix_recompute_drift"] == 0.0  # recomputed K/V equal the prefill's
    # every host buffer was allocated at start-up (Adam's states sized before they existed): no step
    # pays for an allocation (on the GPU: pinning, the step-2 cost of bench_video_long_c1fc225.json)
    assert [r["host_allocations"] for r in run["records"]] == [0, 0, 0]
    assert keep_run["records"][-1]["offload_bytes"] == {"d2h": 0, "h2d": 0}


def test_prefetch_ahead_brings_classes_back_a_phase_early_with_the_same_update(one_rank, keep_run, rollplex_run):
    """memory.prefetch_ahead under a budget everything fits in: Adam states and masters come back at the update's
    entry and rollplex's reference at the optimizer step's (the phase before the rollout that reads it), each
    released again where the phase plan releases it; the 3 steps equal keeping everything."""
    run = case(one_rank, "ahead")
    want = {"optimizer_states": "update", "main_weights": "update", "reference_weights": "optimizer"}
    assert run["memory_ahead"] == run["memory_manager_ahead"] == want
    assert run["tokens"] == keep_run["tokens"]
    err, name = _param_err(run, keep_run)
    assert err <= TOL, (name, err)
    own = {"optimizer_states": "optimizer", "main_weights": "optimizer", "reference_weights": "rollout"}
    for step, (rec, plain) in enumerate(zip(run["records"], rollplex_run["records"])):
        got, base = rec["phase_managed_bytes"], plain["phase_managed_bytes"]
        for cls, phase in want.items():  # all of it early here, none of it under the phase plan
            assert got[phase][cls] == got[own[cls]][cls] and base[phase][cls] == 0, (step, cls, phase)
        # this run is fp32 (no master copies); Adam's states exist from the first optimizer step on
        assert got["optimizer"]["reference_weights"] > 0 and (step == 0 or got["update"]["optimizer_states"] > 0)
        assert got["rollout"]["optimizer_states"] == got["update"]["reference_weights"] == 0  # released still
        assert rec["offload_bytes"]["h2d"] > 0
    assert rollplex_run["memory_ahead"] == {}  # off by default


def test_stale_offload_is_detected(tiny_hf, keep_run):
    """Mutation: the offload copies each class to the host only once, so Adam's states come back stale."""
    run = _plan_run(tiny_hf, "phase", mutant="copy_once")
    err, _ = _param_err(run, keep_run)
    assert err > 10 * TOL


@pytest.mark.parametrize("tp,pp", [(1, 1), (1, 2), (2, 1)])
def test_prefix_recompute_equals_the_saved_graph(request, tiny_hf, tp, pp):
    outs = [case(request.getfixturevalue("one_rank"), ("recompute", 1, 1))] if tp * pp == 1 else run_local(
        W.recompute_vs_saved, tp * pp, _recompute_cfg(tp, pp), tiny_hf)
    for o in outs:
        assert o["grad_norm_sum"] > 0 and o["same_logp"]
        assert o["err"] <= 1e-6, o["err"]  # same ops on the same inputs: equal up to reduction order


def test_prefix_recompute_mutation_is_detected(tiny_hf):
    o = run_local(W.recompute_vs_saved, 1, _recompute_cfg(1, 1), tiny_hf, "empty_recompute")[0]
    assert o["err"] > 1e-2


def test_budget_error_names_the_class_and_fires_before_models_are_built(tmp_path):
    from rollplex_megatron.data import build_source
    from rollplex_megatron.trainer.runtime import memory_plan

    cfg = load_run_config(["model=qwen2_5_vl_3b", "dtype=bfloat16", "task=motion_long", "workload=vlm_gpu",
                           "mode.name=serial", "memory.plan=keep", "memory.budget_gib=80"])
    with pytest.raises(ValueError) as e:
        memory_plan(cfg, build_source(cfg))  # the planner only: no model, no device
    msg = str(e.value)
    assert "memory.budget_gib=80" in msg and "'update'" in msg and "update_activations" in msg and "to fit:" in msg
    assert "memory.plan=phase would need 76.9 GiB" in msg
    cfg.memory.plan = "phase"
    assert memory_plan(cfg, build_source(cfg))["peak_gib"] <= 80  # the phase plan fits
    runs = tmp_path / "runs"
    p = subprocess.run([sys.executable, "-m", "rollplex_megatron", "train", "memory.budget_gib=0.0001",
                        "train.steps=1", f"run_dir={runs}"], capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "over memory.budget_gib=0.0001" in p.stderr and "to fit:" in p.stderr
    need = re.search(r"plan needs ([0-9.e-]+) GiB", p.stderr)  # the tiny model's MiBs, not a bare "0.0"
    assert need and 0.0001 < float(need.group(1)) < 1, p.stderr
    # the refused start left no run directory (refused before one is created, or removed after)
    assert not runs.exists() or not any(runs.iterdir())


def test_kv_budget_too_small_fails_before_models_are_built(tmp_path):
    """A KV budget that cannot hold one group is refused by `train` at start-up (it used to fail in the first
    rollout, after the models were built), and the refused start leaves no run directory."""
    runs = tmp_path / "runs"
    p = subprocess.run([sys.executable, "-m", "rollplex_megatron", "train", "memory.kv_cache_gib=0.00001",
                        "train.steps=1", f"run_dir={runs}"], capture_output=True, text=True, timeout=300)
    assert p.returncode != 0, p.stdout[-2000:]
    line = p.stderr.strip().splitlines()[-1]
    assert re.search(r"memory\.kv_cache_gib=1e-05 is too small: one group of the rendered task's prompt "
                     r"\(\d+ tokens\) with rollout\.group_size=\d+ responses of up to "
                     r"task\.max_answer_tokens=\d+", line), line
    assert not any(runs.iterdir())


def test_auto_plan_releases_only_what_the_budget_needs():
    """memory.plan=auto on 3B plans: nothing released when everything fits; under a tighter budget a
    set that fits and is minimal (keeping any one of its classes goes over the budget); an error when
    nothing fits. rollplex on video_long needs the prefix graphs alone released, where the release
    order's shortest fitting prefix would also offload Adam states, master weights and the reference."""
    from rollplex_megatron.data import build_source
    from rollplex_megatron.memory.planner import plan, runtime_cfg, summarize
    from rollplex_megatron.trainer.runtime import memory_plan

    def check_minimal(cfg, got, budget):
        assert got["peak_gib"] <= budget, (budget, got["released"])
        for name in got["released"]:
            kept = frozenset(got["released"]) - {name}
            one_less = summarize(plan(runtime_cfg(cfg), cfg.mode.name, kept, "embedded", _shape(got)), cfg.mode.name)
            assert one_less["peak_gib"] > budget, (budget, name)  # not one class more than needed

    base = ["model=qwen2_5_vl_3b", "dtype=bfloat16", "task=motion_long", "workload=vlm_gpu", "mode.name=serial"]
    src = build_source(load_run_config(base))
    keep = memory_plan(load_run_config(base + ["memory.plan=keep"]), src)
    assert memory_plan(load_run_config(base + ["memory.plan=auto", f"memory.budget_gib={keep['peak_gib'] + 1}"]),
                       src)["released"] == []
    for budget in (keep["peak_gib"] - 1, 90, 78):  # phase (all released) needs 76.9 GiB
        cfg = load_run_config(base + ["memory.plan=auto", f"memory.budget_gib={budget}"])
        got = memory_plan(cfg, src)
        assert got["released"], budget
        check_minimal(cfg, got, budget)
    with pytest.raises(ValueError, match="memory.plan=auto"):
        memory_plan(load_run_config(base + ["memory.plan=auto", "memory.budget_gib=20"]), src)

    bench = ["+bench=video_long", "mode.name=rollplex"]
    src = build_source(load_run_config(bench))
    for budget, want in ((134, ["actor_prefix_graph"]), (84, ["optimizer_states", "actor_prefix_graph"]),
                         (78, ["optimizer_states", "reference_weights", "actor_prefix_graph"])):
        cfg = load_run_config(bench + ["memory.plan=auto", f"memory.budget_gib={budget}"])
        got = memory_plan(cfg, src)
        assert got["released"] == want, (budget, got["released"])
        check_minimal(cfg, got, budget)
    keep = memory_plan(load_run_config(bench + ["memory.plan=keep"]), src)
    assert keep["peak_gib"] > 134  # the prefix graphs of 16 video prompts do not fit beside the rest
    # mode.window_graphs: the reference is never released (its graphs read its weights where they were captured),
    # and the graphs' pool is planned: at 78 GiB, where the reference went above, nothing fits
    graphs = bench + ["mode.window_graphs=true", "memory.plan=auto"]
    got = memory_plan(load_run_config(graphs + ["memory.budget_gib=134"]), src)
    assert got["released"] == ["actor_prefix_graph"] and "reference_prefix_graphs" in got["classes"], got["released"]
    with pytest.raises(ValueError, match=r"everything releasable released; the reference kept for mode.window_graphs"):
        memory_plan(load_run_config(graphs + ["memory.budget_gib=78"]), src)


@pytest.mark.parametrize("plan,ahead", [("keep", False), ("phase", False), ("phase", True), ("auto", False),
                                        ("auto", True)])  # keep with prefetch_ahead is refused (test_bad_input)
@pytest.mark.parametrize("pack", [0, 4096])
def test_the_plan_reads_the_free_memory_exactly_where_the_config_says(monkeypatch, plan, ahead, pack):
    """`RunConfig.budget_from_free_memory` (which also decides whether memory.auto_margin_gib is refused as
    unread) names exactly the runs whose planning asks the device for its free memory: `memory_plan` calls
    `auto_budget_gib` (recorded here, standing in for the device) when and only when it says so."""
    from rollplex_megatron.data import build_source
    from rollplex_megatron.trainer import runtime as R

    cfg = load_run_config(["model=tiny", f"memory.plan={plan}", f"memory.prefetch_ahead={str(ahead).lower()}",
                           f"workload.prefix_pack_tokens={pack}", "workload.micro_batch_tokens=0",
                           "rollout.keep_decode_state=false",  # no size left to the planner's auto_size
                           *(["memory.optimizer_step=resident"] if plan != "keep" else [])])
    calls = []
    monkeypatch.setattr(R, "auto_budget_gib", lambda c: calls.append(c) or 1000.0)
    R.memory_plan(cfg, build_source(cfg))
    assert bool(calls) == cfg.budget_from_free_memory, (plan, ahead, pack, len(calls))
    assert cfg.budget_from_free_memory == (plan == "auto" or ahead or (plan == "phase" and pack > 0))


def test_only_prefix_packs_check_the_phase_plan_against_the_free_memory(monkeypatch):
    """Under memory.plan=phase the free memory bounds the plan only where a recomputed pack's graph is held at
    once (prefix packs): `memory.prefetch_ahead` alone reads it to choose what comes early, and does not make a
    plan over it fail (a device with almost nothing free stands in)."""
    from rollplex_megatron.data import build_source
    from rollplex_megatron.trainer import runtime as R

    monkeypatch.setattr(R, "auto_budget_gib", lambda c: 0.001)
    ahead = load_run_config(["model=tiny", "memory.plan=phase", "memory.prefetch_ahead=true"])
    assert R.memory_plan(ahead, build_source(ahead))["ahead"] == {}  # nothing fits early in 0.001 GiB
    packs = load_run_config(["model=tiny", "memory.plan=phase", "workload.prefix_pack_tokens=4096"])
    with pytest.raises(ValueError, match="memory.plan=phase"):
        R.memory_plan(packs, build_source(packs))


def _shape(summary):
    from rollplex_megatron.memory.classes import Shape

    return Shape(**summary["shape"])


def test_auto_plan_gives_the_same_update_as_keep_and_keeps_all_without_a_budget(tiny_hf, keep_run):
    """On CPU without a budget auto releases nothing; under a budget between keep's and phase's peaks
    it releases some classes and trains the same 3 steps as keep."""
    from rollplex_megatron.data import build_source
    from rollplex_megatron.trainer.runtime import memory_plan
    from tests.test_trainer import _cfg

    probe = _cfg("rollplex", "memory.plan=keep", hf=tiny_hf)
    peak = memory_plan(probe, build_source(probe))["peak_gib"]
    assert memory_plan(_cfg("rollplex", "memory.plan=auto", hf=tiny_hf), build_source(probe))["released"] == []
    run = _plan_run(tiny_hf, "auto", f"memory.budget_gib={peak * 0.999}")
    rel = run["records"][-1]["memory_released"]
    assert rel and "optimizer_states" in rel and len(rel) < 5
    assert run["tokens"] == keep_run["tokens"]
    err, name = _param_err(run, keep_run)
    assert err <= TOL, (name, err)
    assert run["records"][-1]["offload_bytes"]["d2h"] > 0


def _qwen25_fused_norms(cfg) -> int:
    """FusedRMSNorm modules of a Qwen2.5-VL build: two a layer and a block, the final norm, the merger's."""
    return 2 * (cfg.model.num_layers + cfg.model.vision.depth) + 2


def saved_prefix_bytes(overrides, fused_norms=_qwen25_fused_norms) -> tuple[int, int]:
    """Bytes autograd saves in one bf16 prefix forward with a graph on a rendered video prompt (parameters
    excluded), and the planner's `prefix_graph_bytes` for it; `fused_norms(cfg)`: the family's FusedRMSNorm count
    under the Triton norm kernel (checked: the plan counts what the build runs)."""
    from rollplex_megatron.attention.kv_store import KVStore
    from rollplex_megatron.dist import init_parallel
    from rollplex_megatron.envs.motion import MotionEnv
    from rollplex_megatron.memory.planner import norm_kernel, rope_kernel, runtime_cfg
    from rollplex_megatron.memory.tensor_bytes import prefix_graph_bytes
    from rollplex_megatron.prefix.batch import Group
    from rollplex_megatron.prefix.execution import prefix_forward
    from rollplex_megatron.trainer.runtime import training_model

    cfg = load_run_config(["dtype=bfloat16", "task=motion_long"] + overrides)
    init_parallel(1, 1)
    model = training_model(cfg)  # the trainer's build: train.norm_kernel's RMSNorms
    norm, rope = norm_kernel(runtime_cfg(cfg)), rope_kernel(runtime_cfg(cfg))  # what the trainer's plan counts
    fused = sum(type(m).__name__ == "FusedRMSNorm" for m in model.modules())
    assert fused == (fused_norms(cfg) if norm == "triton" else 0), fused
    env = MotionEnv(cfg.task, cfg.model)
    prompt = env.prompt(env.episode(0))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[(s.data_ptr(), s.nbytes())] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        prefix_forward(model, [Group(prompt, [], torch.zeros(0))], KVStore(), keep_graph=True)
    n, patches = prompt.input_ids.numel() - 1, prompt.pixel_values_videos.shape[0]
    return sum(seen.values()), prefix_graph_bytes(cfg.model, 1, 1, False, n, patches, norm, rope)


@pytest.mark.parametrize("i", range(len(ACTIVATION_CASES)), ids=["tiny", "3b_one_layer", "tiny_fused_norm",
                                                                "tiny_fused_rope"])
def test_activation_count_matches_autograds_saved_tensors(one_rank, i):
    """The planner's per-token/per-patch bytes against what a bf16 prefix forward really saves."""
    measured, predicted = case(one_rank, ("activations", i))
    assert abs(measured - predicted) / measured < 0.01, (measured, predicted)


def test_fused_norm_saves_exactly_the_planned_bytes_less(one_rank):
    """The tiny model with train.norm_kernel=triton against torch's RMSNorm, same prompt: autograd saves
    exactly the bytes the planner counts less (each norm 2h + 4 per row instead of 8h + 4)."""
    (torch_saved, torch_planned), (fused_saved, fused_planned) = (case(one_rank, ("activations", i)) for i in (0, 2))
    assert torch_saved - fused_saved == torch_planned - fused_planned > 0


def test_fused_rope_saves_exactly_the_planned_bytes_less(one_rank):
    """The tiny model with train.rope_kernel=triton against megatron's rotary, same prompt: autograd saves
    exactly the bytes the planner counts less (8 D per token and layer or block, less one 4 D table per
    forward for the LLM and one for the vision tower)."""
    (torch_saved, torch_planned), (fused_saved, fused_planned) = (case(one_rank, ("activations", i)) for i in (0, 3))
    assert torch_saved - fused_saved == torch_planned - fused_planned > 0, (torch_saved, fused_saved,
                                                                           torch_planned, fused_planned)


def test_views_of_one_buffer_offload_once_and_come_back():
    """Tensors that are views of one storage (e.g. a flat buffer) move as one unit, bit-exact."""
    from rollplex_megatron.memory.manager import MemoryManager, OffloadClass

    flat = torch.randn(100, dtype=torch.float64)
    views = [flat[:30], flat[30:].view(10, 7), torch.randn(5)]
    want = [v.clone() for v in views]
    mm = MemoryManager.__new__(MemoryManager)
    mm.cuda, mm.device, mm.copy_streams, mm.copy_bytes = False, "cpu", None, {"d2h": 0, "h2d": 0}
    c = OffloadClass("flat", lambda: views)
    mm._offload(c)
    assert flat.untyped_storage().nbytes() == 0 and len(c.host) == 2  # two storages, not three tensors
    assert mm.copy_bytes["d2h"] == 100 * 8 + 5 * 4
    mm._prefetch(c)
    assert all(torch.equal(v, w) for v, w in zip(views, want))


def test_tensors_from_a_checkpoint_are_adopted_before_offload(tmp_path):
    """torch.load gives storages that cannot be resized; the manager moves them first (values kept)."""
    from rollplex_megatron.memory.manager import MemoryManager, OffloadClass

    torch.save({"a": torch.randn(7), "b": torch.randn(3, 3)}, tmp_path / "s.pt")
    state = torch.load(tmp_path / "s.pt")
    tensors = [state["a"], state["b"]]
    want = [t.clone() for t in tensors]
    mm = MemoryManager.__new__(MemoryManager)
    mm.cuda, mm.device, mm.copy_streams, mm.copy_bytes = False, "cpu", None, {"d2h": 0, "h2d": 0}
    c = OffloadClass("loaded", lambda: tensors)
    mm._offload(c)
    assert all(t.untyped_storage().nbytes() == 0 for t in state.values())  # the dict's own tensors released
    mm._prefetch(c)
    assert all(torch.equal(state[k], w) for k, w in zip("ab", want))


def test_a_class_ahead_comes_back_once_when_update_and_optimizer_alternate():
    """Three mini-batches a step (update and optimizer alternate): rollplex's reference, ahead at the optimizer
    step, is copied in at the last optimizer step only (the one the rollout follows), not at each; the masters,
    ahead at the update, stay through the alternation; the next step's rollout finds the reference, bit-exact."""
    from types import SimpleNamespace

    from rollplex_megatron.memory.manager import MemoryManager

    g = torch.Generator().manual_seed(11)
    main = [torch.randn(40 + i, generator=g) for i in range(3)]
    ref = [torch.randn(25 + i, generator=g).to(torch.bfloat16) for i in range(2)]
    want_ref = [r.clone() for r in ref]
    optimizer = SimpleNamespace(fp32_from_float16_groups=[main], optimizer=SimpleNamespace(state={}, param_groups=[]))
    mm = MemoryManager(frozenset({"main_weights", "reference_weights"}), "rollplex",
                       SimpleNamespace(buffers=[], expert_parallel_buffers=[]), optimizer,
                       SimpleNamespace(parameters=lambda: ref), ahead={"reference_weights": "optimizer",
                                                                       "main_weights": "update"})
    ref_bytes, main_bytes = sum(r.nbytes for r in ref), sum(m.nbytes for m in main)
    resident = lambda ts: all(t.untyped_storage().nbytes() > 0 for t in ts)  # noqa: E731
    for step in range(2):
        for phase in ("rollout", "reward", "ref_logp"):
            mm.enter(phase)
        mm.new_step()
        seen = []
        for k in range(3):
            mm.enter("update")
            mm.enter("optimizer", None if k == 2 else "update")
            seen.append((resident(ref), resident(main)))
        assert seen == [(False, True), (False, True), (True, True)], (step, seen)
        # one copy in of the reference a step; the masters come back once (at the first update) and leave never
        assert mm.copy_bytes == {"d2h": ref_bytes * (step == 0), "h2d": ref_bytes + main_bytes}, (step, mm.copy_bytes)
    mm.enter("rollout")
    assert resident(ref) and not resident(main)
    assert all(torch.equal(a, b) for a, b in zip(ref, want_ref))


def test_holding_a_class_that_held_nothing_waits_for_no_copy():
    """An fp32 run's optimizer has no master weights: start-up releases an empty class, and a resume's `holding`
    brings it back with no copy, so it must not wait for a copy event (on CUDA it would wait on None). The manager
    is told it runs on CUDA; any CUDA call would fail here."""
    from rollplex_megatron.memory.manager import MemoryManager

    mm = MemoryManager(frozenset({"main_weights"}), "rollplex", None, None, None)
    mm.release_built(("main_weights",))
    c = mm.classes["main_weights"]
    assert (c.resident, c.sizes, c.event) == (False, [], None)
    mm.cuda = True
    with mm.holding(("main_weights",)):
        assert c.resident
    assert not c.resident


def test_the_host_reader_gives_released_tensors_their_values():
    """A checkpoint is written with released classes read from their host buffers (`host_reader`): views at storage
    offsets inside one flat buffer (as megatron's masters are) and whole tensors read back their values from before
    the release, a resident tensor its own; the device storage stays released. A class released without a host
    copy is refused by name. Mutation: reading each view from its buffer's start (its storage offset dropped)."""
    from types import SimpleNamespace

    from rollplex_megatron.memory import manager as M

    g = torch.Generator().manual_seed(5)
    flat = torch.randn(100, generator=g)
    main = [flat[:30].view(5, 6), flat[30:100].view(7, 10)]  # views into one storage
    ref = [torch.randn(9, generator=g).to(torch.bfloat16), torch.randn(4, 3, generator=g).to(torch.bfloat16)]
    want = {id(t): t.clone() for t in main + ref}
    optimizer = SimpleNamespace(fp32_from_float16_groups=[main], optimizer=SimpleNamespace(state={}, param_groups=[]))
    mm = M.MemoryManager(frozenset({"main_weights", "reference_weights"}), "rollplex",
                         SimpleNamespace(buffers=[], expert_parallel_buffers=[]), optimizer,
                         SimpleNamespace(parameters=lambda: ref))
    mm.enter("rollout")  # rollplex's rollout: masters released, the reference held
    mm.enter("update")  # the update: both released
    assert all(t.untyped_storage().nbytes() == 0 for t in ref)
    read = mm.host_reader()
    assert all(torch.equal(read(t), want[id(t)]) for t in ref)  # the reference from its host copy
    mm.enter("rollout")
    assert all(t.untyped_storage().nbytes() == 0 for t in main)
    read = mm.host_reader()
    for t in main + ref:
        assert torch.equal(read(t), want[id(t)])
    assert all(t.untyped_storage().nbytes() == 0 for t in main)  # nothing came back
    loose = torch.arange(3.0)
    assert read(loose) is loose  # a resident tensor is written as it is
    assert all(read(t).untyped_storage().data_ptr() == h.data_ptr()  # views of the host buffers: no new memory
               for t, h in zip(main, mm.classes["main_weights"].host))
    with pytest.MonkeyPatch.context() as mp:  # the mutation
        mp.setattr(M, "_host_view", lambda h, t: h.view(t.dtype)[:t.numel()].view(t.shape))
        wrong = mm.host_reader()
        assert torch.equal(wrong(main[0]), want[id(main[0])])  # at offset 0 the mutant is right
        assert not torch.equal(wrong(main[1]), want[id(main[1])])
    mm.classes["main_weights"].host_valid = False
    with pytest.raises(RuntimeError, match="memory class main_weights is released without a current host copy"):
        mm.host_reader()
