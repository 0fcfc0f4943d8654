"""`bench SUITE`: every mode of a suite on one workload, each in its own process from the same seed;
one JSON per suite under benchmarks/results/ and BENCHMARKS.md generated from those JSONs.

A suite is a recipe `recipes/bench/SUITE.yaml` (model, workload, drawn response lengths). `--modes` lists
`serial`, `prefix_shared` and `rollplex`, each run at its defaults, or with Hydra overrides of its own in
brackets: `--modes "rollplex,rollplex[mode.window=after]"` (quote it: the shell reads brackets). Inside the
brackets overrides are split at top-level commas only, so a value keeps commas inside [], {}, () or quotes
(`rollplex[data.train_files=[a,b]]`); `env:NAME=V` sets one of the variables CUDA reads at start-up in that
mode's process (`env:CUDA_DEVICE_MAX_CONNECTIONS=1`). Every mode's config is composed before any mode runs,
so an unknown key stops the command first; each mode's record keeps its overrides. Settings for every mode
go after the suite name (`bench video_long train.steps=4`). The variant labels of older records
(`rollplex:tokens8192+after`) are read as the overrides they set (`OLD_VARIANTS`); a command that gives one is
refused with its new form. Every figure is a median of the steady steps
(after `--warmup`); the warm-up steps are kept apart with the phases that hold their excess.
`--profile` runs one more step per mode under torch.profiler and saves its top ops per phase beside
the JSON (that step is left out of every figure); `--profile-phases update,...` profiles only those.
Ratios compare medians of one JSON, whose modes ran on one machine (`machine`: host and GPU UUIDs;
`--merge` adds modes only to a JSON of the same machine).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from rollplex_megatron.checkpoint.files import atomic_write_text
from rollplex_megatron.recipes import RECIPES_DIR, load_run_config, override_key, to_yaml
from rollplex_megatron.report import read_metrics
from rollplex_megatron.runtime import CUDA_ENV, environment_record

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
WINDOWS = ("interleave", "after", "stream", "tail", "green", "auto")
GIB = 2**30
PARTS_PHASES = ("rollout", "old_logp", "ref_logp", "update", "optimizer")  # whose parts BENCHMARKS.md lists
NESTED_PARTS = ("forward", "loss", "attention")  # parts inside others (the schedule, prefix stages): not summed again
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


class BenchModeError(ValueError):
    """A mode's training process failed (its own last error lines inside): reported as one line, no traceback."""


def _merged(path: str) -> dict:
    """The suite JSON `--merge` names, or a one-line error naming it."""
    try:
        prev = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"--merge {path} does not exist; name a suite JSON this command wrote") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--merge {path}: malformed JSON ({e.msg}, line {e.lineno}); name a suite JSON this command "
                         f"wrote") from None
    need = ("suite", "machine", "environment", "settings", "modes")
    if not isinstance(prev, dict) or any(k not in prev for k in need):
        raise ValueError(f"--merge {path} is not a suite JSON of this command (it needs {', '.join(need)})")
    return prev


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


def cpu_model() -> str:
    """The host CPU's model name (/proc/cpuinfo; the platform's processor string elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> dict:
    """The machine's identity: ratios are only taken between modes that ran on the same one. `cpu` and `cpus`
    describe the host (not part of the identity): the launch-bound phases depend on its speed."""
    gpus = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    return {"host": socket.gethostname(), "gpu_uuids": gpus, "device_count": max(len(gpus), 1),
            "cpu": cpu_model(), "cpus": os.cpu_count()}


# Host time per launch of a tiny kernel on the GPU: 6 rounds of 2000 in-place adds, each round synchronised
# once, the median of the last 5 (the first warms up). A one-element add takes the device little time, so
# the figure is the host's issue rate wherever that is slower: what bounds phases of many small kernels
# (the update's response stages). Not yet run on the GPU machine.
LAUNCH_PROBE = """
import statistics, time, torch
x = torch.zeros(1, device="cuda")
rounds = []
for _ in range(6):
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(2000):
        x.add_(1)
    torch.cuda.synchronize(); rounds.append((time.perf_counter() - t) / 2000 * 1e6)
print(statistics.median(rounds[1:]))
"""


def host_launch_us() -> float | None:
    """`LAUNCH_PROBE` in a process of its own (the bench's own process holds no CUDA context while a mode
    trains); None without CUDA or if the probe fails."""
    if not torch.cuda.is_available():
        return None
    p = subprocess.run([sys.executable, "-c", LAUNCH_PROBE], capture_output=True, text=True, timeout=120)
    try:
        return float(p.stdout.split()[-1]) if p.returncode == 0 else None
    except (IndexError, ValueError):
        return None


def split_env(mode_over: list[str]) -> tuple[list[str], dict[str, str]]:
    """A mode's overrides -> (its config overrides, the environment variables its process gets: `env:NAME=V`)."""
    env = dict(o[len("env:"):].split("=", 1) for o in mode_over if o.startswith("env:"))
    return [o for o in mode_over if not o.startswith("env:")], env


def run_mode(suite: str, overrides: list[str], mode_over: list[str], out: Path, timeout: float | None,
             profile_step: int = 0, profile_phases: str = "") -> list[dict]:
    """Train one mode in its own process; its step records. `profile_step`: one more step, profiled
    (its kernel table lands in `out`/profile_step<K>.json; its record is left out of the figures), only
    in `profile_phases` (comma-separated; empty: every phase). `env:NAME=V` entries of `mode_over` set
    NAME in that process's environment (read when CUDA starts, so not a config setting)."""
    mode_over, env = split_env(mode_over)
    extra = [f"train.steps={profile_step}", f"train.profile_step={profile_step}"] if profile_step else []
    if profile_step and profile_phases:
        extra.append(f"train.profile_phases=[{profile_phases}]")
    cmd = [sys.executable, "-m", "rollplex_megatron", "train", f"+bench={suite}", *overrides, *mode_over, *extra,
           f"train.out={out}", "train.save_final=false", "train.progress=false"]
    # from the caller's folder, as `train` would run (relative paths in the overrides mean the same), with this
    # checkout first on the path
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, "PYTHONPATH": path, **env})
    except subprocess.TimeoutExpired:
        raise BenchModeError(f"bench: {' '.join(mode_over)} ran past --timeout {timeout:g} s and was stopped; raise "
                             f"--timeout or run fewer steps (train.steps)") from None
    if p.returncode != 0:
        tail = [ln for ln in p.stderr.splitlines() if ln.strip() and "warn" not in ln.lower()][-8:]
        raise BenchModeError(f"bench: {' '.join(mode_over)} failed (exit {p.returncode}): " + " | ".join(tail))
    recs = [r for r in read_metrics(out / "metrics.jsonl") if r.get("kind") != "val"]
    return [r for r in recs if r["step"] != profile_step] if profile_step else recs


def _median(xs):
    return statistics.median(xs) if xs else None


def phase_flops(mode: str, rec: dict, recompute: bool) -> dict:
    """Forward+backward FLOPs of each phase of one step record."""
    parts, out = rec["fwd_flops"], {}
    for phase, mult in PHASE_FLOPS[mode].items():
        f = sum(parts[k] * m for k, m in mult.items())
        if phase == "update" and recompute and mode != "serial":
            f += parts["prefix"]
        out[phase] = f
    return out


PREFIX_GRAPH_COUNTERS = ("prefix_graphs_captured", "prefix_graph_replays", "prefix_graph_eager",
                         "prefix_graph_capture_s", "prefix_graph_pool_gib")


def prefix_graph_summary(rollouts: list[dict]) -> dict | None:
    """mode.window_graphs' per-step counters of the steady steps' rollout stats, as medians (None when the
    setting was off), and the reason captures stopped if a step gave one."""
    if not any("prefix_graph_replays" in r for r in rollouts):
        return None
    out = {k: _median([r.get(k, 0) for r in rollouts]) for k in PREFIX_GRAPH_COUNTERS}
    errors = [r["prefix_graph_error"] for r in rollouts if r.get("prefix_graph_error")]
    if errors:
        out["error"] = errors[-1]
    return out


def summarize_mode(label: str, records: list[dict], warmup: int, recompute: bool) -> dict:
    """Step times, the steady medians, the warm-up steps apart, per-phase times, memory, tokens/s,
    achieved TFLOP/s and the decode window's record of one mode, with the mode and the overrides it ran with."""
    mode, over = label_spec(label)
    steady, first = records[warmup:], records[:warmup]
    med = _median([r["step_time_s"] for r in steady])
    phases = list(dict.fromkeys(k for r in records for k in r["phase_times"]))
    phase_med = {p: _median([r["phase_times"].get(p, 0.0) for r in steady]) for p in phases}
    one_update = all(r.get("optimizer_steps", 1) == 1 and "dynamic_sampling" not in r["rollout"] for r in steady)
    flops = [phase_flops(mode, r, recompute) for r in steady]
    # PHASE_FLOPS holds for one update per step on the batch sampled; fwd_flops are the whole job's
    # (every DP rank; divide by the GPU count for per-GPU figures)
    tflops = {p: _median([f[p] / r["phase_times"][p] / 1e12 for f, r in zip(flops, steady)
                          if r["phase_times"].get(p)]) for p in PHASE_FLOPS[mode]} if one_update else {}
    warm = []
    for r in first:  # one-time costs: the phases holding the excess over the steady median
        excess = {p: r["phase_times"].get(p, 0.0) - phase_med[p] for p in phases}
        top = max(excess, key=excess.get)
        warm.append({"step": r["step"], "step_time_s": r["step_time_s"], "excess_s": r["step_time_s"] - med,
                     "phase_excess_s": excess, "largest_in": top, "capture_s": r["rollout"].get("capture_s"),
                     "prefix_graph_capture_s": r["rollout"].get("prefix_graph_capture_s"),
                     "offload_bytes": r.get("offload_bytes")})
    ro = [r["rollout"] for r in steady]
    window = None
    if mode == "rollplex":
        inside, after = _median([x.get("window_s", 0.0) for x in ro]), _median([x.get("after_s", 0.0) for x in ro])
        window = {"mechanism": ro[-1].get("window_mechanism"), "items_in_window": _median([x.get("items_in_window", 0)
                                                                                            for x in ro]),
                  "items_after": _median([x.get("items_after", 0) for x in ro]),
                  "side_work_in_window_s": inside, "side_work_after_s": after,
                  # GPU spans of the same items (CUDA timing events; absent in older records and on CPU)
                  "side_work_in_window_gpu_s": _median([x["window_gpu_s"] for x in ro if "window_gpu_s" in x]),
                  "side_work_after_gpu_s": _median([x["after_gpu_s"] for x in ro if "after_gpu_s" in x]),
                  # the share of the side work that ran inside the decode window (not the share of it
                  # hidden behind decode: compare rollout_excess_s with side_work_in_window_s for that)
                  "in_window_share": inside / (inside + after) if inside + after > 0 else None}
        graphs = prefix_graph_summary(ro)
        if graphs is not None:
            window["prefix_graphs"] = graphs
    return {
        "label": label, "mode": mode, "overrides": list(over),
        "step_times_s": [r["step_time_s"] for r in records], "warmup_steps": warm,
        "steady": {"steps": [r["step"] for r in steady], "median_s": med,
                   "min_s": min(r["step_time_s"] for r in steady), "max_s": max(r["step_time_s"] for r in steady)},
        "phase_median_s": phase_med,
        "phase_parts_s": phase_parts(steady),
        "phase_peak_gib": {p: max(r["phase_peak_bytes"].get(p, 0) for r in steady) / GIB
                           for p in phases if any(p in r["phase_peak_bytes"] for r in steady)},
        "peak_mem_gib": max(r["peak_mem_bytes"] for r in steady) / GIB,
        "peak_mem_source": steady[-1]["peak_mem_source"],
        "response_tokens": _median([r["response_tokens"] for r in steady]),
        "prompt_tokens": _median([r["prompt_tokens"] for r in steady]),
        "decode_tokens_per_s": _median([r["response_tokens"] / r["phase_times"]["rollout"] for r in steady]),
        "step_response_tokens_per_s": _median([r["response_tokens"] / r["step_time_s"] for r in steady]),
        "step_prompt_tokens_per_s": _median([r["prompt_tokens"] / r["step_time_s"] for r in steady]),
        "achieved_tflops": tflops,
        "rollout": {k: _median([x.get(k, 0) for x in ro]) for k in ("decode_steps", "capture_s", "graphs_captured",
                                                                    "prefill_s", "decode_s")},
        "window": window,
        "rollout_layout": steady[-1].get("rollout_layout"),  # a rollout model of its own: bytes it owns, replicas
        # memory.plan and the classes it released (auto: the set chosen for this run's budget)
        "memory": {"plan": steady[-1].get("memory_plan"), "released": steady[-1].get("memory_released")},
    }


def planned_vs_measured(plan_json: Path, mode: dict) -> dict:
    """The run's plan (its memory_plan.json: what the planner chose and its per-phase GiB) beside the allocator's
    per-phase peaks of the steady steps: planned over measured per phase (the planner is within 10% where the ratio
    is in [0.9, 1.1]; over 1 it plans more than ran)."""
    plan = json.loads(plan_json.read_text())
    measured = mode["phase_peak_gib"]
    return {"auto_choices": plan.get("auto_choices", {}), "released": plan.get("released"),
            "phase_gib": plan["phase_gib"], "peak_gib": plan["peak_gib"], "budget_gib": plan.get("auto_budget_gib"),
            "planned_over_measured": {p: plan["phase_gib"][p] / measured[p] for p in plan["phase_gib"]
                                      if measured.get(p)}}


def phase_parts(steady: list[dict]) -> dict:
    """Per phase, per named part (`spans`): the medians over the steady steps of its count, host seconds and GPU
    seconds (CUDA timing events; None on CPU). Records from before the parts were recorded give {}."""
    out: dict[str, dict] = {}
    for phase in dict.fromkeys(p for r in steady for p in r.get("phase_parts", {})):
        names = dict.fromkeys(n for r in steady for n in r.get("phase_parts", {}).get(phase, {}))
        rows = {}
        for n in names:
            got = [r["phase_parts"][phase][n] for r in steady if n in r.get("phase_parts", {}).get(phase, {})]
            gpu = [g["gpu_s"] for g in got if g["gpu_s"] is not None]
            rows[n] = {"count": _median([g["count"] for g in got]), "host_s": _median([g["host_s"] for g in got]),
                       "gpu_s": _median(gpu)}
        out[phase] = rows
    return out


def parts_line(label: str, m: dict, phase: str) -> str | None:
    """One mode's parts of `phase` for BENCHMARKS.md: GPU seconds with the host's beside them (host seconds alone
    where no GPU time exists; a part whose host time exceeds its GPU time by 10% is marked as paced by the host),
    the update schedule's backward by difference (schedule - forward - loss), and what no part covers."""
    parts = m.get("phase_parts_s", {}).get(phase)
    if not parts or phase not in m["phase_median_s"]:
        return None

    def sec(row):
        return row["gpu_s"] if row["gpu_s"] is not None else row["host_s"]

    cells = []
    for name, row in parts.items():
        host = f" (host {row['host_s']:.2f}{', paced by the host' if row['host_s'] > 1.1 * row['gpu_s'] else ''})" \
            if row["gpu_s"] is not None else ""
        cells.append(f"{name} {sec(row):.2f}{host}")
    if "schedule" in parts and phase == "update":  # forward and backward (the scoring phases run forward only)
        inner = sum(sec(parts[n]) for n in NESTED_PARTS if n in parts)
        cells.append(f"backward by difference {sec(parts['schedule']) - inner:.2f}")
    top = sum(sec(row) for name, row in parts.items() if name not in NESTED_PARTS)
    cells.append(f"not in a part {m['phase_median_s'][phase] - top:.2f}")
    return f"- {label}, {phase} {m['phase_median_s'][phase]:.2f} s: " + "; ".join(cells)


WINDOW_ONLY = ("mode.window_graphs",)  # settings that change only the window's side items, not the decode


def _settings(label: str, window: bool = True) -> frozenset:
    """A mode label's overrides other than its window mechanism (`rollplex[a=1,mode.window=after]` -> {a=1}); with
    `window=False` also without those that change only the side items (`WINDOW_ONLY`): the settings of the same
    decode without them, a prefix_shared mode's. Old labels read as the overrides their variants set."""
    drop = ("mode.window",) if window else ("mode.window", *WINDOW_ONLY)
    return frozenset(o for o in label_spec(label)[1] if override_key(o) not in drop)


def window_cost(modes: dict) -> None:
    """Each rollplex variant's rollout time over that of the prefix_shared mode with the same other variants
    (same decode without side work; a `WINDOW_ONLY` variant such as graphs is matched by the mode without it):
    what the window's side work and the actor prefill's K/V leaves added
    to the rollout phase (`rollout_excess_s`, against `rollout_excess_vs`), and the bound that sets: the
    ratio over that prefix_shared mode had the rollout cost no more than its (`free_window_ratio`: the median
    step less the excess; a free window can reach no further, all else as measured).

    With that mode's rollout `R` and the side work's time alone `S` (its items' CUDA spans in a rollplex run of
    the same settings whose items had the GPU to themselves: `after`, else `interleave`): the window ratio,
    (R + S) / this rollout (`window_ratio`: the rollout alone plus its side work alone over the two together),
    and the most any overlap can give, (R + S) / max(R, S) (`window_ratio_bound`: the side work hidden whole).
    A span holds whatever GPU idle an item's issuing leaves inside it, so `S` is at most the item's work and
    both figures are upper bounds where items are paced by the host."""
    alone_side = {}  # settings -> S, from a run whose items did not share the GPU with decode
    for mech in ("after", "interleave"):
        for k, m in modes.items():
            w = m.get("window") or {}
            if label_spec(k)[0] == "rollplex" and w.get("mechanism") == mech \
                    and w.get("side_work_in_window_gpu_s") is not None:
                side = w["side_work_in_window_gpu_s"] + (w.get("side_work_after_gpu_s") or 0.0)
                alone_side.setdefault(_settings(k), side)
    for k, m in modes.items():
        base = next((b for b in modes if label_spec(b)[0] == "prefix_shared"
                     and _settings(b) == _settings(k, window=False)), None)
        if m.get("window") and base is not None:
            alone = modes[base]["phase_median_s"]["rollout"]
            excess = m["phase_median_s"]["rollout"] - alone
            m["window"]["rollout_excess_s"] = excess
            m["window"]["rollout_excess_vs"] = base
            side = alone_side.get(_settings(k))
            if side is not None:
                m["window"]["window_ratio"] = (alone + side) / m["phase_median_s"]["rollout"]
                m["window"]["window_ratio_bound"] = (alone + side) / max(alone, side)
            if "steady" in m and "steady" in modes[base]:
                m["window"]["free_window_ratio"] = (modes[base]["steady"]["median_s"]
                                                    / (m["steady"]["median_s"] - max(excess, 0.0)))


def ratios(modes: dict) -> dict:
    """`a/b` = median step of a over median step of b: every non-rollplex mode over every rollplex
    mode, each rollplex mode over plain rollplex, a mode with rollout.bound_model=true over the same mode without
    it (what the shared path costs), and one with memory.plan=auto over the same with keep (what auto costs)."""
    med = {k: m["steady"]["median_s"] for k, m in modes.items()}
    spec = {k: (label_spec(k)[0], frozenset(label_spec(k)[1])) for k in med}
    fast = [k for k in modes if spec[k][0] == "rollplex"]
    out = {f"{a}/{b}": med[a] / med[b] for b in fast for a in modes if a not in fast}
    if "rollplex" in med:
        out.update({f"{b}/rollplex": med[b] / med["rollplex"] for b in fast if b != "rollplex"})
    for had, instead in (("rollout.bound_model=true", None), ("memory.plan=auto", "memory.plan=keep")):
        for k, (name, over) in spec.items():
            other = (name, over - {had} | ({instead} if instead else set()))
            base = next((b for b in med if had in over and spec[b] == other), None)
            if base is not None:
                out[f"{k}/{base}"] = med[k] / med[base]
    return out


def suite_overrides(d: dict) -> list[str]:
    """The `key=value` settings a suite JSON's run changed from the suite's recipe (`overrides`; older JSONs:
    read from the command line)."""
    if "overrides" in d:
        return d["overrides"]
    return [t for t in d["command"].split() if "=" in t and not t.startswith("-")]


def cuda_env_line(d: dict) -> str:
    """What the modes' processes ran under of the variables CUDA reads at start-up (`runtime.CUDA_ENV`)."""
    seen = {label: m["cuda_env"] for label, m in d["modes"].items() if "cuda_env" in m}
    if not seen:
        return ("CUDA environment: not recorded (before the record existed the GPU scripts exported "
                "CUDA_DEVICE_MAX_CONNECTIONS=1: every stream on one hardware queue).")
    groups: dict[str, list[str]] = {}
    for label, env in seen.items():
        key = ", ".join(f"{k}={v}" for k, v in sorted(env.items()) if v is not None) or "none set"
        groups.setdefault(key, []).append(label)
    return "CUDA environment: " + "; ".join(f"{k} ({', '.join(v)})" for k, v in groups.items()) + "."


def render_markdown(results: Path) -> str:
    """BENCHMARKS.md: one table per suite JSON (generated; edit the JSONs' runs, not this file)."""
    lines = ["# Benchmarks", "",
             "Generated by `python -m rollplex_megatron bench` from `benchmarks/results/bench_*.json`;",
             "do not edit by hand. Medians of the steady steps; warm-up steps are listed apart. Each table lists",
             "the modes at their defaults first, then those run with overrides (`rollplex[mode.window=after]`; older",
             "records' labels `mode:variant` name the overrides of docs/benchmarks/index.md's table).", ""]
    for path in sorted(x for x in results.glob("bench_*.json") if not x.name.endswith("_profile.json")):
        d = json.loads(path.read_text())
        d["modes"] = dict(sorted(d["modes"].items(), key=lambda kv: bool(label_spec(kv[0])[1])))  # defaults first
        window_cost(d["modes"])  # derived from the JSON's own medians (older JSONs compared exact labels only)
        env = d["environment"]
        lines += [f"## {d['suite']}", "", d.get("description", ""), "",
                  f"`{path.name}`: {env['device']} x{d['machine']['device_count']}, commit {env['commit']}, "
                  f"{env['date']}, torch {env['torch']}, megatron-core {env['megatron_core']}, CUDA {env['cuda']}.",
                  f"Command: `{d['command']}`", ""]
        changed = [o for o in suite_overrides(d) if override_key(o) != "train.steps"]
        if changed:  # the description above is the recipe's; say what this run changed
            lines += [f"Run with the suite changed: {', '.join(f'`{o}`' for o in changed)}.", ""]
        lines += [cuda_env_line(d), ""]
        if d["machine"].get("cpu"):
            launch = [f"{label} {m['host_launch_us']:.1f}" for label, m in d["modes"].items()
                      if m.get("host_launch_us") is not None]
            lines += [f"Host: {d['machine']['cpu']}, {d['machine']['cpus']} CPUs"
                      + (f"; host time per tiny kernel launch after each mode (us): {', '.join(launch)}"
                         if launch else "") + ".", ""]
        phases = list(dict.fromkeys(p for m in d["modes"].values() for p in m["phase_median_s"]))
        lines += ["| mode | step (s) | min-max | " + " | ".join(phases) + " | peak GiB | decode tok/s | window |",
                  "|---" * (5 + len(phases)) + "|"]
        for label, m in d["modes"].items():
            s, w = m["steady"], m["window"]
            gpu = w.get("side_work_in_window_gpu_s") if w else None
            span = f" (GPU {gpu:.2f} s)" if gpu is not None else ""
            bound = f" (a free window: {w['free_window_ratio']:.2f}x)" if w and w.get("free_window_ratio") else ""
            if w and w.get("window_ratio") is not None:
                bound += f"; window ratio {w['window_ratio']:.2f}, at most {w['window_ratio_bound']:.2f}"
            win = (f"{w['mechanism']}: side work {w['side_work_in_window_s']:.2f} s{span}, rollout "
                   f"{w['rollout_excess_s']:+.2f} s vs {w.get('rollout_excess_vs', 'prefix_shared')}{bound}"
                   if w and w.get("rollout_excess_s") is not None
                   else (w["mechanism"] if w else "-"))
            cell = label.replace("|", "\\|")  # an override's value may hold one; the table would split there
            lines.append(f"| {cell} | {s['median_s']:.2f} | {s['min_s']:.2f}-{s['max_s']:.2f} | "
                         + " | ".join(f"{m['phase_median_s'].get(p, 0):.2f}" for p in phases)
                         + f" | {m['peak_mem_gib']:.1f} | {m['decode_tokens_per_s']:.0f} | {win} |")
        lines += ["", "Ratios (median step of the first over the second): "
                  + ", ".join(f"{k} {v:.2f}x" for k, v in {**d["ratios"], **ratios(d["modes"])}.items()), "",
                  "Achieved TFLOP/s (analytic FLOPs of every GPU / phase time; one update a step only): "
                  + "; ".join(f"{label}: " + ", ".join(f"{p} {v:.3g}" for p, v in m["achieved_tflops"].items()
                                                       if v is not None) for label, m in d["modes"].items()), ""]
        plans = [f"{label}: {m['memory']['plan']}, "
                 + (", ".join(m["memory"]["released"]) if m["memory"]["released"] else "nothing") + " released"
                 for label, m in d["modes"].items() if (m.get("memory") or {}).get("plan")]
        if plans:  # JSONs from before the record have none
            lines += ["Memory plan (memory.plan, the classes it released): " + "; ".join(plans), ""]
        warm = [f"{label} step {w['step']} {w['excess_s']:+.2f} s (largest in {w['largest_in']}, "
                f"{w['phase_excess_s'][w['largest_in']]:+.2f} s)" for label, m in d["modes"].items()
                for w in m["warmup_steps"]]
        lines += ["Warm-up steps (excess over the steady median): " + "; ".join(warm), ""]
        parts = [line for label, m in d["modes"].items() for phase in PARTS_PHASES
                 if (line := parts_line(label, m, phase))]
        if parts:
            lines += ["Parts of the phases (medians, seconds of GPU time between timing events on the compute "
                      "stream; `rollplex_megatron/spans.py`):", "", *parts, ""]
        profs = [f"{label}: `{m['profile']}`" for label, m in d["modes"].items() if m.get("profile")]
        if profs:
            lines += ["Kernel profiles of one extra step (top ops per phase): " + ", ".join(profs), ""]
        if d.get("notes"):
            lines += [f"Note: {d['notes']}", ""]
    return "\n".join(lines + planner_refusals(results))


def planner_refusals(results: Path) -> list[str]:
    """A section per `plan_auto_*.json` (benchmarks/plan_auto_video_long.py) in which some mode fits under no
    release, or not under memory.plan=keep: the runs a device cannot hold, said with the planner's figures
    instead of left out."""
    lines = []
    for path in sorted(results.glob("plan_auto_*.json")):
        d = json.loads(path.read_text())
        refused = [r for r in d["rows"] if r.get("fits") is False]
        no_keep = [r for r in d["rows"] if r.get("fits") and r["keep_peak_gib"] > r["budget_gib"]]
        if no_keep:
            lines += [f"## memory.plan=keep does not fit: {d['what']}", "", f"`{path.name}`, commit "
                      f"{d['environment']['commit']}: " + "; ".join(
                          f"{r['mode']} ({r['norm_kernel']} norm) needs {r['keep_peak_gib']:.1f} GiB under keep, "
                          f"{r['peak_gib']:.1f} GiB under auto (releases {', '.join(r['released']) or 'nothing'})"
                          for r in no_keep) + ".", ""]
        if not refused:
            continue
        lines += [f"## Does not fit: {d['what']}", "", f"`{path.name}`, commit {d['environment']['commit']}. "
                  f"Command: `{d['command']}`", "", "| mode | norm kernel | budget GiB | phase plan peak GiB | "
                  "keep peak GiB | planner |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['mode']} | {r['norm_kernel']} | {r['budget_gib']:g} | {r['phase_peak_gib']:.1f} | "
                  f"{r['keep_peak_gib']:.1f} | {r['refusal']} |" for r in refused]
        lines.append("")
    return lines


def file_stem(label: str) -> str:
    """A mode label as part of a file name (`rollplex[mode.window=after]` -> `rollplex_mode_window_after`): letters,
    digits and `_` only, at most 80 characters, a digest of the label after a cut one."""
    stem = re.sub(r"[^A-Za-z0-9]+", "_", label).strip("_")
    return stem if len(stem) <= 80 else f"{stem[:71]}_{hashlib.sha1(label.encode()).hexdigest()[:8]}"


def _write(out: Path, result: dict) -> None:
    """The JSON, atomically (never half-written)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(result, indent=1))


def main(argv: list[str]) -> int:
    """The `bench` command."""
    ap = argparse.ArgumentParser(prog="rollplex bench", description=__doc__)
    ap.add_argument("suite", nargs="?", help="recipes/bench/SUITE.yaml")
    ap.add_argument("--modes", default="serial,prefix_shared,rollplex",
                    help="comma-separated modes, each at its defaults or with Hydra overrides of its own in brackets: "
                         "\"rollplex,rollplex[mode.window=after]\" (split at top-level commas only)")
    ap.add_argument("--warmup", type=int, default=2, help="first steps kept apart from the steady figures")
    ap.add_argument("--out", help="the suite's JSON (default benchmarks/results/bench_SUITE.json)")
    ap.add_argument("--merge", help="a JSON of this suite from the same machine: its modes are kept")
    ap.add_argument("--md", help="the page to regenerate from the JSONs beside --out (default: BENCHMARKS.md for "
                                 "benchmarks/results, else --out with .md)")
    ap.add_argument("--render", action="store_true", help="only regenerate BENCHMARKS.md from benchmarks/results")
    ap.add_argument("--dry-run", action="store_true",
                    help="compose every mode's config and print the command each mode would run; run and write nothing")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per mode")
    ap.add_argument("--profile", action="store_true",
                    help="one extra step per mode under torch.profiler: top ops per phase, saved beside the JSON")
    ap.add_argument("--profile-phases", default="",
                    help="with --profile: only these phases (comma-separated, e.g. update,ref_logp; default all)")
    a, overrides = ap.parse_known_args(argv)
    if a.render:
        if a.suite or overrides:
            raise ValueError(f"bench --render only regenerates BENCHMARKS.md from {RESULTS.relative_to(ROOT)}: drop "
                             f"{a.suite or overrides[0]} (or drop --render to run a suite)")
        if not any(RESULTS.glob("bench_*.json")):
            raise ValueError(f"bench --render: no bench_*.json under {RESULTS}; nothing to render (BENCHMARKS.md "
                             f"is left as it is)")
        atomic_write_text(Path(a.md) if a.md else ROOT / "BENCHMARKS.md", render_markdown(RESULTS))
        return 0
    if a.warmup < 0:
        raise ValueError(f"bench: --warmup must be >= 0, got {a.warmup}")
    if a.timeout is not None and a.timeout <= 0:
        raise ValueError(f"bench: --timeout must be > 0 seconds, got {a.timeout}")
    if not a.suite or not (RECIPES_DIR / "bench" / f"{a.suite}.yaml").exists():
        have = sorted(p.stem for p in (RECIPES_DIR / "bench").glob("*.yaml"))
        raise ValueError(f"bench: name a suite, one of {have} (recipes/bench/SUITE.yaml)")
    specs = parse_modes(a.modes)
    if a.profile_phases and not a.profile:
        raise ValueError("bench: --profile-phases needs --profile")
    cfg = load_run_config([f"+bench={a.suite}", *overrides])
    check_modes(a.suite, overrides, specs)
    if a.profile_phases:  # its phase names checked before any run; kept out of `settings` (no figure depends on it)
        load_run_config([f"+bench={a.suite}", *overrides, f"train.profile_phases=[{a.profile_phases}]"])
    steps = cfg.train.steps
    if steps < a.warmup + 3:
        raise ValueError(f"bench: train.steps={steps} leaves fewer than 3 steady steps after --warmup {a.warmup}; "
                         f"raise train.steps to {a.warmup + 3} or lower --warmup")
    if a.dry_run:
        for label, over in specs:
            cfg_over, env = split_env(over)
            words = [*(f"{k}={v}" for k, v in env.items()), "python", "-m", "rollplex_megatron", "train",
                     f"+bench={a.suite}", *overrides, *cfg_over]
            print(f"{label}: {shlex.join(words)}")
        return 0
    out = Path(a.out) if a.out else RESULTS / f"bench_{a.suite}.json"
    prev = _merged(a.merge) if a.merge else None
    if prev is not None and prev.get("warmup") != a.warmup:
        raise ValueError(f"--merge {a.merge}: its modes kept --warmup {prev.get('warmup')} steps apart, this run "
                         f"{a.warmup}; the steady figures of one JSON share one warm-up: pass --warmup "
                         f"{prev.get('warmup')}")
    here = machine()
    if prev is not None and (prev["suite"] != a.suite or prev["machine"]["host"] != here["host"]
                             or prev["machine"]["gpu_uuids"] != here["gpu_uuids"]):
        raise ValueError(f"--merge {a.merge}: another suite or machine ({prev['machine']['host']}); ratios never mix "
                         f"machines: run every mode here, or write a new JSON with --out")
    if out.exists() and (prev is None or Path(a.merge).resolve() != out.resolve()):
        raise FileExistsError(f"{out} exists; pass --merge {out} to add modes run on the same machine, or --out NEW")
    settings, env = to_yaml(cfg), environment_record()
    if prev is not None and prev["environment"]["commit"] != env["commit"]:
        raise ValueError(f"--merge {a.merge}: ran at commit {prev['environment']['commit']}, this is {env['commit']}; "
                         f"a suite's modes run at one commit")
    if prev is not None and prev["settings"] != settings:
        raise ValueError(f"--merge {a.merge}: the settings differ from this run's (same suite and overrides needed)")
    modes = dict(prev["modes"]) if prev else {}
    again = [label for label, _ in specs if label in modes]
    if again:  # a merge adds modes; replacing a measured one would drop it without a trace
        raise ValueError(f"--merge {a.merge} already holds {', '.join(again)}; drop it from --modes, or write a new "
                         f"JSON with --out")
    desc = (RECIPES_DIR / "bench" / f"{a.suite}.yaml").read_text().splitlines()
    command = " ".join(["python -m rollplex_megatron bench", *argv])
    result = {"suite": a.suite, "description": " ".join(ln.lstrip("# ") for ln in desc[1:] if ln.startswith("#")),
              "command": command, "commands": (prev or {}).get("commands", []) + [command], "overrides": overrides,
              "environment": env, "machine": here, "warmup": a.warmup, "settings": settings,
              "modes": modes, "ratios": {}, "notes": (prev or {}).get("notes", "")}
    # the project's BENCHMARKS.md is generated from benchmarks/results only; a JSON elsewhere gets a page of its own
    md = Path(a.md) if a.md else (ROOT / "BENCHMARKS.md" if out.parent.resolve() == RESULTS.resolve()
                                  else out.with_suffix(".md"))
    if a.md and not md.resolve().parent.is_dir():  # before any mode runs (--out's folder is created)
        raise ValueError(f"bench: --md {md}: folder {md.resolve().parent} does not exist; create it first")
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        for i, (label, over) in enumerate(specs):
            print(f"bench {a.suite}: {label} ...", flush=True)
            run = Path(tmp) / f"{i}_{label_spec(label)[0]}"  # an override's value may hold a path
            recs = run_mode(a.suite, overrides, over, run, a.timeout, steps + 1 if a.profile else 0,
                            a.profile_phases)
            modes[label] = summarize_mode(label, recs, a.warmup, bool(recs[-1].get("prefix_recompute")))
            modes[label]["planned"] = planned_vs_measured(run / "memory_plan.json", modes[label])
            modes[label]["cuda_env"] = {**env["cuda_env"], **split_env(over)[1]}  # what this mode's process ran under
            modes[label]["host_launch_us"] = host_launch_us()  # right after the mode, on the same host
            if a.profile:
                prof = out.parent / f"{out.stem}_{file_stem(label)}_profile.json"
                prof.write_text((run / f"profile_step{steps + 1}.json").read_text())
                modes[label]["profile"] = prof.name
            print(f"  median {modes[label]['steady']['median_s']:.2f} s over steps {modes[label]['steady']['steps']}",
                  flush=True)
            window_cost(modes)
            result["ratios"] = ratios(modes)
            _write(out, result)  # after every mode: a later failure or time-out keeps what ran
            atomic_write_text(md, render_markdown(out.parent))
    for k, v in result["ratios"].items():
        print(f"{k}: {v:.2f}x")
    print(out)
    return 0
