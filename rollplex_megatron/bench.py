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
import json
import shlex
import tempfile
from pathlib import Path

from rollplex_megatron.bench_markdown import check_page, render_markdown
from rollplex_megatron.bench_modes import check_modes, file_stem, label_spec, parse_modes, split_env
from rollplex_megatron.bench_record import planned_vs_measured, ratios, summarize_mode, window_cost
from rollplex_megatron.bench_run import ROOT, host_launch_us, machine, run_mode
from rollplex_megatron.checkpoint.files import atomic_write_text
from rollplex_megatron.recipes import RECIPES_DIR, load_run_config, to_yaml
from rollplex_megatron.runtime import environment_record

RESULTS = ROOT / "benchmarks" / "results"


def _merged(path: str) -> dict:
    """The suite JSON `--merge` names, or a one-line error naming it."""
    if Path(path).is_dir():
        raise ValueError(f"--merge {path} is a folder; name a suite JSON this command wrote")
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
        md = Path(a.md) if a.md else ROOT / "BENCHMARKS.md"
        check_page(RESULTS, md)
        atomic_write_text(md, render_markdown(RESULTS))
        return 0
    if a.warmup < 0:
        raise ValueError(f"bench: --warmup must be >= 0, got {a.warmup}")
    if a.timeout is not None and a.timeout <= 0:
        raise ValueError(f"bench: --timeout must be > 0 seconds, got {a.timeout}")
    if not a.suite or not (RECIPES_DIR / "bench" / f"{a.suite}.yaml").exists():
        have = sorted(p.stem for p in (RECIPES_DIR / "bench").glob("*.yaml"))
        said = f"no suite {a.suite!r}; " if a.suite else ""
        raise ValueError(f"bench: {said}name a suite, one of {have} (recipes/bench/SUITE.yaml)")
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
    # the --merge file is read before a dry run returns: a dry run refuses a file the run would refuse
    prev = _merged(a.merge) if a.merge else None
    if prev is not None and prev.get("warmup") != a.warmup:
        raise ValueError(f"--merge {a.merge}: its modes kept --warmup {prev.get('warmup')} steps apart, this run "
                         f"{a.warmup}; the steady figures of one JSON share one warm-up: pass --warmup "
                         f"{prev.get('warmup')}")
    if a.dry_run:
        for label, over in specs:
            cfg_over, env = split_env(over)
            words = [*(f"{k}={v}" for k, v in env.items()), "python", "-m", "rollplex_megatron", "train",
                     f"+bench={a.suite}", *overrides, *cfg_over]
            print(f"{label}: {shlex.join(words)}")
        return 0
    out = Path(a.out) if a.out else RESULTS / f"bench_{a.suite}.json"
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
    check_page(out.parent, md, (out,))
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
            atomic_write_text(md, render_markdown(out.parent, (out,)))
    for k, v in result["ratios"].items():
        print(f"{k}: {v:.2f}x")
    print(out)
    return 0
