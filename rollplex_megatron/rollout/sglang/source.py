"""The bridge checked against SGLang's source, without importing it (its dependencies are not installable here).

`check_release(root, with_plugins)` reads an unpacked SGLang release (`root` holds `sglang/`) with `ast` and
returns every mismatch with what this package hooks and calls: the plugin framework and the three hook
targets, where the hooks read the TP rank off the Scheduler and ModelRunner, the `Engine` methods and
keywords the adapter passes (read from the adapter's own source, so a new call is checked without editing a
list), the ServerArgs and SamplingParams fields it sets, the environment it gives SGLang's processes, the
custom-loader dispatch, the memory tags, the output format it parses and the parameter names the weight
mapping produces. `apply_patch` applies a `patches/sglang/`
diff to such a tree and compiles the patched files.
"""
from __future__ import annotations

import ast
import subprocess
from pathlib import Path

from rollplex_megatron.rollout.sglang import engine as E
from rollplex_megatron.rollout.sglang import plugin as PL

SUPPORTED = ("0.5.23", "0.5.17", "0.5.12")  # with sglang.srt.plugins: the entry point
PATCHED = ("0.5.2",)  # without it: patches/sglang/<version>/


class Tree:
    """An unpacked SGLang release, read as ASTs."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._mods: dict[str, ast.Module | None] = {}

    def file(self, module: str) -> Path | None:
        base = self.root / module.replace(".", "/")
        for p in (base.with_suffix(".py"), base / "__init__.py"):
            if p.is_file():
                return p
        return None

    def module(self, module: str) -> ast.Module | None:
        if module not in self._mods:
            f = self.file(module)
            self._mods[module] = ast.parse(f.read_text()) if f else None
        return self._mods[module]

    def cls(self, module: str, name: str) -> tuple[str, ast.ClassDef] | None:
        mod = self.module(module)
        if mod is None:
            return None
        for node in mod.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return module, node
        for node in mod.body:  # re-exported: `from x import Name`
            if isinstance(node, ast.ImportFrom) and node.module and any(a.name == name for a in node.names):
                return self.cls(node.module, name)
        return None

    def method(self, module: str, cls: str, name: str, depth: int = 0) -> ast.FunctionDef | None:
        """The method as the class resolves it: its own, else a base class's (mixins in other modules)."""
        found = self.cls(module, cls)
        if found is None or depth > 8:
            return None
        mod_name, node = found
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == name:
                return item
        imports = _imports(self.module(mod_name))
        for base in node.bases:
            bname = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
            if bname in (None, "object", "Enum", "IntEnum"):
                continue
            hit = self.method(imports.get(bname, mod_name), bname, name, depth + 1)
            if hit is not None:
                return hit
        return None

    def fields(self, module: str, cls: str) -> set[str]:
        """A class's constructor keywords: its `__init__` parameters, else its annotated fields (dataclass,
        msgspec Struct)."""
        init = self.method(module, cls, "__init__")
        if init is not None:
            return set(params(init))
        found = self.cls(module, cls)
        if found is None:
            return set()
        return {n.target.id for n in found[1].body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def _imports(mod: ast.Module | None) -> dict[str, str]:
    out = {}
    for node in (mod.body if mod else []):
        if isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                out[a.asname or a.name] = node.module
    return out


def params(fn: ast.FunctionDef) -> list[str]:
    """Parameter names of a function (positional, keyword-only; not *args / **kwargs)."""
    a = fn.args
    return [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]


def _calls_in(fn: ast.AST, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(fn) if isinstance(n, ast.Call)
            and (getattr(n.func, "id", None) == name or getattr(n.func, "attr", None) == name)]


def _constant(mod: ast.Module | None, name: str):
    for node in (mod.body if mod else []):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            if isinstance(node.value, ast.Constant):
                return node.value.value
    return None


def _split(target: str) -> tuple[str, str, str]:
    mod, cls, meth = target.rsplit(".", 2)
    return mod, cls, meth


def adapter_calls() -> dict[str, set[str]]:
    """What the adapter calls on `sglang.Engine`: method -> keywords (from `engine.py`'s own source)."""
    tree = ast.parse(Path(E.__file__).read_text())
    out: dict[str, set[str]] = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Attribute):
            if n.func.value.attr == "engine" and getattr(n.func.value.value, "id", None) == "self":
                out.setdefault(n.func.attr, set()).update(k.arg for k in n.keywords if k.arg)
    return out


def _dict_keys(fn_name: str, var: str) -> set[str]:
    """String keys given to dict `var` inside `engine.py`'s function `fn_name` (literal, item assignment,
    and the literal it is unpacked into)."""
    tree = ast.parse(Path(E.__file__).read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == fn_name)
    keys: set[str] = set()
    for n in ast.walk(fn):
        if isinstance(n, ast.Assign) and any(getattr(t, "id", None) == var for t in n.targets):
            if isinstance(n.value, ast.Dict):
                keys |= {k.value for k in n.value.keys if isinstance(k, ast.Constant)}
        if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Subscript):
            sub = n.targets[0]
            if getattr(sub.value, "id", None) == var and isinstance(sub.slice, ast.Constant):
                keys.add(sub.slice.value)
        if isinstance(n, ast.Dict) and any(k is None and getattr(v, "id", None) == var
                                           for k, v in zip(n.keys, n.values)):
            keys |= {k.value for k in n.keys if isinstance(k, ast.Constant)}
    return keys


def server_args_fields(t: Tree) -> set[str]:
    """ServerArgs fields: the dataclass (0.5.12 and older) or the field groups it is built from (0.5.23)."""
    out = t.fields("sglang.srt.server_args", "ServerArgs")
    groups = t.root / "sglang/srt/arg_groups/fields"
    for f in sorted(groups.glob("*.py")) if groups.is_dir() else []:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                out.add(node.target.id)
    return out


def tp_source(t: Tree, module: str, cls: str) -> bool:
    """Whether the hooks can read (TP rank, TP size) off `cls`'s objects as `plugin.tp_coordinates` does: its own
    `tp_rank` / `tp_size` (0.5.12), its `ps` ParallelState (0.5.17), or SGLang's runtime context, which that
    module's own code reads (0.5.23: a dynamic context object)."""
    init = t.method(module, cls, "__init__")
    own = {n.attr for n in ast.walk(init or ast.Module([], []))
           if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and getattr(n.value, "id", None) == "self"}
    if {"tp_rank", "tp_size"} <= own:
        return True
    if "ps" in own and {"tp_rank", "tp_size"} <= t.fields("sglang.srt.distributed.parallel_state_wrapper",
                                                          "ParallelState"):
        return True
    rc = t.module("sglang.srt.runtime_context")
    has_fn = any(isinstance(n, ast.FunctionDef) and n.name == "get_parallel" for n in (rc.body if rc else []))
    f = t.file(module)
    src = f.read_text() if f else ""
    return has_fn and "get_parallel().tp_rank" in src and "get_parallel().tp_size" in src


def check_release(root: Path, with_plugins: bool = True, adapter: bool = True) -> list[str]:
    """Every mismatch between this package and the SGLang release unpacked at `root` (empty: none).
    `with_plugins`: hook through `sglang.srt.plugins` (else the patch's `install_direct`, whose idle method is
    `self_check_during_idle`); `adapter`: also what `engine.py` passes to `sglang.Engine`."""
    t, bad = Tree(root), []

    def need(ok, what: str) -> None:
        if not ok:
            bad.append(what)

    # the plugin framework and the hook targets
    if with_plugins:
        plug = t.module("sglang.srt.plugins")
        need(_constant(plug, "GENERAL_PLUGINS_GROUP") == "sglang.srt.plugins",
             "sglang.srt.plugins.GENERAL_PLUGINS_GROUP is not 'sglang.srt.plugins'")
        reg = t.method("sglang.srt.plugins.hook_registry", "HookRegistry", "register")
        need(reg is not None and params(reg)[:4] == ["cls", "target", "hook", "hook_type"],
             "HookRegistry.register(target, hook, hook_type) not found")
        ht = t.cls("sglang.srt.plugins.hook_registry", "HookType")
        names = {tg.id for n in (ht[1].body if ht else []) if isinstance(n, ast.Assign) for tg in n.targets}
        need({"AROUND", "AFTER"} <= names, "HookType.AROUND / HookType.AFTER missing")
        rsp = next((n for n in (t.module("sglang.srt.managers.scheduler") or ast.Module([], [])).body
                    if isinstance(n, ast.FunctionDef) and n.name == "run_scheduler_process"), None)
        need(rsp is not None and _calls_in(rsp, "load_plugins"), "run_scheduler_process does not call load_plugins()")
        targets = [PL.RUN_BATCH, PL.ON_IDLE, PL.LOAD_MODEL]
    else:
        targets = [PL.RUN_BATCH, f"{PL.SCHEDULER}.{PL.OLD_IDLE}", PL.LOAD_MODEL]
    for target in targets:
        fn = t.method(*_split(target))
        need(fn is not None, f"{target} not found (the hook target)")
        if fn is not None and target == PL.RUN_BATCH:
            need(params(fn)[:2] == ["self", "batch"], f"{target}: parameters {params(fn)}, expected (self, batch, ...)")
    load = t.method(*_split(PL.LOAD_MODEL))
    need(load is not None and any(isinstance(n, ast.Attribute) and n.attr == "model" and isinstance(n.ctx, ast.Store)
                                  for n in ast.walk(load)), "ModelRunner.load_model does not set self.model")
    need(t.method("sglang.srt.model_executor.forward_batch_info", "ForwardMode", "is_decode") is not None,
         "ForwardMode.is_decode missing")
    need(t.method("sglang.srt.managers.schedule_batch", "ScheduleBatch", "batch_size") is not None,
         "ScheduleBatch.batch_size missing")
    for module, cls in (("sglang.srt.managers.scheduler", "Scheduler"), _split(PL.LOAD_MODEL)[:2]):
        need(tp_source(t, module, cls), f"{cls}: no TP coordinates for the hooks (neither self.tp_rank/tp_size, nor "
                                        f"self.ps as a ParallelState, nor runtime_context.get_parallel())")
    if adapter:
        bad += _adapter_mismatches(t, with_plugins)
    return bad


def _adapter_mismatches(t: Tree, with_plugins: bool) -> list[str]:
    bad = []

    def need(ok, what: str) -> None:
        if not ok:
            bad.append(what)

    # the adapter's calls on sglang.Engine, and what it passes
    for meth, kws in adapter_calls().items():
        fn = t.method("sglang.srt.entrypoints.engine", "Engine", meth)
        need(fn is not None, f"Engine.{meth} not found (the adapter calls it)")
        if fn is not None and fn.args.kwarg is None:
            missing = kws - set(params(fn))
            need(not missing, f"Engine.{meth} has no parameter(s) {sorted(missing)}")
    fields = server_args_fields(t)
    for key in sorted(_dict_keys("engine_args", "args")):
        need(key in fields, f"ServerArgs has no field {key!r} (the adapter passes it to sglang.Engine)")
    sp = t.fields("sglang.srt.sampling.sampling_params", "SamplingParams")
    for key in sorted(_dict_keys("request_payload", "sp")):
        need(key in sp, f"SamplingParams has no field {key!r} (the adapter sends it; unknown keys raise)")
    # the custom loader's dispatch: loader(model, named_tensors), only for listed dotted paths
    src = "".join(p.read_text() for p in (t.root / "sglang/srt/model_executor").rglob("*.py"))
    need("dynamic_import(load_format)" in src and "custom_loader(" in src and "custom_weight_loader" in src,
         "the custom weight loader dispatch (dynamic_import(load_format); custom_loader(model, named_tensors)) is gone")
    # memory tags, the output format, the multimodal format, the weight names
    consts = t.module("sglang.srt.constants")
    tags = {v for v in (_constant(consts, n) for n in ("GPU_MEMORY_TYPE_KV_CACHE", "GPU_MEMORY_TYPE_CUDA_GRAPH")) if v}
    need(E.ROLLOUT_MEMORY[0] in tags, f"memory tag {E.ROLLOUT_MEMORY[0]!r} not among SGLang's {sorted(tags)}")
    need(not with_plugins or set(E.ROLLOUT_MEMORY) <= tags,
         f"memory tags {list(E.ROLLOUT_MEMORY)} not among SGLang's {sorted(tags)}")
    tm = (t.file("sglang.srt.managers.tokenizer_manager") or Path("/nonexistent"))
    tm_src = tm.read_text() if tm.is_file() else ""
    need('"output_token_logprobs"' in tm_src and '"finish_reason"' in tm_src,
         "meta_info output_token_logprobs / finish_reason not produced by the tokenizer manager")
    for key in E.SGLANG_ENV:  # the environment the adapter gives SGLang's processes must still mean something
        used = [f for d in ("managers", "mem_cache") for f in (t.root / "sglang/srt" / d).rglob("*.py")
                if key in f.read_text()]
        need(used, f"SGLang no longer reads {key} (the adapter sets it for SGLang's processes: engine.SGLANG_ENV)")
    bp = t.file("sglang.srt.multimodal.processors.base_processor") or \
        t.file("sglang.srt.managers.multimodal_processors.base_processor")
    need(bp is not None and "processor_output" in bp.read_text(), "the 'processor_output' multimodal format is gone")
    vl = t.file("sglang.srt.models.qwen2_5_vl")
    vl_src = vl.read_text() if vl else ""
    for piece in ('(".qkv_proj", ".q_proj", "q")', '("gate_up_proj", "gate_proj", 0)', '"attn.qkv_proj."'):
        need(piece.replace(" ", "") in vl_src.replace(" ", "").replace("r\"", "\""),
             f"qwen2_5_vl.py no longer maps {piece} (the SGLang parameter names of weights.py)")
    return bad


def apply_patch(patch: Path, root: Path) -> list[str]:
    """Apply a unified diff to the tree at `root` (as `patch -p1` would) and compile every file it touches;
    returns the problems (empty: it applied and compiles)."""
    res = subprocess.run(["git", "apply", "--unsafe-paths", "-p1", "--directory", ".", str(patch.resolve())],
                         cwd=root, capture_output=True, text=True)
    if res.returncode:
        return [f"{patch.name} does not apply: {res.stderr.strip()}"]
    bad = []
    for line in patch.read_text().splitlines():
        if line.startswith("+++ b/"):
            f = root / line[6:].strip()
            try:
                compile(f.read_text(), str(f), "exec")
            except SyntaxError as e:
                bad.append(f"{f.name} does not compile after {patch.name}: {e}")
    return bad
