"""Compose a RunConfig from the Hydra recipes (`recipes/`) and command-line overrides."""
from __future__ import annotations

import dataclasses
import difflib
import os
import re
import shlex
import typing
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, HydraException, OverrideParseException
from omegaconf import OmegaConf

from rollplex_megatron.config import RunConfig, check_model_parallel, flat_settings, register_configs
from rollplex_megatron.data import check_source
from rollplex_megatron.models.registry import model_spec, open_hf
from rollplex_megatron.rl.grpo import check_kl_estimator
from rollplex_megatron.rollout.window import check_mechanism
from rollplex_megatron.trainer.modes import get_mode

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


def compose_config(overrides: list[str] | None = None, config_name: str = "config"):
    """The resolved OmegaConf config for `overrides` (unknown keys are rejected by the schema)."""
    if not RECIPES_DIR.is_dir():
        raise FileNotFoundError(f"recipes folder not found at {RECIPES_DIR}; install the package editable "
                                f"(pip install -e .)")
    register_configs()
    overrides = list(overrides or [])
    options = [o for o in overrides if o.startswith("-")]
    if options:  # an option the command did not take (a typo such as --mdoes) reached the settings
        raise ValueError(f"unknown option {options[0]}: this command has no such option, and settings are key=value "
                         f"(`--help` lists the command's options)")
    schemas = [o for o in overrides if "=" in o and "." not in o.split("=", 1)[0]
               and o.split("=", 1)[1].endswith("_schema")]
    if schemas:  # the schemas are registered in the groups' search path, but are not recipes
        group, name = schemas[0].lstrip("+~").split("=", 1)
        options = sorted(p.stem for p in (RECIPES_DIR / group).glob("*.yaml"))
        raise ValueError(f"{schemas[0]}: {name} is the schema of {group}, not a recipe; choose one of {options}")
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(RECIPES_DIR), version_base="1.3"):
            return compose(config_name=config_name, overrides=overrides)
    except ConfigCompositionException as e:
        raise ValueError(_override_error(e)) from None
    except OverrideParseException as e:  # Hydra's lexer: a space split by the shell, `~`, an emoji, ...
        raise ValueError(_unparsable(overrides, e)) from None


def _parses(parser: OverridesParser, override: str) -> bool:
    try:
        parser.parse_override(override)
    except HydraException:
        return False
    return True


def _shell_quoted(override: str) -> str:
    """An override quoted for the shell as a user types it (double quotes where nothing in it is special there)."""
    return f'"{override}"' if not set(override) & set('"$`\\!') else shlex.quote(override)


def _unparsable(overrides: list[str], e: OverrideParseException) -> str:
    """One line for the first override Hydra cannot parse, with the quoting that reads it (checked to parse): the
    words without `=` after a setting are most often the rest of its value, split at its spaces by the shell."""
    parser = OverridesParser.create()
    bad = next((i for i, o in enumerate(overrides) if not _parses(parser, o)), None)
    if bad is None:
        return " ".join(str(e).split())
    first = bad - 1 if "=" not in overrides[bad] and bad and "=" in overrides[bad - 1] else bad
    stray = f"{overrides[bad]}: not a setting; settings are key=value (`rollplex print-config` lists every key)"
    if "=" not in overrides[first]:
        return stray
    end = next((k for k in range(first + 1, len(overrides)) if "=" in overrides[k]), len(overrides))
    given = " ".join(overrides[first:end])
    key, value = given.split("=", 1)
    # a list or mapping keeps its own syntax (the shell quotes join it); a plain value is quoted for Hydra
    fixed = given if value[:1] in "[{" else f"{key}='{value}'" if "'" not in value else f'{key}="{value}"'
    if value[:1] in "'\"" or not _parses(parser, fixed):  # no quoting of ours reads it
        return stray if "=" not in overrides[bad] else " ".join(str(e).split())
    if end - first > 1:
        return (f"{given}: the shell split this setting at its spaces into {end - first} words; quote it whole: "
                f"{_shell_quoted(fixed)}")
    return (f"{given}: Hydra cannot read this value unquoted (it holds a space, `~`, an emoji or another character "
            f"outside Hydra's plain values); quote it: {_shell_quoted(fixed)}")


def _missing_option_error(group: str, name: str) -> str:
    """A recipe group's option that does not exist (`mode=rollplx`), as one line with the group's recipes and the
    closest one (Hydra's text lists the schemas and its search path too)."""
    options = sorted(p.stem for p in (RECIPES_DIR / group).glob("*.yaml"))
    close = difflib.get_close_matches(name, options, n=1)
    hint = f"did you mean {group}={close[0]}? " if close else ""
    return f"{group}={name}: no such recipe in recipes/{group}/; {hint}choose one of {', '.join(options)}"


def _override_error(e: ConfigCompositionException) -> str:
    """Hydra's composition error as one line naming the setting and the fix: an unknown key (with the closest
    field; Hydra's own advice, `+key`, would add an unknown key), or a value of the wrong type."""
    cause = " ".join(str(e.__cause__ or "").split()).split(" full_key:")[0]
    unknown = re.match(r"Could not override '([^']+)'", str(e))
    if unknown:
        key = unknown.group(1)
        node, path = RunConfig, ""
        for part in key.split(".")[:-1]:
            sub = typing.get_type_hints(node).get(part)  # the schema's annotations are strings (future import)
            if not dataclasses.is_dataclass(sub):
                break
            node, path = sub, f"{path}{part}."
        parts = key.split(".")
        wrong = parts[path.count(".")]  # the first part that names no field
        names = [f.name for f in dataclasses.fields(node)] if dataclasses.is_dataclass(node) else []
        if wrong in names:  # a field that is a free mapping (e.g. rollout.sglang.engine_args): new keys take `+`
            return (f"{path}{wrong} is a mapping whose keys are yours: add {key!r} with +{key}=VALUE (Hydra's "
                    f"syntax for a key the recipe does not have)")
        close = difflib.get_close_matches(wrong, names, n=1)
        rest = ".".join(parts[path.count(".") + 1:])
        hint = f"; did you mean {path}{close[0]}{'.' + rest if rest else ''}?" if close else ""
        return f"unknown config key {key!r}{hint} (`rollplex print-config` lists every key)"
    missing = re.search(r"Could not find '([^'/]+)/([^']+)'", str(e))
    if missing:
        return _missing_option_error(*missing.groups())
    bad = re.match(r"Error merging override (\S+)", str(e))
    if bad:
        return f"{bad.group(1)}: {cause}; give a value of the setting's type (`rollplex print-config` shows it)"
    return " ".join(f"{e} {cause}".split())


def check_closed(node, schema: type, path: str = "") -> None:
    """Unknown keys anywhere in `node` are errors, whatever form added them (`+key=` included:
    Hydra opens the struct flag for it and `to_object` would drop the key silently)."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key in node.keys():
        name = f"{path}{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean {path}{close[0]}?" if close else ""
            raise ValueError(f"unknown config key {name!r}: {schema.__name__} has no field {key!r}{hint} "
                             f"(`rollplex print-config` lists every key)")
        sub = fields[key].type
        value = node._get_node(key)
        if OmegaConf.is_dict(value) and isinstance(sub, str):
            sub = getattr(value, "_metadata").object_type
        if OmegaConf.is_dict(value) and dataclasses.is_dataclass(sub):
            check_closed(value, sub, f"{name}.")


def load_run_config(overrides: list[str] | None = None, hf_setting: str = "train.init_hf") -> RunConfig:
    """A validated RunConfig (cross-field checks run here, before any heavy work). With
    `train.init_hf=DIR` the model's shape and special tokens are DIR's config.json (`model_from_hf`);
    `hf_setting` is how the user gave DIR (a command's `--hf-dir`), for the errors."""
    cfg = compose_config(overrides)
    check_closed(cfg, RunConfig)
    run = expand_home(absolute_data_paths(OmegaConf.to_object(cfg)))
    if run.train.init_hf:
        run = model_from_hf(run, list(overrides or []), hf_setting)
    if run.data.resolved_source == "dataset":
        task = next((k for k in named_keys(list(overrides or [])) if k == "task" or k.startswith("task.")), None)
        if task:  # the rendered task's settings, which a dataset run never reads
            raise ValueError(f"{task}: a setting of the rendered task, which a run on data.train_files does not "
                             f"read (its rows are the prompts); drop the override")
    check_registered(run)
    return run


def absolute_data_paths(cfg: RunConfig) -> RunConfig:
    """`cfg` with `data.train_files`, `data.val_files` and `data.processor` absolute, as `train.init_hf` is: the
    run records the files it read, and a resume or an evaluation started from another folder reads those."""
    d = cfg.data

    def resolved(p: str) -> str:
        return str(Path(p).expanduser().resolve()) if p else p

    return dataclasses.replace(cfg, data=dataclasses.replace(
        d, train_files=[resolved(f) for f in d.train_files], val_files=[resolved(f) for f in d.val_files],
        processor=resolved(d.processor)))


def expand_home(cfg: RunConfig) -> RunConfig:
    """`cfg` with `~` and `~user` expanded in `train.out`, `run_dir` and `train.init_hf`: Hydra passes them on as
    written, and the run would make a folder named `~` in the working directory."""
    def expanded(setting: str, path: str) -> str:
        if not path.startswith("~"):
            return path
        full = os.path.expanduser(path)
        if full.startswith("~"):  # an unknown user, or no home folder to expand `~` to
            user = path[1:].split("/", 1)[0]
            raise ValueError(f"{setting}={path}: {f'no user {user!r} on this machine' if user else 'no home folder'} "
                             f"to expand {path.split('/', 1)[0]} to; write the folder out in full")
        return full

    t = cfg.train
    return dataclasses.replace(cfg, run_dir=expanded("run_dir", cfg.run_dir), train=dataclasses.replace(
        t, out=expanded("train.out", t.out), init_hf=expanded("train.init_hf", t.init_hf)))


# Recipe groups whose options fill one subtree of the config (`mode=serial` sets mode.*); the others write
# anywhere (`+bench=video_long`, `+plan_preset=...`).
SUBTREE_GROUPS = ("mode", "model", "parallel", "task", "workload", "memory")


def override_value(override: str):
    """The value of one `key=value` override as Hydra parses it (a list for `[a, b]`)."""
    return OverridesParser.create().parse_override(override).value()


def override_key(override: str) -> str:
    """The dotted key a command-line override names: `+a.b=1`, `~a.b` and `a.b=1` all name `a.b`."""
    return override.lstrip("+~").split("=", 1)[0]


def named_keys(overrides: list[str]) -> set[str]:
    """The dotted keys a command line's `key=value` overrides name (`+` / `~` forms included)."""
    return {override_key(o) for o in overrides if "=" in o}


def _settings(cfg) -> dict:
    """{dotted setting: value} of a RunConfig (or its OmegaConf form), an empty mapping kept as a setting."""
    node = cfg if OmegaConf.is_config(cfg) else OmegaConf.structured(cfg)
    return flat_settings(OmegaConf.to_container(node), keep_empty=True)


def resumed_config(cfg: RunConfig, overrides: list[str], saved_yaml: str) -> RunConfig:
    """The config of a resumed run: the saved run's (`saved_yaml`, its checkpoint's) with what this command line
    sets explicitly on top, so `train.resume=true train.out=DIR train.steps=N` continues the run whatever
    overrides started it. Explicit: every dotted key given (`train.steps=N`, `memory.plan=keep`), the subtree of a
    group chosen (`mode=serial`: mode.*), and whatever else the command line's composition (`cfg`) sets apart from
    the root recipe's. The resume check then refuses what may not change."""
    new, default, keys = _settings(cfg), _settings(load_run_config([])), named_keys(overrides)
    explicit = {k for k in new if k in keys or any(k.startswith(f"{g}.") for g in keys & set(SUBTREE_GROUPS))
                or new[k] != default.get(k)}
    merged = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.create(saved_yaml))
    for k in sorted(explicit):
        OmegaConf.update(merged, k, new[k], merge=False)
    out = OmegaConf.to_object(merged)
    check_code_not_from_run(out, explicit, "train.resume=true")
    return out


def check_code_not_from_run(cfg: RunConfig, named: set[str], command: str) -> None:
    """A reward function given by dotted path is code to import: it is taken from this command line or its
    recipe, never from a run directory's saved config (which anyone who shares the directory can edit). A
    ValueError names the setting and how to give it."""
    specs = {"reward.fn": cfg.reward.fn, **{f"reward.fns.{k}": v for k, v in cfg.reward.fns.items()}}
    for key, spec in specs.items():
        if spec and ":" in str(spec) and key not in named:
            given = f"+reward.fns={{{key.split('.', 2)[2]}: '{spec}'}}" if key.startswith("reward.fns.") \
                else f"{key}={spec}"
            raise ValueError(f"{command}: the run's saved config names {key}={spec!r}, code to import; code named "
                             f"by a run directory is not imported: give {given} on the command line if you trust "
                             f"that module")


# What an evaluation of a run's checkpoint (`eval --run`, `generate --run`) takes from the run: how it read its
# rows, answered them and scored the answers. The rows (data.*_files) and the model (the exported checkpoint) are
# the command's own.
RUN_EVAL_SETTINGS = ("data.", "reward.", "val.", "rollout.max_response_len", "rollout.max_prompt_len",
                     "rollout.top_p", "rollout.top_k", "seed")
RUN_EVAL_OWN = ("data.train_files", "data.val_files", "data.source")
# Settings eval/generate never read (training's, or the rollout's that val.* replaces): a command line naming one
# is refused, with the setting that does what it meant where there is one
EVAL_UNREAD = {"optim": "", "task": " (the rows come from data.val_files)",
               "data.train_files": " (the rows come from data.val_files)",
               "rollout.temperature": "; use val.temperature", "rollout.group_size": "; use val.n",
               "rollout.length_dist": "", "rollout.length_mean": "", "rollout.length_sigma": "",
               "val.before_train": " (they evaluate once, the checkpoint given)"}


def check_eval_overrides(overrides: list[str]) -> None:
    """A one-line error for the first override of a setting eval/generate would ignore (`EVAL_UNREAD`)."""
    for key in (override_key(o) for o in overrides if "=" in o):  # in the command line's order
        hit = next((k for k in EVAL_UNREAD if key == k or key.startswith(f"{k}.")), None)
        if hit:
            raise ValueError(f"{key}: eval and generate do not read it{EVAL_UNREAD[hit]}; drop the override")


def run_eval_config(cfg: RunConfig, overrides: list[str], saved_yaml: str) -> tuple[RunConfig, dict]:
    """The config of an evaluation of a run's checkpoint: `cfg` (this command line's) with the run's
    `RUN_EVAL_SETTINGS` (from `saved_yaml`, the checkpoint's config) wherever the command line does not name them,
    so `eval --run RUN` scores as the run's own validation did. Also returns what was taken that differs from the
    root recipe's (recorded with the result)."""
    saved = _settings(OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.create(saved_yaml)))
    default, named = _settings(load_run_config([])), named_keys(overrides)

    def taken(k: str) -> bool:
        return (k.startswith(tuple(s for s in RUN_EVAL_SETTINGS if s.endswith("."))) or k in RUN_EVAL_SETTINGS) \
            and not k.startswith(RUN_EVAL_OWN) \
            and not any(k == n or k.startswith(f"{n}.") or n.startswith(f"{k}.") for n in named)

    merged = OmegaConf.structured(cfg)
    carried = {k: v for k, v in saved.items() if taken(k)}
    for k, v in carried.items():
        OmegaConf.update(merged, k, v, merge=False)
    out = OmegaConf.to_object(merged)
    check_code_not_from_run(out, {k for k in _settings(out) if k not in carried}, "--run")
    return out, {k: v for k, v in carried.items() if v != default.get(k)}


# Model fields that are run settings, not the checkpoint's shape: the command line keeps them.
RUN_MODEL_FIELDS = ("name", "freeze_vision")


def model_from_hf(cfg: RunConfig, overrides: list[str], setting: str = "train.init_hf") -> RunConfig:
    """`cfg` with `train.init_hf` made absolute and `model` read from its config.json. The root recipe's
    default preset gives way; a `model=` preset or `model.*` value chosen on the command line that
    disagrees with the checkpoint is an error naming the field. `setting`: how the user named the directory
    (`train.init_hf`, or an option such as `--hf-dir`)."""
    path = str(Path(cfg.train.init_hf).resolve())  # recorded absolute: exports and resumes elsewhere find it
    given = f"{setting} {cfg.train.init_hf}" if setting.startswith("-") else f"{setting}={cfg.train.init_hf}"
    if Path(path).is_file():
        raise ValueError(f"{given} is a file; name the Hugging Face Qwen2.5-VL directory "
                         f"that holds it (config.json, safetensors, processor files)")
    if not Path(path).is_dir():
        raise ValueError(f"{given}: {path} does not exist; name a Hugging Face "
                         f"Qwen2.5-VL directory (config.json, safetensors, processor files)")
    hf = open_hf(path).model_config()
    hf = dataclasses.replace(hf, freeze_vision=cfg.model.freeze_vision)  # a run setting (RUN_MODEL_FIELDS)
    chosen = [o.lstrip("+~") for o in overrides if override_key(o).split(".")[0] == "model"]
    if any(o.split("=")[0] != "model.freeze_vision" for o in chosen):
        bad = _differences(cfg.model, hf, "model.")
        if bad:
            field_name, mine, theirs = bad[0]
            raise ValueError(f"{field_name}={mine!r} (from {', '.join(chosen)}) disagrees with {path}/config.json "
                             f"({theirs!r}); {setting} sets the model: drop the model override")
    out = dataclasses.replace(cfg, model=hf, train=dataclasses.replace(cfg.train, init_hf=path))
    check_model_parallel(out.model, out.parallel)
    return out


def _differences(a, b, prefix: str) -> list[tuple[str, object, object]]:
    """(dotted field, a's value, b's value) where two config dataclasses differ (run settings left out)."""
    out = []
    for f in dataclasses.fields(a):
        if f.name in RUN_MODEL_FIELDS:
            continue
        x, y = getattr(a, f.name), getattr(b, f.name)
        if dataclasses.is_dataclass(x):
            out += _differences(x, y, f"{prefix}{f.name}.")
        elif (list(x) if isinstance(x, (list, tuple)) else x) != (list(y) if isinstance(y, (list, tuple)) else y):
            out.append((f"{prefix}{f.name}", x, y))
    return out


def check_registered(cfg: RunConfig) -> None:
    """Names that select a registered strategy (config.py knows no registry: it imports nothing above it)."""
    get_mode(cfg.mode.name)
    check_source(cfg.data.source)
    check_kl_estimator(cfg.train.kl_estimator)
    model_spec(cfg.model).check_megatron(cfg.model, cfg.megatron)  # model.family first: an unknown one is named
    check_mechanism(cfg.mode.window, max(cfg.parallel.tp, cfg.rollout.tp), cfg.parallel.pp)


def to_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML (printed by every command)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
