"""Settings described once: each config field carries its help, whether a resume may change it, and the setting
it only applies with, as dataclass metadata (`setting`, `section`).

From that one source come the resume check (`resumable`), the refusals of a setting that would be ignored
(`refuse_unused`), the settings reference (`settings`, docs/reference/settings.md) and `print-config --explain`.
A field declared without `setting`/`section` has no help, and `settings` refuses the schema.
"""
from __future__ import annotations

import copy
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, Callable

STAGES = ("section", "run", "source")  # where a condition is checked: see `Needs`


@dataclass(frozen=True)
class Needs:
    """A condition a setting needs to have any effect. `text` says how to turn it on (refusals and the reference
    quote it). `test` reads the section that holds the setting (stage `section`: its `__post_init__`) or the
    whole RunConfig (stage `run`: `RunConfig.__post_init__`; stage `source`: the data source, when it is built)."""

    text: str
    test: Callable[[Any], bool]
    stage: str = "section"

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"Needs.stage must be one of {STAGES}, got {self.stage!r}")


def _needs(applies_with: Needs | tuple[Needs, ...]) -> tuple[Needs, ...]:
    return applies_with if isinstance(applies_with, tuple) else (applies_with,)


def setting(default: Any, help: str, *, resumable: bool = False, applies_with: Needs | tuple[Needs, ...] = ()):
    """A config field with its one-line `help`; `resumable`: a resume may change it (it changes how a step runs or
    what is written, not what a step computes); `applies_with`: the conditions without which it is refused."""
    meta = {"help": help, "resumable": resumable, "applies_with": _needs(applies_with)}
    if isinstance(default, (list, dict)):  # a mutable default: each config gets its own copy
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


def section(cls: type, help: str, *, resumable: bool = False, applies_with: Needs | tuple[Needs, ...] = ()):
    """A nested config dataclass with its `help`; `resumable` and `applies_with` hold for every setting in it."""
    return field(default_factory=cls, metadata={"help": help, "resumable": resumable,
                                                "applies_with": _needs(applies_with), "section": True})


@dataclass(frozen=True)
class Setting:
    """One setting of the schema, as the reference lists it: dotted name, type, default and its metadata (the
    resumable flag and conditions of the sections above it included)."""

    name: str
    type: str
    default: Any
    help: str
    resumable: bool
    applies_with: tuple[Needs, ...]


def _meta(cls: type, f, path: str) -> dict:
    """The field's metadata, or a TypeError naming the field declared without `setting`/`section`."""
    if not f.metadata.get("help"):
        raise TypeError(f"config field {path}{f.name} ({cls.__name__}.{f.name}) has no help: declare it with "
                        f"setting(default, help) or section(Class, help) (rollplex_megatron/schema.py)")
    return f.metadata


def _default(f) -> Any:
    return f.default_factory() if f.default is MISSING else f.default


def settings(root: type, path: str = "", resumable: bool = False, needs: tuple[Needs, ...] = ()) -> list[Setting]:
    """Every leaf setting of the config dataclass `root`, in declaration order (nested sections walked)."""
    out = []
    for f in fields(root):
        meta = _meta(root, f, path)
        res, cond = resumable or meta["resumable"], needs + meta["applies_with"]
        if meta.get("section"):
            out += settings(f.default_factory, f"{path}{f.name}.", res, cond)
        else:
            out.append(Setting(f"{path}{f.name}", str(f.type), _default(f), meta["help"], res, cond))
    return out


def sections(root: type, path: str = "") -> list[tuple[str, type, str]]:
    """(dotted path, class, help) of every nested section of `root`, in declaration order."""
    out = []
    for f in fields(root):
        if f.metadata.get("section"):
            out.append((f"{path}{f.name}", f.default_factory, _meta(root, f, path)["help"]))
            out += sections(f.default_factory, f"{path}{f.name}.")
    return out


def resumable(root: type, key: str) -> bool:
    """Whether a resume may change the dotted setting `key` (a key inside a mapping setting, such as
    `megatron.X`, is its mapping's; a key no schema field names is resumable only inside a resumable section)."""
    cls = root
    for part in key.split("."):
        f = next((f for f in fields(cls) if f.name == part), None) if is_dataclass(cls) else None
        if f is None:
            return False
        if f.metadata.get("resumable"):
            return True
        cls = f.default_factory if f.metadata.get("section") else None
    return False


def _unused(value: Any, path: str, cond: Needs) -> ValueError:
    shown = str(value).lower() if isinstance(value, bool) else value  # as the override is written
    return ValueError(f"{path}={shown} has no effect without {cond.text}; set it or drop the {path} override")


def refuse_unused(section_obj: Any, path: str) -> None:
    """A one-line error naming the first setting of `section_obj` (the config section at dotted `path`) set away from
    its default while a condition of stage `section` it applies with is false: the run would ignore it."""
    for f in fields(section_obj):
        for cond in f.metadata.get("applies_with", ()):
            if cond.stage == "section" and not f.metadata.get("section"):
                _check(section_obj, f, f"{path}.{f.name}", cond, section_obj)


def refuse_unused_at(run: Any, stage: str, obj: Any = None, path: str = "", above: tuple[Needs, ...] = ()) -> None:
    """`refuse_unused` for the conditions of `stage` (`run` or `source`) over every setting of the RunConfig `run`,
    a section's conditions holding for every setting in it."""
    obj = run if obj is None else obj
    for f in fields(obj):
        conds, name = above + f.metadata.get("applies_with", ()), f"{path}{f.name}"
        if f.metadata.get("section"):
            refuse_unused_at(run, stage, getattr(obj, f.name), f"{name}.", conds)
            continue
        for cond in conds:
            if cond.stage == stage:
                _check(obj, f, name, cond, run)


def _check(obj: Any, f, name: str, cond: Needs, subject: Any) -> None:
    value = getattr(obj, f.name)
    if value != _default(f) and not cond.test(subject):
        shown = str(value).lower() if isinstance(value, bool) else value  # as the override is written
        raise ValueError(f"{name}={shown} has no effect without {cond.text}; set it or drop the {name} override")
