"""The user-facing commands end to end, as a user runs them (fresh processes)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollplex_megatron.compat import applied_shims, apply_cpu_shims


def _run(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "rollplex_megatron", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("tp", [1, 2])
def test_verify_hf_json(tiny_hf, tp):
    r = _run("verify-hf", "--hf-dir", tiny_hf, "--tp", str(tp), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["tp"] == tp and res["max_abs_logit_diff"] <= 1e-4 and res["ok"] is True


def test_verify_hf_exits_1_on_mismatch(tiny_hf, monkeypatch, capsys):
    """Exit status 1 and ok=false when the logits disagree (megatron side mutated: plain [q;k;v])."""
    from rollplex_megatron import dist
    from rollplex_megatron.cli import main
    from tests.test_hf_parity import _verify_with_plain_qkv

    real = dist.run_local
    monkeypatch.setattr(dist, "run_local",
                        lambda fn, n, d, tp, seed, **launch: real(_verify_with_plain_qkv, n, d, tp))
    assert main(["verify-hf", "--hf-dir", tiny_hf, "--json"]) == 1
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["ok"] is False and res["max_abs_logit_diff"] > 1e-2


def test_verify_hf_bad_tp_fails_before_launch(tiny_hf):
    r = _run("verify-hf", "--hf-dir", tiny_hf, "--tp", "4")
    assert r.returncode != 0 and "model.num_query_groups (2) is not divisible by --tp (4)" in r.stderr


def test_smoke_runs_and_writes_summary(tmp_path):
    r = _run("smoke", f"run_dir={tmp_path}", "smoke.steps=1", "parallel.tp=2")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    run_dir = Path(r.stdout.strip().splitlines()[-1])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["tp"] == 2 and summary["grads_finite"] and summary["loss"] > 0
    assert summary["environment"]["transformer_engine"] is False


def test_smoke_starts_from_the_checkpoint_given(tiny_hf):
    """smoke train.init_hf=DIR runs the checkpoint's weights, not random ones of its shape: the same batches give
    another loss than the random weights the same seed builds (the loading left out, the two are equal)."""
    import dataclasses

    from rollplex_megatron.dist import run_local
    from rollplex_megatron.recipes import load_run_config
    from rollplex_megatron.verify.smoke import _summarise, run_rank

    cfg = load_run_config(["smoke.steps=1", "smoke.warmup=0", f"train.init_hf={tiny_hf}"])
    loaded = run_local(run_rank, 1, cfg)
    rnd = run_local(run_rank, 1, dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init_hf="")))
    assert loaded[0]["seq_len"] == rnd[0]["seq_len"] and abs(loaded[0]["loss"] - rnd[0]["loss"]) > 1e-3, (loaded, rnd)
    assert _summarise(cfg, loaded)["weights"] == tiny_hf


def test_print_config_shows_resolved_values():
    r = _run("print-config", "model=qwen2_5_vl_32b")
    assert r.returncode == 0 and "hidden_size: 5120" in r.stdout


def test_cpu_shims_apply_only_without_cuda():
    import torch

    if torch.cuda.is_available():
        assert apply_cpu_shims() == []
    else:
        names = apply_cpu_shims()
        assert {"current_device", "synchronize", "rng", "cuda_device_literals"} <= set(names)
        assert applied_shims() == names
        assert torch.zeros(1, device="cuda").device.type == "cpu"


def test_the_cli_gives_ranks_expandable_segments_unless_the_user_chose(monkeypatch):
    """Every command sets PYTORCH_CUDA_ALLOC_CONF before any CUDA work (ranks inherit it) where it is unset, and
    leaves a user's own value as it is."""
    from rollplex_megatron import cli
    from rollplex_megatron import runtime as R

    got = []
    for user in (None, "max_split_size_mb:128"):
        monkeypatch.delenv(R._DEFAULTED, raising=False)
        if user is None:
            monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
        else:
            monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", user)
        assert cli.main(["--help"]) == 0
        got.append(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    assert got == [R.ALLOCATOR_DEFAULT, "max_split_size_mb:128"]


def test_an_sglang_run_drops_the_allocator_default_but_not_the_users(monkeypatch, tiny_hf):
    """rollout.engine=sglang: SGLang's memory saver refuses expandable segments, so `train` drops the default it set
    (before any CUDA work); a user's own PYTORCH_CUDA_ALLOC_CONF stays. Mutation: a run of the embedded engine keeps
    the default."""
    from rollplex_megatron import runtime as R
    from rollplex_megatron.cli import train as T

    monkeypatch.setattr(T, "import_sglang", lambda: None)  # SGLang itself is not needed to read the config
    for engine, user, want in (("sglang", None, None), ("embedded", None, R.ALLOCATOR_DEFAULT),
                               ("sglang", "max_split_size_mb:64", "max_split_size_mb:64")):
        monkeypatch.delenv(R._DEFAULTED, raising=False)
        if user is None:
            monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
        else:
            monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", user)
        R.allocator_default()
        model = [f"rollout.sglang.model_path={tiny_hf}"] if engine == "sglang" else []
        T._config([f"rollout.engine={engine}", *model], None)
        assert os.environ.get("PYTORCH_CUDA_ALLOC_CONF") == want, (engine, user)
