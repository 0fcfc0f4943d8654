"""The tree's layout rules: no import cycle, nothing above config.py, and one file plus one registry
line for a new mode, a new decode-window mechanism and a new data source."""
import ast
from pathlib import Path

import pytest
import torch

import rollplex_megatron
from rollplex_megatron import data as D
from rollplex_megatron.memory import planner
from rollplex_megatron.recipes import load_run_config
from rollplex_megatron.rollout import window as W
from rollplex_megatron.trainer import modes as M

PKG = Path(rollplex_megatron.__file__).parent


def _module(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(name: str, modules: set[str]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (every import statement, at any depth), plus the
    packages they live in (importing `a.b.c` runs `a.b`'s __init__), except its own ancestors."""
    files = {_module(p): p for p in PKG.rglob("*.py")}
    graph = {}
    for mod, path in files.items():
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for n in names:
                if not n.startswith("rollplex_megatron"):
                    continue
                target = _resolve(n, set(files))
                while target and target != "rollplex_megatron":
                    if not mod.startswith(target + ".") and target != mod:
                        out.add(target)
                    target = target.rpartition(".")[0]
        graph[mod] = out
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_no_import_cycle_and_nothing_above_config():
    graph = import_graph()
    assert find_cycle(graph) is None, find_cycle(graph)
    # config stands on its own field declarations (schema.py) alone, and those import nothing of the package
    assert graph["rollplex_megatron.config"] == {"rollplex_megatron.schema"}
    assert graph["rollplex_megatron.schema"] == set()
    # the check can fail: a cycle added by hand is found
    graph["rollplex_megatron.config"] = {"rollplex_megatron.trainer.loop"}
    assert find_cycle(graph) is not None


def test_a_new_mode_is_one_class_and_one_registry_line(monkeypatch):
    class Echo(M.Serial):  # the one new file's content: a mode with its own name
        """serial under another name (a test-only mode)."""

        name = "echo"

    monkeypatch.setitem(M.MODES, "echo", Echo)  # the registry line
    cfg = load_run_config(["mode.name=echo"])
    assert M.get_mode(cfg.mode.name) is Echo
    assert planner.phases("echo") == Echo.phases
    assert planner.summarize(planner.plan(cfg, "echo", "keep", "embedded"), "echo")["peak_gib"] > 0
    with pytest.raises(ValueError, match="mode.name must be one of"):
        load_run_config(["mode.name=nope"])


def test_a_new_window_mechanism_is_one_class_and_one_registry_line(monkeypatch):
    class EveryOther(W.mechanisms.Interleave):
        """interleave under another name (a test-only mechanism)."""

        name = "every_other"

    monkeypatch.setitem(W.MECHANISMS, "every_other", EveryOther)  # the registry line
    load_run_config(["mode.window=every_other"])
    window = W.DecodeWindow("every_other")
    done = []
    window.submit("item", lambda: done.append(1))
    window.on_wave(4)
    window.on_decode_step(0, 4)
    assert done == [1] and window.stats()["window_mechanism"] == "every_other"


class _Constant:
    """A test-only data source: one fixed text prompt, reward 1 for token 7."""

    name = "constant"
    stop_token_ids, max_new_tokens, chance_reward, chance_accuracy = (7,), 3, None, None

    def __init__(self, cfg):
        self.prompt = rollplex_megatron.Prompt(torch.tensor([1, 2, 3]))

    def rows(self, step, dp_rank, dp_size, n):
        return [D.Row(self.prompt, seed=step * 100 + dp_rank * n + i) for i in range(n)]

    def score(self, row, tokens):
        ok = float(int(tokens[-1]) == 7)
        return D.Score(ok, ok, 1.0)

    def shape_prompts(self, k):
        return [self.prompt] * k


def test_a_new_data_source_is_one_class_and_one_registry_line(monkeypatch):
    monkeypatch.setitem(D.SOURCES, "constant", _Constant)
    cfg = load_run_config(["data.source=constant"])
    src = D.build_source(cfg)
    rows = src.rows(3, 1, 2, 2)
    assert [r.seed for r in rows] == [302, 303] and src.score(rows[0], torch.tensor([4, 7])).reward == 1.0
    with pytest.raises(ValueError, match="data.source must be auto or one of"):
        load_run_config(["data.source=nope"])


def test_megatron_pass_through_reaches_transformer_config():
    """`+megatron.<field>` lands in the LLM decoder's TransformerConfig; unknown fields and fields the
    project sets from its own settings are refused at config load."""
    from rollplex_megatron.models.qwen25vl.model import llm_transformer_config

    cfg = load_run_config(["+megatron.init_method_std=0.5", "+megatron.recompute_granularity=selective"])
    tc = llm_transformer_config(cfg.model, torch.float32, 1, 1, cfg.megatron)
    assert tc.init_method_std == 0.5 and tc.recompute_granularity == "selective"
    assert llm_transformer_config(cfg.model, torch.float32, 1, 1).init_method_std != 0.5
    with pytest.raises(ValueError, match="megatron.bogus is not a field of megatron-core's TransformerConfig"):
        load_run_config(["+megatron.bogus=1"])
    with pytest.raises(ValueError, match="megatron.num_layers is set by this project"):
        load_run_config(["+megatron.num_layers=2"])
    for field in ("num_layers_in_first_pipeline_stage=1", "pipeline_model_parallel_layout=Et|tttL",
                  "account_for_loss_in_pipeline_split=true"):  # an uneven split: the weight layout assumes even
        with pytest.raises(ValueError, match=f"megatron.{field.split('=')[0]} splits the decoder's layers unevenly"):
            load_run_config([f"+megatron.{field}", "parallel.pp=2"])
    load_run_config(["+megatron.account_for_loss_in_pipeline_split=false"])  # the default value passes


def test_the_cli_imports_no_verl_integration():
    """The CLI (every command) loads without the verl integration's modules: they import transformers classes a
    verl run needs (the video processor's VideoProcessorMixin), which older transformers releases lack, and the
    CLI must start on those. Fails if a module the CLI imports at its top imports integrations/verl/ at its top."""
    import subprocess
    import sys

    code = ("import sys, rollplex_megatron.cli, rollplex_megatron.trainer.runtime; "
            "print(sorted(m for m in sys.modules if m.startswith('rollplex_megatron.integrations.verl')))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().splitlines()[-1] == "[]", p.stdout[-2000:]
    # nor does make-example at any depth (a function-level import counts): it writes the verl processor's name only
    graph = import_graph()
    for mod in ("rollplex_megatron.data.example", "rollplex_megatron.data.example_files"):
        assert not {m for m in graph[mod] if m.startswith("rollplex_megatron.integrations")}, (mod, graph[mod])
