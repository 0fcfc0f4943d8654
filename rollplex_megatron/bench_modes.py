"""`bench --modes`: the modes a suite runs, each a name with Hydra overrides of its own in brackets
(`rollplex[mode.window=after]`), split at top-level commas; the old variant labels of older records
(`rollplex:tokens8192+after`) read as the overrides they set; `env:NAME=V` entries apart from the config's.
The command itself is bench.py.
"""
from __future__ import annotations

import hashlib
import re

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from rollplex_megatron.recipes import load_run_config, override_key
from rollplex_megatron.runtime import CUDA_ENV

# Analytic forward FLOPs each phase executes, as multiples of the recorded parts (verify.flops:
# "full" whole sequences, "prefix" the prefix stages, "response" the response stages); backward is
# twice the forward. `recompute` (the record's prefix_recompute) adds one prefix forward to the update. Valid for
# one update per step (train.ppo_mini_batches = train.ppo_epochs = 1).
PHASE_FLOPS = {
    "serial": {"old_logp": {"full": 1}, "ref_logp": {"full": 1}, "update": {"full": 3}},
    "prefix_shared": {"old_logp": {"prefix": 1, "response": 1}, "ref_logp": {"prefix": 1, "response": 1},
                      "update": {"prefix": 3, "response": 3}},
    "disaggregated": {"old_logp": {"full": 1}, "ref_logp": {"full": 1}, "update": {"full": 3}},
    # the actor prefill and the reference prefixes run inside the rollout phase
    "rollplex": {"ref_logp": {"response": 1}, "update": {"prefix": 2, "response": 3}},
}


WINDOWS = ("interleave", "after", "stream", "tail", "green", "auto")
# The variant labels bench took before modes carried overrides (`rollplex:tokens8192+after`): older records keep
# them, so they are read as the overrides they set; a command that gives one is refused with its new form.
OLD_VARIANTS = {"bound": "rollout.bound_model=true", "keep": "memory.plan=keep", "memauto": "memory.plan=auto",
                "conn1": "env:CUDA_DEVICE_MAX_CONNECTIONS=1", "ahead": "memory.prefetch_ahead=true",
                "copy2": "memory.copy_streams=2", "torchnorm": "train.norm_kernel=torch",
                "fusedrope": "train.rope_kernel=triton", "keepdecode": "rollout.keep_decode_state=true",
                "split": "mode.attention_backend=split", "sdpa": "mode.attention_backend=sdpa",
                "graphs": "mode.window_graphs=true", **{w: f"mode.window={w}" for w in WINDOWS}}
OLD_SIZED = {"tokens": "workload.micro_batch_tokens", "pack": "workload.prefix_pack_tokens"}  # `tokens<N>`, N > 0
# Settings bench gives every mode itself (or the name before the brackets gives): a mode's brackets may not name them
_STEPS = "is the suite's: give it after the suite name (bench SUITE train.steps=N), for every mode alike"
BENCH_SETS = {"mode": "names the mode, which is the name before the brackets",
              "mode.name": "names the mode, which is the name before the brackets", "train.steps": _STEPS,
              **{k: "is set by bench for every mode; drop it" for k in (
                  "train.out", "train.save_final", "train.progress", "train.profile_step", "train.profile_phases")}}


def split_top(text: str, where: str = "") -> list[str]:
    """`text` split at its top-level commas, none inside [], {}, () or quotes (`a=[1,2],b` -> `a=[1,2]`, `b`); an
    unbalanced bracket or an unclosed quote is a one-line error naming `where` (default: `text`)."""
    where = where or text
    parts, depth, quote, start, escaped = [], 0, "", 0, False
    for i, ch in enumerate(text):
        if quote:  # Hydra's quoted values escape their quote with a backslash
            escaped, quote = (False, quote) if escaped else (ch == "\\", "" if ch == quote else quote)
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
            if depth < 0:
                raise ValueError(f"--modes: {where!r} closes a bracket it never opened ({ch!r}); drop it or open one")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth or quote:
        raise ValueError(f"--modes: {where!r} leaves {'a quote' if quote else 'a bracket'} open; close it")
    return [*parts, text[start:]]


def mode_label(name: str, overrides: list[str] | tuple[str, ...]) -> str:
    """The label a mode with `overrides` is recorded under: `rollplex`, `rollplex[mode.window=after]`."""
    return f"{name}[{','.join(overrides)}]" if overrides else name


def parse_mode(entry: str) -> tuple[str, list[str]]:
    """One `--modes` entry, `name` or `name[override,...]` -> (name, overrides); the brackets must close at its end."""
    name, bracket, rest = entry.partition("[")
    if not bracket:
        return name.strip(), []
    if not rest.endswith("]"):
        raise ValueError(f"--modes: {entry!r}: a mode's overrides end its entry, `{name.strip()}[key=value,...]`")
    over = [o.strip() for o in split_top(rest[:-1], entry)] if rest[:-1].strip() else []
    if "" in over:
        raise ValueError(f"--modes: {entry!r} holds an empty override (two commas, or one at an end); drop it")
    return name.strip(), over


def old_label_spec(label: str) -> tuple[str, list[str]]:
    """An old variant label (`rollplex:tokens8192+after`) -> (its mode, the overrides its variants set)."""
    name, _, variant = label.partition(":")
    over = []
    for part in variant.split("+"):
        size = next((k for k in OLD_SIZED if part.startswith(k) and part[len(k):].isdigit()), None)
        if part in OLD_VARIANTS:
            over.append(OLD_VARIANTS[part])
        elif size is not None and int(part[len(size):]) > 0:
            over.append(f"{OLD_SIZED[size]}={int(part[len(size):])}")
        else:
            raise ValueError(f"--modes: {label!r}: bench takes no variants after ':' (and {part!r} was none); a mode "
                             f"carries Hydra overrides in brackets: \"{name}[key=value,...]\"")
    return name, over


def label_spec(label: str) -> tuple[str, tuple[str, ...]]:
    """A recorded mode label, new (`rollplex[mode.window=after]`) or old (`rollplex:after`) -> (mode, overrides)."""
    name, over = old_label_spec(label) if ":" in label.partition("[")[0] else parse_mode(label)
    return name, tuple(over)


def _refuse_old_labels(entries: list[str]) -> None:
    """Refuse old variant labels in `--modes` with one line that gives the whole `--modes` value rewritten."""
    old = [e for e in entries if ":" in e.partition("[")[0]]
    if "[" in old[0]:
        raise ValueError(f"--modes: {old[0]!r}: bench takes no variants after ':'; give every setting in the "
                         f"brackets: \"{old[0].partition(':')[0]}[key=value,...]\"")
    new = [mode_label(*old_label_spec(e)) if e in old else e for e in entries]
    raise ValueError(f"--modes: {old[0]!r} is a variant label, which bench no longer takes: a mode carries Hydra "
                     f"overrides in brackets; run --modes \"{','.join(new)}\"")


def _check_overrides(label: str, overrides: list[str]) -> None:
    """A mode's overrides: each `key=value` (or `~key`, `env:NAME=V` of `CUDA_ENV`), each key once, none of the
    settings bench gives every mode itself."""
    keys = set()
    for o in overrides:
        key = override_key(o)
        if "=" not in o and not o.startswith("~"):
            raise ValueError(f"--modes: {label!r}: {o!r} is not an override; write key=value")
        if key.startswith("env:") and key[len("env:"):] not in CUDA_ENV:
            raise ValueError(f"--modes: {label!r}: {key} is not a variable a mode's record keeps; env: sets one of "
                             f"{', '.join(CUDA_ENV)}")
        if key in BENCH_SETS:
            raise ValueError(f"--modes: {label!r}: {key} {BENCH_SETS[key]}")
        if key in keys:
            raise ValueError(f"--modes: {label!r} gives {key} twice; give it once")
        keys.add(key)


def parse_modes(spec: str) -> list[tuple[str, list[str]]]:
    """`serial,rollplex[mode.window=after]` -> [(label, overrides)], `mode.name=<mode>` first; a one-line error for
    an unknown mode, a malformed entry or an old variant label (with its new form)."""
    entries = [e.strip() for e in split_top(spec) if e.strip()]
    if any(":" in e.partition("[")[0] for e in entries):
        _refuse_old_labels(entries)
    out = []
    for entry in entries:
        name, over = parse_mode(entry)
        if name == "disaggregated":
            raise ValueError("--modes: disaggregated runs on parallel.rollout_ranks more processes than the other "
                             "modes; bench it on its own (a JSON of its own: bench SUITE --modes disaggregated "
                             "mode=disaggregated parallel.rollout_ranks=N)")
        if name not in PHASE_FLOPS:
            raise ValueError(f"--modes: unknown mode {name!r} in {entry!r}; choose from {', '.join(PHASE_FLOPS)}")
        label = mode_label(name, over)
        _check_overrides(label, over)
        if any(label == seen for seen, _ in out):
            raise ValueError(f"--modes: {label!r} is given twice; each mode runs once per suite JSON")
        out.append((label, [f"mode.name={name}", *over]))
    if not out:
        raise ValueError("--modes: no mode given")
    return out


def check_modes(suite: str, overrides: list[str], specs: list[tuple[str, list[str]]]) -> None:
    """Compose every mode's config before any mode runs: an unknown key or a bad value is one line naming the mode."""
    for label, over in specs:
        try:
            load_run_config([f"+bench={suite}", *overrides, *split_env(over)[0]])
        except (ValueError, HydraException, OmegaConfBaseException) as e:
            raise ValueError(f"--modes {label}: {' '.join(str(e).split())}") from None


def split_env(mode_over: list[str]) -> tuple[list[str], dict[str, str]]:
    """A mode's overrides -> (its config overrides, the environment variables its process gets: `env:NAME=V`)."""
    env = dict(o[len("env:"):].split("=", 1) for o in mode_over if o.startswith("env:"))
    return [o for o in mode_over if not o.startswith("env:")], env


def file_stem(label: str) -> str:
    """A mode label as part of a file name (`rollplex[mode.window=after]` -> `rollplex_mode_window_after`): letters,
    digits and `_` only, at most 80 characters, a digest of the label after a cut one."""
    stem = re.sub(r"[^A-Za-z0-9]+", "_", label).strip("_")
    return stem if len(stem) <= 80 else f"{stem[:71]}_{hashlib.sha1(label.encode()).hexdigest()[:8]}"
