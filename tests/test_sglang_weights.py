"""Megatron's training shards as SGLang's parameters: SGLang's per-rank layout (the rules the weight-sharing
tests check), views aliasing the training storage, and the loader binding SGLang's parameters to that memory
(storage identity on CPU), so an optimizer step reaches SGLang without a copy."""
import pytest

from rollplex_megatron.dist import run_local
from tests.sglang_workers import sglang_shards


@pytest.mark.parametrize("t,r", [(1, 1), (2, 2), (2, 1), (1, 2)])
def test_sglang_shards_alias_training_storage(tiny_hf, t, r):
    for res in run_local(sglang_shards, max(t, r), str(tiny_hf), t, r):
        assert max(res["value"]) == 0.0, max(res["value"])  # SGLang's shard, exactly
        assert all(same == (klass in ("view", "strided_view")) for klass, same in res["alias"].values()), res["alias"]
        assert res["bound"]  # SGLang's parameters are the trainer's tensors
        assert res["after_step"] == 0.0, res["after_step"]  # the optimizer step reached them
        assert any(n.endswith("self_attn.qkv_proj.weight") for n in res["names"])
        assert any(n.endswith("attn.qkv_proj.weight") and n.startswith("visual.") for n in res["names"])
        assert any(n.endswith("mlp.gate_up_proj.weight") for n in res["names"])
        if t == r:  # equal degrees: only the layouts that differ (fused QKV order, vocab padding) own bytes
            views = [k for k, same in res["alias"].values() if same]
            assert len(views) > len(res["alias"]) // 2


def test_sglang_loader_mutation_copy_is_caught(tiny_hf):
    """Mutation: a loader that copies into SGLang's own memory binds nothing, and the step does not reach it."""
    res = run_local(sglang_shards, 1, str(tiny_hf), 1, 1, "copy")[0]
    assert not res["bound"]
    assert res["after_step"] > 1e-2


@pytest.mark.parametrize("overrides,match", [
    (["rollout.engine=vllm"], "rollout.engine must be one of"),
    (["rollout.engine=sglang"], "needs an HF checkpoint"),
    (["rollout.engine=sglang", "rollout.sglang.model_path=x", "model=tiny", "parallel.pp=2"], "parallel.pp=1"),
    (["rollout.engine=sglang", "rollout.sglang.model_path=x", "model=tiny", "parallel.tp=2", "rollout.tp=1"],
     "tp_size = parallel.tp"),
    (["rollout.engine=sglang", "rollout.sglang.model_path=x", "+rollout.sglang.engine_args.tp_size=2"],
     "engine_args.tp_size"),
    (["rollout.sglang.mem_fraction_static=1.5"], "mem_fraction_static"),
])
def test_sglang_settings_fail_up_front(overrides, match):
    """Bad rollout.engine / rollout.sglang settings: one line naming the setting, before anything is built."""
    from rollplex_megatron.recipes import load_run_config

    with pytest.raises(Exception, match=match):
        load_run_config(overrides)


def test_train_without_sglang_fails_before_any_work(tmp_path, monkeypatch, capsys):
    """rollout.engine=sglang where SGLang is not importable: one line before a run directory or a model exists."""
    import sys

    from rollplex_megatron.cli import main

    monkeypatch.setitem(sys.modules, "sglang", None)  # import fails as where it is not installed
    runs = tmp_path / "runs"
    assert main(["train", "rollout.engine=sglang", "rollout.sglang.model_path=x", "train.steps=1",
                 f"run_dir={runs}"]) == 1
    err = capsys.readouterr().err
    assert "rollout.engine=sglang needs SGLang in this environment" in err and err.count("\n") == 1, err
    assert not runs.exists()
