"""The analytic memory planner: parameter counts against built models, bytes by hand, the 32B figure."""
import json
import subprocess
import sys

import pytest

from rollplex_megatron.dist import run_local
from rollplex_megatron.memory import planner as M
from rollplex_megatron.recipes import load_run_config


def _local_params(tp, pp, tie):
    from rollplex_megatron.dist import init_parallel
    from rollplex_megatron.models.qwen25vl import build_model

    cfg = load_run_config([f"parallel.tp={tp}", f"parallel.pp={pp}", f"model.tie_word_embeddings={tie}"])
    init_parallel(tp, pp)
    return sum(p.numel() for p in build_model(cfg.model).parameters())


@pytest.mark.parametrize("pp,tie", [(1, False), (1, True), (2, False), (2, True)])
def test_parameter_count_equals_the_built_model(pp, tie):
    """Exact at TP=1: the fullest pipeline stage's parameters as megatron builds them."""
    cfg = load_run_config([f"model.tie_word_embeddings={tie}"]).model
    counts = run_local(_local_params, pp, 1, pp, tie)
    assert max(counts) == M.params_per_gpu(cfg, 1, pp), (counts, M.params_per_gpu(cfg, 1, pp))


def test_parameter_count_at_tp2_within_replicated_norms():
    cfg = load_run_config([]).model
    counts = run_local(_local_params, 2, 2, 1, False)
    assert abs(max(counts) - M.params_per_gpu(cfg, 2, 1)) / max(counts) < 0.01


def test_kv_and_class_bytes_by_hand():
    cfg = load_run_config(["workload.rollout_batch=32", "rollout.group_size=4", "workload.responses_per_micro_batch=2",
                           "plan.prefix_tokens=100", "plan.response_tokens=10", "plan.vision_patches=64"])
    m = cfg.model  # tiny: 4 layers, 2 KV groups of head dim 16
    assert M.kv_bytes_per_token(m, 1, m.num_layers) == 2 * 4 * 2 * 16 * 2
    assert M.kv_bytes_per_token(m, 4, m.num_layers) == 2 * 4 * 1 * 16 * 2  # KV heads replicate past TP=2
    serial = {c.name: c for c in M.serial_plan(cfg)}
    assert serial["rollout_kv"].bytes == 32 * 110 * 512  # 8 prompts x G=4 samples, prompt + response each
    n = M.params_per_gpu(m, 1, 1)
    assert [serial[k].bytes for k in ("actor_weights", "main_weights", "grads", "optimizer_states")] == \
        [2 * n, 4 * n, 4 * n, 8 * n]
    s = M.summarize(M.serial_plan(cfg), "serial")
    assert s["peak_gib"] * M.GIB == pytest.approx(sum(c.bytes for c in serial.values()))
    r = M.summarize(M.rollplex_plan(cfg), "rollplex")
    assert {"main_weights", "optimizer_states", "grads"}.isdisjoint(r["by_phase_gib"]["rollout"])
    assert {"main_weights", "optimizer_states", "grads", "actor_weights"} <= set(r["by_phase_gib"]["optimizer"])
    assert r["classes"]["rollout_kv"]["gib"] * M.GIB == 32 * 10 * 512  # responses only: prefixes are per group
    assert r["classes"]["actor_prefix_kv"]["gib"] * M.GIB == 8 * 100 * 512 * 2  # fp32 leaves, one per group


def test_plan_memory_32b_reproduces_the_paper_setting():
    p = subprocess.run([sys.executable, "-m", "rollplex_megatron", "plan-memory", "model=qwen2_5_vl_32b", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["gpus"] == 32 and (res["tp"], res["dp"]) == (8, 4)
    assert 160 <= res["serial_peak_gib"] <= 170 and res["rollplex_peak_gib"] <= 80 and res["rollplex_fits"]
    assert set(res["serial"]["by_phase_gib"]) == {"rollout", "old_logp", "ref_logp", "update", "optimizer"}


def test_over_budget_names_the_class_and_the_fix():
    p = subprocess.run([sys.executable, "-m", "rollplex_megatron", "plan-memory", "model=qwen2_5_vl_32b",
                        "memory.budget_gib=40"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 1
    assert "rollout_kv" in p.stderr and "memory.budget_gib=40" in p.stderr and "parallel.tp" in p.stderr
