"""The SGLang bridge against SGLang's own source (AST, no import: SGLang is not installable here).

The pinned wheels are downloaded without their dependencies into a cache (`ROLLPLEX_SGLANG_WHEELS`, default
~/.cache/rollplex/sglang); the tests skip, saying so, only when the package registry cannot be reached.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest

from rollplex_megatron.rollout.sglang import engine as E
from rollplex_megatron.rollout.sglang import plugin as PL
from rollplex_megatron.rollout.sglang.source import PATCHED, SUPPORTED, apply_patch, check_release

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("ROLLPLEX_SGLANG_WHEELS", Path.home() / ".cache" / "rollplex" / "sglang"))


def _release(version: str) -> Path:
    """The release's Python sources, unpacked once from its wheel (downloaded once)."""
    tree = CACHE / version
    if (tree / "sglang" / "srt").is_dir():
        return tree
    wheels = CACHE / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(f"sglang-{version}-*.whl"))
    if not found:
        res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", f"sglang=={version}",
                              "-d", str(wheels)], capture_output=True, text=True, timeout=900)
        found = sorted(wheels.glob(f"sglang-{version}-*.whl"))
        if res.returncode or not found:
            pytest.skip(f"sglang=={version} could not be downloaded (the package registry is unreachable?): "
                        f"{res.stderr.strip().splitlines()[-1:] or res.returncode}")
    part = tree.with_suffix(".part")
    with zipfile.ZipFile(found[0]) as z:
        z.extractall(part, [n for n in z.namelist() if n.startswith("sglang/") and n.endswith(".py")])
    part.rename(tree)
    return tree


@pytest.mark.parametrize("version", SUPPORTED)
def test_plugin_adapter_and_loader_match_sglang_source(version):
    """Every hook target, scheduler attribute, Engine method and keyword, ServerArgs and SamplingParams field,
    the loader dispatch, memory tags, output format and parameter names exist in the release."""
    assert check_release(_release(version)) == []


@pytest.mark.parametrize("version", PATCHED)
def test_patch_applies_and_compiles_and_hooks_exist(version, tmp_path):
    """A release without plugins: each patch applies to it and the patched files compile; the hooks' targets
    (run_batch, self_check_during_idle, load_model) exist; the adapter's gaps there are the ones it refuses."""
    tree = tmp_path / version
    shutil.copytree(_release(version) / "sglang", tree / "sglang")
    patches = sorted((ROOT / "patches" / "sglang" / version).glob("*.patch"))
    assert patches, f"no patch for sglang {version}"
    for p in patches:
        assert apply_patch(p, tree) == []
    text = (tree / "sglang/srt/managers/scheduler.py").read_text()
    assert "install_direct()" in text
    assert check_release(tree, with_plugins=False, adapter=False) == []
    gaps = check_release(tree, with_plugins=False, adapter=True)
    assert gaps and all("sampling_seed" in g or "enable_deterministic_inference" in g for g in gaps), gaps


def test_patch_mutation_against_the_wrong_release_fails(tmp_path):
    """Mutation: the 0.5.2 patch does not apply to 0.5.23 (the check can fail)."""
    tree = tmp_path / "x"
    shutil.copytree(_release("0.5.23") / "sglang", tree / "sglang")
    problems = apply_patch(ROOT / "patches/sglang/0.5.2/rollplex-hooks.patch", tree)
    assert problems and "does not apply" in problems[0]


def test_source_check_mutation_catches_a_renamed_target(tmp_path, monkeypatch):
    """Mutation: a hook target SGLang does not have is reported (the check can fail)."""
    monkeypatch.setattr(PL, "ON_IDLE", f"{PL.SCHEDULER}.on_idle_renamed")
    bad = check_release(_release("0.5.23"))
    assert any("on_idle_renamed" in b for b in bad)


@pytest.mark.parametrize("version", SUPPORTED)
def test_register_with_sglangs_own_hook_registry(version, monkeypatch):
    """The entry point registers through the release's real HookRegistry (its stdlib-only file, loaded from the
    wheel) and the hooks it applies wrap a stand-in Scheduler and ModelRunner as SGLang would."""
    tree = _release(version)
    for name in ("sglang", "sglang.srt", "sglang.srt.plugins", "sglang.srt.managers", "sglang.srt.model_executor"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    spec = importlib.util.spec_from_file_location("sglang.srt.plugins.hook_registry",
                                                  tree / "sglang/srt/plugins/hook_registry.py")
    reg = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, reg)
    spec.loader.exec_module(reg)
    reg.HookRegistry.reset()
    calls = []

    class Scheduler:  # stand-in for sglang.srt.managers.scheduler.Scheduler
        def run_batch(self, batch, pp_proxy_tensors=None):
            calls.append(("forward", batch.forward_mode.is_decode()))
            batch.forward_mode = None  # SGLang rewrites batch fields while it launches the forward
            return "result"

        def on_idle(self):
            calls.append(("idle",))

    class ModelRunner:  # stand-in for sglang.srt.model_executor.model_runner.ModelRunner
        def load_model(self):
            self.model = "model"

    sched_mod, runner_mod = types.ModuleType("sglang.srt.managers.scheduler"), types.ModuleType("x")
    sched_mod.Scheduler, runner_mod.ModelRunner = Scheduler, ModelRunner
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.scheduler", sched_mod)
    monkeypatch.setitem(sys.modules, "sglang.srt.model_executor.model_runner", runner_mod)

    class Bridge:
        def on_decode_step(self, active):
            calls.append(("window", active))

        def on_idle(self):
            calls.append(("drain",))

        def bind_weights(self, model, timeout):
            calls.append(("bind", model))

        link = types.SimpleNamespace(timeout=1.0)

    monkeypatch.setenv("ROLLPLEX_SGLANG_BRIDGE", "127.0.0.1:1")
    monkeypatch.setattr(PL, "_BRIDGE", Bridge())
    try:
        PL.register()
        reg.HookRegistry.apply_hooks()
        decode = types.SimpleNamespace(forward_mode=types.SimpleNamespace(is_decode=lambda: True),
                                       batch_size=lambda: 7)
        prefill = types.SimpleNamespace(forward_mode=types.SimpleNamespace(is_decode=lambda: False),
                                        batch_size=lambda: 1)
        s = Scheduler()
        assert s.run_batch(prefill) == "result" and s.run_batch(decode) == "result"
        s.on_idle()
        ModelRunner().load_model()
    finally:
        reg.HookRegistry.reset()
    assert calls == [("forward", False), ("forward", True), ("window", 7), ("drain",), ("idle",), ("bind", "model")]


def test_tp_coordinates_of_each_releases_objects():
    """The hooks read (TP rank, TP size) off what SGLang hands them: own attributes (0.5.12's Scheduler and
    ModelRunner) or a `ps` ParallelState (0.5.17's, which have no tp_rank / tp_size of their own)."""
    own = types.SimpleNamespace(tp_rank=1, tp_size=2)
    held = types.SimpleNamespace(ps=types.SimpleNamespace(tp_rank=3, tp_size=4, pp_rank=0))
    assert PL.tp_coordinates(own) == (1, 2)
    assert PL.tp_coordinates(held) == (3, 4)


def test_source_check_mutation_catches_missing_tp_coordinates(tmp_path):
    """Mutation: a 0.5.17 whose ParallelState lost its TP fields is reported for both hooked classes."""
    tree = tmp_path / "x"
    shutil.copytree(_release("0.5.17") / "sglang", tree / "sglang", copy_function=os.symlink)  # links: fast
    f = tree / "sglang/srt/distributed/parallel_state_wrapper.py"
    text = f.read_text()
    f.unlink()
    f.write_text(text.replace("    tp_rank: int\n", "    rank: int\n"))
    bad = check_release(tree, adapter=False)
    assert any(b.startswith("Scheduler: no TP coordinates") for b in bad), bad
    assert any(b.startswith("ModelRunner: no TP coordinates") for b in bad), bad


def test_sglang_starts_without_its_vision_embedding_cache(monkeypatch):
    """SGLang's processes start with SGLANG_ENV (no vision-embedding cache: its weights change in place, and the
    cache is never cleared), and this process's environment is as it was after the start."""
    seen = {}

    class Engine:  # stand-in for sglang.Engine: what its processes would inherit
        def __init__(self, **kwargs):
            seen.update(env=dict(os.environ), kwargs=kwargs)

    monkeypatch.setenv("SGLANG_VLM_CACHE_SIZE_MB", "100")
    eng = E.SGLangEngine.__new__(E.SGLangEngine)
    eng.sg, eng.engine_args = types.SimpleNamespace(Engine=Engine), lambda: {"model_path": "m"}
    assert isinstance(eng.start_engine(), Engine)
    assert seen["env"]["SGLANG_VLM_CACHE_SIZE_MB"] == "0" and seen["kwargs"] == {"model_path": "m"}
    assert os.environ["SGLANG_VLM_CACHE_SIZE_MB"] == "100"


def test_adapter_refuses_sglang_without_the_memory_saver(monkeypatch):
    """SGLang importable but torch-memory-saver missing (SGLang's scheduler would die at start-up on
    enable_memory_saver): one line naming the package, before any engine starts."""
    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(__version__="0.5.17"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch_memory_saver"
                        else real(name, *a))
    with pytest.raises(ValueError, match="pip install torch-memory-saver") as e:
        E.import_sglang()
    assert "\n" not in str(e.value)
