"""The `bench` driver on the tiny suite: every mode in its own process, one JSON, BENCHMARKS.md from it."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from rollplex_megatron import bench, bench_markdown, bench_modes, bench_record, bench_run
from rollplex_megatron.envs.motion import MotionEnv
from rollplex_megatron.memory.auto import NO_DEVICE_SIZES
from rollplex_megatron.trainer.runtime import drawn_lengths


def _bench(*args):
    return subprocess.run([sys.executable, "-m", "rollplex_megatron", "bench", "tiny", *args], capture_output=True,
                          text=True, timeout=900)


@pytest.fixture(scope="module")
def tiny_bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench_tiny.json"
    p = _bench("--warmup", "1", "--modes", "serial,rollplex,rollplex[mode.window=after]", "--out", str(out),
               "--profile", "--profile-phases", "rollout,update", "train.steps=4",
               "memory.plan=phase")  # every class released, whatever the default: the update recomputes prefixes
    assert p.returncode == 0, p.stderr[-3000:]
    return out


def test_bench_json_schema_and_markdown(tiny_bench):
    d = json.loads(tiny_bench.read_text())
    assert d["suite"] == "tiny" and list(d["modes"]) == ["serial", "rollplex", "rollplex[mode.window=after]"]
    for k in ("commit", "date", "device", "torch", "megatron_core", "cuda"):
        assert k in d["environment"]
    assert d["machine"]["host"] and "rollout:" in d["settings"]
    assert set(d["environment"]["cuda_env"]) == {"CUDA_DEVICE_MAX_CONNECTIONS", "PYTORCH_CUDA_ALLOC_CONF"}
    assert all(m["cuda_env"] == d["environment"]["cuda_env"] for m in d["modes"].values())  # no env variant here
    assert d["machine"]["cpu"] and d["machine"]["cpus"] >= 1  # the host's speed bounds launch-bound phases
    for m in d["modes"].values():  # measured only where CUDA is
        assert (m["host_launch_us"] > 0) if torch.cuda.is_available() else m["host_launch_us"] is None
    for label, m in d["modes"].items():
        assert len(m["step_times_s"]) == 4 and m["steady"]["steps"] == [2, 3, 4]
        assert m["steady"]["min_s"] <= m["steady"]["median_s"] <= m["steady"]["max_s"]
        assert [w["step"] for w in m["warmup_steps"]] == [1]
        assert {"rollout", "update", "optimizer"} <= set(m["phase_median_s"])
        assert m["decode_tokens_per_s"] > 0 and m["prompt_tokens"] > 0
        assert all(v > 0 for v in m["achieved_tflops"].values()) and "update" in m["achieved_tflops"]
        parts = m["phase_parts_s"]["update"]  # the update's named parts, medians of the steady steps
        assert {"memory", "schedule", "forward", "loss", "finalize_grads"} <= set(parts)
        assert all(r["host_s"] > 0 and (r["gpu_s"] is None) != torch.cuda.is_available() for r in parts.values())
    # drawn lengths with stop tokens ignored: every response has its request's drawn length
    assert d["modes"]["serial"]["response_tokens"] == d["modes"]["rollplex"]["response_tokens"]
    w = d["modes"]["rollplex"]["window"]
    assert w["mechanism"] == "interleave" and w["in_window_share"] == 1.0 and w["items_in_window"] == 4
    after = d["modes"]["rollplex[mode.window=after]"]  # a mode with an override: it ran, and its record keeps it
    assert (after["mode"], after["overrides"]) == ("rollplex", ["mode.window=after"])
    assert (d["modes"]["rollplex"]["mode"], d["modes"]["rollplex"]["overrides"]) == ("rollplex", [])
    assert after["window"]["mechanism"] == "after" and after["window"]["in_window_share"] == 0.0
    assert after["window"]["items_after"] == 4 and after["response_tokens"] == d["modes"]["rollplex"]["response_tokens"]
    assert after["profile"] == "bench_tiny_rollplex_mode_window_after_profile.json"
    assert (tiny_bench.parent / after["profile"]).is_file()
    assert "rollplex[mode.window=after]/rollplex" in d["ratios"]
    assert d["ratios"]["serial/rollplex"] == pytest.approx(
        d["modes"]["serial"]["steady"]["median_s"] / d["modes"]["rollplex"]["steady"]["median_s"])
    prof = json.loads((tiny_bench.parent / d["modes"]["rollplex"]["profile"]).read_text())
    assert prof["step"] == 5 and set(prof["top_ops_per_phase"]) == {"rollout", "update"}  # the extra step, and
    assert {"reward", "ref_logp", "optimizer"} <= set(prof["phase_times"])  # only the phases asked for profiled
    busy = prof["busy_per_phase"]["update"]  # every op's self time: at least the top ops', and within the phase
    assert busy["events"] >= sum(r["count"] for r in prof["top_ops_per_phase"]["update"])
    assert sum(r["cpu_ms"] for r in prof["top_ops_per_phase"]["update"]) <= busy["cpu_ms"] + 1e-6
    assert busy["cpu_ms"] <= prof["phase_times"]["update"] * 1e3
    assert all(row["count"] >= 1 and row["cpu_ms"] >= 0 for row in prof["top_ops_per_phase"]["update"])
    assert any("mm" in row["name"] or "linear" in row["name"] for row in prof["top_ops_per_phase"]["update"])
    for table, key in (("most_run_ops_per_phase", "count"), ("host_heavy_ops_per_phase", "cpu_ms")):
        rows = prof[table]["update"]  # the same ops ranked by how often they ran / their host time
        assert rows and [r[key] for r in rows] == sorted((r[key] for r in rows), reverse=True)
    assert max(r["count"] for r in prof["most_run_ops_per_phase"]["update"]) >= max(
        r["count"] for r in prof["top_ops_per_phase"]["update"])
    assert busy["compiled_frames"] == 0  # nothing is torch.compiled on CPU
    assert {"prefix_recompute", "prefix_backward"} <= set(d["modes"]["rollplex"]["phase_parts_s"]["update"])
    assert not {"prefix_recompute", "prefix_backward"} & set(d["modes"]["serial"]["phase_parts_s"]["update"])
    md = tiny_bench.with_suffix(".md").read_text()  # outside benchmarks/results: a page of its own, named after it
    assert not (tiny_bench.parent / "BENCHMARKS.md").exists()
    assert "## tiny" in md and "| serial |" in md and "serial/rollplex" in md
    assert "| rollplex[mode.window=after] |" in md
    assert d["overrides"] == ["train.steps=4", "memory.plan=phase"]  # the steps are every run's: not named
    assert "Run with the suite changed: `memory.plan=phase`." in md
    for label, m in d["modes"].items():  # the plan each mode ran under, and what it released (phase: every class)
        assert m["memory"]["plan"] == "phase" and m["memory"]["released"], (label, m["memory"])
        planned = m["planned"]  # the run's memory_plan.json beside the measured peaks (none on CPU: no ratio)
        assert sorted(planned["released"]) == m["memory"]["released"]
        assert planned["peak_gib"] == max(planned["phase_gib"].values())
        assert set(planned["phase_gib"]) <= set(m["phase_median_s"]) | {"ref_logp", "old_logp", "setup"}
        assert planned["auto_choices"] == {**NO_DEVICE_SIZES, "budget_gib": None}  # CPU: the fixed sizes
        assert planned["planned_over_measured"] == {p: planned["phase_gib"][p] / g for p, g in
                                                     m["phase_peak_gib"].items() if g and p in planned["phase_gib"]}
    assert f"rollplex: phase, {', '.join(d['modes']['rollplex']['memory']['released'])} released" in md
    assert "- rollplex, update " in md and "backward by difference" in md and "not in a part" in md


def test_markdown_lists_the_modes_at_their_defaults_first(tiny_bench, tmp_path):
    """Each table of BENCHMARKS.md lists the modes at their defaults first, whatever order they ran in, old labels
    with variants among those with overrides; a `|` in an override's value does not split the table's row."""
    d = json.loads(tiny_bench.read_text())
    m = d["modes"]
    d["modes"] = {"rollplex[mode.window=after]": m["rollplex[mode.window=after]"], "rollplex:keep": m["rollplex"],
                  "serial[data.x='a|b']": m["serial"], "rollplex": m["rollplex"], "serial": m["serial"]}
    (tmp_path / "bench_tiny.json").write_text(json.dumps(d))
    rows = [ln.split(" | ")[0] for ln in bench_markdown.render_markdown(tmp_path).splitlines()
            if ln.startswith("| ")][1:]
    assert rows == ["| rollplex", "| serial", "| rollplex[mode.window=after]", "| rollplex:keep",
                    "| serial[data.x='a\\|b']"]


def test_bench_refuses_to_overwrite_and_to_merge_another_machine(tiny_bench, tmp_path):
    """Both refusals come before any benchmark runs; their two commands are started together."""
    before = tiny_bench.read_bytes()
    other = json.loads(before)
    other["machine"]["host"] = "elsewhere"
    (tmp_path / "other.json").write_text(json.dumps(other))
    cmds = [["--warmup", "1", "--modes", "serial", "--out", str(tiny_bench)],
            ["--warmup", "1", "--modes", "serial", "--merge", str(tmp_path / "other.json"), "--out",
             str(tmp_path / "m.json")]]
    procs = [subprocess.Popen([sys.executable, "-m", "rollplex_megatron", "bench", "tiny", *c], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for c in cmds]
    (_, overwrite), (_, merge) = [p.communicate(timeout=900) for p in procs]
    assert procs[0].returncode == 1 and "--merge" in overwrite and tiny_bench.read_bytes() == before
    assert procs[1].returncode == 1 and "machine" in merge and not (tmp_path / "m.json").exists()


def test_bench_arguments_are_checked_before_any_mode_runs(tiny_bench, tmp_path, capsys):
    """Bad arguments are one line naming them, before a mode runs; BENCHMARKS.md is never rewritten from nothing."""
    from rollplex_megatron.cli import main

    (tmp_path / "bad.json").write_text("{")
    (tmp_path / "list.json").write_text("[1, 2]")
    for folder in ("notes", "odd"):
        (tmp_path / folder).mkdir()
    (tmp_path / "notes" / "results.md").write_text("MY NOTES\n")  # a page bench did not write: never replaced
    (tmp_path / "odd" / "bench_old.json").write_text('{"a": 1}')  # beside --out, so the page would render it
    cases = [(["bench", "tiny", "--warmup", "-1"], "--warmup must be >= 0, got -1"),
             (["bench", "tiny", "--timeout", "-5"], "--timeout must be > 0 seconds, got -5.0"),
             (["bench", "tiny", "--warmup", "1", "--modes", "serial,serial"], "'serial' is given twice"),
             (["bench", "tiny", "--warmup", "3"], "train.steps=5 leaves fewer than 3 steady steps after --warmup 3; "
                                                  "raise train.steps to 6 or lower --warmup"),
             # the suite's own steps fit the default --warmup: the refusal is the merge file's, made after that check
             (["bench", "tiny", "--merge", str(tmp_path / "none.json")], "none.json does not exist"),
             (["bench", "tiny", "--warmup", "1", "--merge", str(tmp_path / "bad.json")], "bad.json: malformed JSON"),
             (["bench", "tiny", "--warmup", "1", "--merge", str(tmp_path / "list.json")], "is not a suite JSON"),
             (["bench", "tiny", "--warmup", "1", "--merge", str(tmp_path / "notes")],
              "notes is a folder; name a suite"),
             # a dry run says yes only to what the run would take
             (["bench", "tiny", "--warmup", "1", "--dry-run", "--merge", str(tmp_path / "bad.json")],
              "bad.json: malformed JSON"),
             (["bench", "tiny", "--warmup", "2", "train.steps=5", "--merge", str(tiny_bench), "--out",
               str(tiny_bench)], "its modes kept --warmup 1 steps apart, this run 2"),
             (["bench", "tiny", "--warmup", "1", "--modes", "serial", "train.steps=4", "memory.plan=phase", "--merge",
               str(tiny_bench), "--out", str(tiny_bench)],
              "already holds serial; drop it from --modes, or write a new JSON with --out"),
             (["bench", "tiny", "--warmup", "1", "--md", str(tmp_path / "no" / "x.md"), "--out",
               str(tmp_path / "x.json")], "x.md: folder"),
             (["bench", "tiny", "--warmup", "1", "--modes", "serial", "--out",
               str(tmp_path / "notes" / "results.json")], "results.md exists and bench did not write it"),
             (["bench", "tiny", "--warmup", "1", "--modes", "serial", "--out",
               str(tmp_path / "odd" / "bench_tiny.json")], "bench_old.json is not a bench suite JSON (no suite"),
             (["bench", "--render", "--md", str(tmp_path / "notes" / "results.md")], "bench did not write it"),
             (["bench", "--render", "tiny"], "bench --render only regenerates BENCHMARKS.md"),
             (["bench", "nosuch"], "bench: no suite 'nosuch'; name a suite, one of ["),
             (["bench", "tiny", "--modes", "serial,rollplex:after"],
              'run --modes "serial,rollplex[mode.window=after]"'),
             # every mode's config composes before the first runs: the unknown key and the mode are named
             (["bench", "tiny", "--warmup", "1", "--modes", "serial,rollplex[mode.windw=after]", "--out",
               str(tmp_path / "x.json")], "--modes rollplex[mode.windw=after]: unknown config key 'mode.windw'; did "
                                          "you mean mode.window?"),
             (["bench", "tiny", "--warmup", "1", "--modes", "serial,prefix_shared[workload.micro_batch_tokens=-3]",
               "--out", str(tmp_path / "x.json")], "--modes prefix_shared[workload.micro_batch_tokens=-3]: "
                                                   "workload.micro_batch_tokens")]
    for argv, want in cases:
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert want in err and err.startswith("error: ") and err.count("\n") == 1, (argv, err)
    assert not (tmp_path / "x.json").exists() and (tmp_path / "notes" / "results.md").read_text() == "MY NOTES\n"
    assert not (tmp_path / "notes" / "results.json").exists() and not (tmp_path / "odd" / "bench_tiny.json").exists()
    # a suite JSON named otherwise than bench_*.json is on the page written beside it
    named = tmp_path / "notes" / "results.json"
    named.write_bytes(tiny_bench.read_bytes())
    assert f"`{named.name}`" in bench_markdown.render_markdown(named.parent, (named,))
    assert f"`{named.name}`" not in bench_markdown.render_markdown(named.parent)
    empty = tmp_path / "results"
    empty.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench, "RESULTS", empty)
        with pytest.raises(ValueError, match="no bench_\\*.json under"):
            bench.main(["--render", "--md", str(tmp_path / "B.md")])
    assert not (tmp_path / "B.md").exists()


def test_modes_parse_with_overrides_split_at_top_level_commas():
    """A mode is its name, at its defaults, or its name with Hydra overrides in brackets; overrides split at
    top-level commas only (a value keeps commas in brackets or quotes); labels are written one way; every malformed
    entry is a one-line error naming it."""
    assert bench_modes.parse_modes("serial, prefix_shared ,rollplex,"
                                   "rollplex[ mode.window=after , memory.plan=keep ]") == [
        ("serial", ["mode.name=serial"]), ("prefix_shared", ["mode.name=prefix_shared"]),
        ("rollplex", ["mode.name=rollplex"]),
        ("rollplex[mode.window=after,memory.plan=keep]", ["mode.name=rollplex", "mode.window=after",
                                                          "memory.plan=keep"])]
    got = bench_modes.parse_modes("rollplex[data.train_files=[a,b],mode.window='x,y'],serial[train.norm_kernel=torch]")
    assert got == [("rollplex[data.train_files=[a,b],mode.window='x,y']",
                    ["mode.name=rollplex", "data.train_files=[a,b]", "mode.window='x,y'"]),
                   ("serial[train.norm_kernel=torch]", ["mode.name=serial", "train.norm_kernel=torch"])]
    assert bench_modes.split_top("a={k: [1, 2]},b='it\\'s, x',c=(1,2)") == ["a={k: [1, 2]}", "b='it\\'s, x'", "c=(1,2)"]
    assert bench_modes.parse_modes("rollplex[]") == [("rollplex", ["mode.name=rollplex"])]  # no override: the defaults
    assert bench_modes.parse_modes("serial[env:CUDA_DEVICE_MAX_CONNECTIONS=1]") == [
        ("serial[env:CUDA_DEVICE_MAX_CONNECTIONS=1]", ["mode.name=serial", "env:CUDA_DEVICE_MAX_CONNECTIONS=1"])]
    for bad, want in (("rollplex[mode.window=after", "leaves a bracket open"),
                      ("rollplex[a='x]", "leaves a quote open"),
                      ("rollplex[a=1]]", "closes a bracket it never opened"),
                      ("rollplex[a=1][b=2]", "'rollplex[a=1][b=2]' closes a bracket it never opened"),
                      ("rollplex[a=1]x", "a mode's overrides end its entry"),
                      ("rollplex[a=1,,b=2]", "holds an empty override"),
                      ("rollplex[mode.window]", "'mode.window' is not an override; write key=value"),
                      ("rollplex[a=1,a=2]", "gives a twice; give it once"),
                      ("rollplex[mode.name=serial]", "mode.name names the mode, which is the name before the brackets"),
                      ("rollplex[mode=serial]", "mode names the mode"),
                      ("rollplex[train.steps=3]", "train.steps is the suite's: give it after the suite name"),
                      ("rollplex[train.out=x]", "train.out is set by bench for every mode; drop it"),
                      ("rollplex[env:LD_PRELOAD=x]", "env:LD_PRELOAD is not a variable a mode's record keeps"),
                      ("serial,serial[]", "'serial' is given twice"),
                      ("rollplx[a=1]", "unknown mode 'rollplx'"), ("disaggregated", "bench it on its own"),
                      (" , ", "no mode given")):
        with pytest.raises(ValueError) as e:
            bench_modes.parse_modes(bad)
        assert want in str(e.value) and "\n" not in str(e.value), (bad, str(e.value))
    lens = drawn_lengths(256, 0.8, 1024, 20000, seed=3)
    assert lens == drawn_lengths(256, 0.8, 1024, 20000, seed=3) and max(lens) == 1024 and min(lens) >= 1
    assert abs(sum(drawn_lengths(256, 0.8, 10**9, 20000, seed=3)) / 20000 - 256) < 8


def test_old_variant_labels_are_read_in_records_and_refused_with_their_new_form():
    """Older records' labels (`rollplex:tokens8192+pack16640+after`) read as the overrides their variants set; a
    command that gives one is refused, in one line, with the whole --modes value that runs the same now."""
    assert bench_modes.label_spec("rollplex:tokens4096+pack8320+split+keepdecode+memauto+graphs+after") == (
        "rollplex", ("workload.micro_batch_tokens=4096", "workload.prefix_pack_tokens=8320",
                     "mode.attention_backend=split", "rollout.keep_decode_state=true", "memory.plan=auto",
                     "mode.window_graphs=true", "mode.window=after"))
    assert bench_modes.label_spec("serial:bound") == ("serial", ("rollout.bound_model=true",))
    assert bench_modes.label_spec("serial:conn1+keep") == ("serial", ("env:CUDA_DEVICE_MAX_CONNECTIONS=1",
                                                                 "memory.plan=keep"))
    assert bench_modes.label_spec("rollplex[mode.window=after]") == ("rollplex", ("mode.window=after",))
    assert bench_modes.label_spec("prefix_shared") == ("prefix_shared", ())
    with pytest.raises(ValueError) as e:
        bench_modes.parse_modes("serial,rollplex:tokens8192+pack16640+split+keepdecode+memauto,prefix_shared:conn1")
    assert str(e.value) == (
        "--modes: 'rollplex:tokens8192+pack16640+split+keepdecode+memauto' is a variant label, which bench no longer "
        "takes: a mode carries Hydra overrides in brackets; run --modes \"serial,rollplex[workload.micro_batch_tokens="
        "8192,workload.prefix_pack_tokens=16640,mode.attention_backend=split,rollout.keep_decode_state=true,"
        "memory.plan=auto],prefix_shared[env:CUDA_DEVICE_MAX_CONNECTIONS=1]\"")
    fixed = re.search(r'--modes "(.+)"', str(e.value)).group(1)
    assert [label for label, _ in bench_modes.parse_modes(fixed)][1] == bench_modes.mode_label(*bench_modes.label_spec(
        "rollplex:tokens8192+pack16640+split+keepdecode+memauto"))  # the new form parses to the same overrides
    for bad, want in (("serial:nosuchvariant", "bench takes no variants after ':' (and 'nosuchvariant' was none)"),
                      ("rollplex:tokens0", "'tokens0' was none"), ("rollplex:pack8k", "'pack8k' was none"),
                      ("rollplex:after[a=1]", "give every setting in the brackets: \"rollplex[key=value,...]\"")):
        with pytest.raises(ValueError, match=re.escape(want)):
            bench_modes.parse_modes(bad)


def test_every_suite_composes_and_is_named_on_the_benchmarks_page():
    """Each recipes/bench suite composes with bench's modes (--dry-run: nothing runs, nothing is written) and is
    named in docs/benchmarks/index.md's list of suites."""
    page = (bench.ROOT / "docs" / "benchmarks" / "index.md").read_text(encoding="utf-8")
    suites = sorted(p.stem for p in (bench.RECIPES_DIR / "bench").glob("*.yaml"))
    assert {"tiny", "video_long", "video_reasoning", "image_short", "video_embodied"} <= set(suites)
    listed = page.split("Suites (`recipes/bench/`):")[1].split("\n\n")[0]
    assert [s for s in suites if s != "tiny" and f"`{s}`" not in listed] == []


def test_video_embodied_is_the_papers_regime_and_composes_every_mode(capsys):
    """video_embodied: 3B, 16 frames of 448x448, G=8, responses lognormal mean 32 capped at 128, so a prompt's
    prefix (2064 tokens) is over 8 times the mean response tokens of its whole group; every mode and the window's
    `after` compose before anything runs."""
    from rollplex_megatron.cli import main

    cfg = bench.load_run_config(["+bench=video_embodied"])
    assert (cfg.model.num_layers, cfg.model.hidden_size) == (36, 2048)  # the 3B preset, whole
    assert (cfg.task.frames, cfg.task.image_size, cfg.rollout.group_size) == (16, 448, 8)
    assert (cfg.rollout.length_dist, cfg.rollout.length_mean, cfg.rollout.max_response_len) == ("lognormal", 32, 128)
    assert cfg.task.max_answer_tokens == 128 and cfg.train.reference == "always"
    env = MotionEnv(cfg.task, cfg.model)
    prompt = env.prompt(env.episode(0))
    assert len(prompt.input_ids) == 2064 and prompt.video_grid_thw.tolist() == [[8, 32, 32]]
    assert len(prompt.input_ids) > 8 * cfg.rollout.group_size * cfg.rollout.length_mean
    modes = "serial,prefix_shared,rollplex,rollplex[mode.window=after]"
    assert main(["bench", "video_embodied", "--dry-run", "--modes", modes]) == 0
    out = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    assert [ln.split(": ", 1)[0] for ln in out] == modes.split(",")
    assert out[-1].endswith("python -m rollplex_megatron train +bench=video_embodied mode.name=rollplex "
                            "mode.window=after")
    assert not (bench.RESULTS / "bench_video_embodied.json").exists()


def test_markdown_says_which_suites_fit_no_device(tmp_path):
    """A planner JSON with a refused mode becomes its own section with the planner's figures; one whose modes
    all fit adds nothing."""
    row = {"mode": "serial", "norm_kernel": "torch", "budget_gib": 134.0, "keep_peak_gib": 195.7,
           "phase_peak_gib": 169.9}
    env = {"commit": "abc1234"}
    (tmp_path / "plan_auto_a.json").write_text(json.dumps({"what": "7B", "command": "c", "environment": env, "rows": [
        dict(row, fits=False, refusal="needs 169.9 GiB in phase 'optimizer'"),
        dict(row, mode="rollplex", fits=True, released=[], peak_gib=80.0)]}))
    (tmp_path / "plan_auto_b.json").write_text(json.dumps({"what": "3B", "command": "c", "environment": env,
                                                           "rows": [dict(row, fits=True, released=[], peak_gib=1.0,
                                                                                keep_peak_gib=1.0)]}))
    md = bench_markdown.render_markdown(tmp_path)
    assert "## Does not fit: 7B" in md and "| serial | torch | 134 | 169.9 | 195.7 | needs 169.9 GiB" in md
    assert "| rollplex |" not in md and "3B" not in md
    assert "rollplex (torch norm) needs 195.7 GiB under keep, 80.0 GiB under auto (releases nothing)" in md


def test_auto_plan_is_compared_with_keep_and_a_changed_suite_is_named():
    """`X+memauto / X+keep` for every pair of the same other variants (what memory.plan=auto costs), and the
    settings a run changed from the suite's recipe, from the JSON or, in older JSONs, its command line."""
    med = {"rollplex:tokens8+keep": 2.0, "rollplex:tokens8+memauto": 2.02, "rollplex:memauto": 3.0,
           "prefix_shared:keep": 4.0, "prefix_shared:memauto": 4.4}
    r = bench_record.ratios({k: {"steady": {"median_s": v}} for k, v in med.items()})
    assert r["rollplex:tokens8+memauto/rollplex:tokens8+keep"] == pytest.approx(1.01)
    assert r["prefix_shared:memauto/prefix_shared:keep"] == pytest.approx(1.1)
    assert not any(k.startswith("rollplex:memauto/") for k in r)  # no rollplex:keep ran
    new = {"serial": 9.0, "serial[rollout.bound_model=true]": 9.9, "rollplex": 3.0,
           "rollplex[memory.plan=auto,workload.micro_batch_tokens=8]": 2.2,
           "rollplex[workload.micro_batch_tokens=8,memory.plan=keep]": 2.0,
           "rollplex[memory.plan=auto,rollout.bound_model=true]": 3.3}  # the pairs are found whatever the order
    r = bench_record.ratios({k: {"steady": {"median_s": v}} for k, v in new.items()})
    assert r["serial[rollout.bound_model=true]/serial"] == pytest.approx(1.1)
    assert r["rollplex[memory.plan=auto,workload.micro_batch_tokens=8]/rollplex[workload.micro_batch_tokens=8,"
             "memory.plan=keep]"] == pytest.approx(1.1)
    assert r["serial/rollplex"] == pytest.approx(3.0) and r["rollplex[memory.plan=auto,workload.micro_batch_tokens=8]"
                                                            "/rollplex"] == pytest.approx(2.2 / 3.0)
    assert not any(k.startswith("rollplex[memory.plan=auto,rollout.bound_model=true]/rollplex[") for k in r)
    old = {"command": "python -m rollplex_megatron bench video_long --modes rollplex --warmup 1 train.steps=4 "
                      "model.num_layers=24"}
    assert bench_markdown.suite_overrides(old) == ["train.steps=4", "model.num_layers=24"]
    assert bench_markdown.suite_overrides({**old, "overrides": ["workload.rollout_batch=24"]}) == [
        "workload.rollout_batch=24"]


def test_window_cost_compares_with_the_prefix_shared_run_of_the_same_settings():
    """A rollplex variant's rollout is compared with the prefix_shared mode that has the same variants but the
    window (rollplex:tokens8+pack9+stream with prefix_shared:pack9+tokens8, not plain prefix_shared); none is
    claimed where no such mode ran."""
    def mode(rollout, window, step):
        return {"phase_median_s": {"rollout": rollout}, "window": {"mechanism": "interleave"} if window else None,
                "steady": {"median_s": step}}

    modes = {"prefix_shared": mode(5.0, False, 20.0), "prefix_shared:pack9+tokens8": mode(3.0, False, 12.0),
             "rollplex": mode(6.5, True, 17.5), "rollplex:tokens8+pack9+stream": mode(4.0, True, 11.0),
             "rollplex:keep": mode(7.0, True, 15.0)}
    bench_record.window_cost(modes)
    assert modes["rollplex"]["window"]["rollout_excess_s"] == pytest.approx(1.5)
    assert modes["rollplex"]["window"]["rollout_excess_vs"] == "prefix_shared"
    assert modes["rollplex"]["window"]["free_window_ratio"] == pytest.approx(20.0 / 16.0)  # 17.5 s less 1.5 s
    w = modes["rollplex:tokens8+pack9+stream"]["window"]
    assert (w["rollout_excess_s"], w["rollout_excess_vs"]) == (pytest.approx(1.0), "prefix_shared:pack9+tokens8")
    assert w["free_window_ratio"] == pytest.approx(12.0 / 10.0)
    assert "rollout_excess_s" not in modes["rollplex:keep"]["window"]
    assert "window_ratio" not in modes["rollplex"]["window"]  # no GPU spans of the side work: no ratio claimed
    modes = {"prefix_shared": mode(5.0, False, 20.0),  # the same, labelled with overrides in any order
             "prefix_shared[workload.prefix_pack_tokens=9,workload.micro_batch_tokens=8]": mode(3.0, False, 12.0),
             "rollplex[workload.micro_batch_tokens=8,mode.window=stream,workload.prefix_pack_tokens=9]":
                 mode(4.0, True, 11.0), "rollplex[mode.window=after]": mode(6.0, True, 18.0)}
    bench_record.window_cost(modes)
    w = modes["rollplex[workload.micro_batch_tokens=8,mode.window=stream,workload.prefix_pack_tokens=9]"]["window"]
    assert (w["rollout_excess_s"], w["rollout_excess_vs"]) == (
        pytest.approx(1.0), "prefix_shared[workload.prefix_pack_tokens=9,workload.micro_batch_tokens=8]")
    assert modes["rollplex[mode.window=after]"]["window"]["rollout_excess_vs"] == "prefix_shared"


def test_window_ratio_and_its_bound_come_from_the_side_works_gpu_time_alone():
    """(rollout alone + side work alone) / together, and the most an overlap can give, (R + S) / max(R, S); S is
    the side work's GPU time in a run of the same settings where it had the GPU alone (interleave or after), not
    its time stretched beside decode; side work run after decode gives 1; no such run, no ratio."""
    def mode(rollout, step, mech=None, inside=0.0, after=0.0):
        w = None if mech is None else {"mechanism": mech, "side_work_in_window_gpu_s": inside,
                                       "side_work_after_gpu_s": after}
        return {"phase_median_s": {"rollout": rollout}, "window": w, "steady": {"median_s": step}}

    modes = {"prefix_shared": mode(6.0, 14.0), "rollplex:stream": mode(6.25, 12.0, "stream", 1.5, 0.0),
             "rollplex:after": mode(6.75, 12.75, "after", 0.0, 0.75),
             "rollplex:tokens8+green": mode(4.5, 9.0, "green", 3.0, 1.0), "prefix_shared:tokens8": mode(1.0, 10.0),
             "rollplex:tokens8+interleave": mode(5.0, 9.5, "interleave", 4.0), "prefix_shared:pack9": mode(2.0, 9.0),
             "rollplex:pack9+stream": mode(2.5, 8.0, "stream", 1.0)}
    bench_record.window_cost(modes)
    w = modes["rollplex:stream"]["window"]  # S = 0.75 from the after run, not the stretched 1.5
    assert w["window_ratio"] == pytest.approx(6.75 / 6.25) and w["window_ratio_bound"] == pytest.approx(6.75 / 6.0)
    w = modes["rollplex:after"]["window"]
    assert w["window_ratio"] == pytest.approx(1.0) and w["window_ratio_bound"] == pytest.approx(6.75 / 6.0)
    w = modes["rollplex:tokens8+green"]["window"]  # side work longer than the rollout: the bound is over it
    assert w["window_ratio"] == pytest.approx(5.0 / 4.5) and w["window_ratio_bound"] == pytest.approx(5.0 / 4.0)
    assert "window_ratio" not in modes["rollplex:pack9+stream"]["window"]  # no run had its side work alone


def test_graphed_items_are_compared_with_the_decode_without_them_and_their_own_side_work():
    """rollplex:graphs changes only the side items: its rollout is compared with the prefix_shared mode without
    it (prefix_shared has no graphs variant), and S is the graphed items' time alone (rollplex:graphs+after), not
    the eager items'."""
    def mode(rollout, step, mech=None, inside=0.0, after=0.0):
        w = None if mech is None else {"mechanism": mech, "side_work_in_window_gpu_s": inside,
                                       "side_work_after_gpu_s": after}
        return {"phase_median_s": {"rollout": rollout}, "window": w, "steady": {"median_s": step}}

    modes = {"prefix_shared:keepdecode": mode(6.0, 14.0),
             "rollplex:keepdecode+after": mode(7.0, 13.0, "after", 0.0, 1.0),
             "rollplex:keepdecode+graphs+after": mode(6.6, 12.6, "after", 0.0, 0.6),
             "rollplex:keepdecode+graphs+stream": mode(6.2, 12.2, "stream", 0.9, 0.0)}
    bench_record.window_cost(modes)
    w = modes["rollplex:keepdecode+graphs+stream"]["window"]
    assert w["rollout_excess_vs"] == "prefix_shared:keepdecode" and w["rollout_excess_s"] == pytest.approx(0.2)
    assert w["window_ratio"] == pytest.approx(6.6 / 6.2)  # S = 0.6 (graphed, alone), not 1.0 (eager)
    modes = {"prefix_shared": mode(6.0, 14.0), "rollplex[mode.window=after]": mode(7.0, 13.0, "after", 0.0, 1.0),
             "rollplex[mode.window=after,mode.window_graphs=true]": mode(6.6, 12.6, "after", 0.0, 0.6),
             "rollplex[mode.window_graphs=true]": mode(6.2, 12.2, "stream", 0.9, 0.0)}  # the default mechanism
    bench_record.window_cost(modes)
    w = modes["rollplex[mode.window_graphs=true]"]["window"]
    assert w["rollout_excess_vs"] == "prefix_shared" and w["window_ratio"] == pytest.approx(6.6 / 6.2)


def test_a_mode_can_set_its_process_environment(monkeypatch, tmp_path):
    """`MODE[env:CUDA_DEVICE_MAX_CONNECTIONS=1]` reaches the mode's process as that variable (read when CUDA starts),
    not as a config override; the other modes get the launcher's environment; the rendered table says what each ran
    under."""
    import subprocess

    seen = []

    def fake_run(cmd, **kw):
        seen.append((cmd, kw["env"]))
        rec = {"step": 1, "mode": "rollplex", "reward_mean": 0.0, "phase_times": {}, "peak_mem_bytes": 0,
               "step_time_s": 1.0}
        (tmp_path / "metrics.jsonl").write_text(json.dumps(rec) + "\n")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(bench_run.subprocess, "run", fake_run)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    for label, over in bench_modes.parse_modes("rollplex[env:CUDA_DEVICE_MAX_CONNECTIONS=1],rollplex"):
        bench_run.run_mode("tiny", [], over, tmp_path, None)
    (one, env1), (plain, env0) = seen
    assert env1["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and "CUDA_DEVICE_MAX_CONNECTIONS" not in env0
    assert not any(a.startswith("env:") for a in one + plain) and "mode.name=rollplex" in one
    assert bench_modes.split_env(["a=1", "env:X=y=z"]) == (["a=1"], {"X": "y=z"})
    unset = {"CUDA_DEVICE_MAX_CONNECTIONS": None, "PYTORCH_CUDA_ALLOC_CONF": None}
    d = {"modes": {"rollplex:conn1": {"cuda_env": {**unset, "CUDA_DEVICE_MAX_CONNECTIONS": "1"}},
                   "rollplex": {"cuda_env": unset}}}
    assert bench_markdown.cuda_env_line(d) == ("CUDA environment: CUDA_DEVICE_MAX_CONNECTIONS=1 (rollplex:conn1); "
                                      "none set (rollplex).")
    assert "not recorded" in bench_markdown.cuda_env_line({"modes": {"serial": {}}})


def test_a_mode_runs_from_the_callers_folder_and_a_timeout_is_one_line(tmp_path, monkeypatch):
    """A mode's process starts in the caller's folder (a relative path in the overrides means what it means to
    `train`), with this checkout first on PYTHONPATH; a mode past --timeout is a one-line BenchModeError naming it."""
    seen = {}

    def fake_run(cmd, **kw):
        seen.update(kw, cmd=cmd)
        raise subprocess.TimeoutExpired(cmd, kw["timeout"])

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench_run.subprocess, "run", fake_run)
    with pytest.raises(bench_run.BenchModeError, match=r"^bench: mode\.name=rollplex ran past --timeout 7 s and was "
                                                   r"stopped; raise --timeout or run fewer steps \(train\.steps\)$"):
        bench_run.run_mode("tiny", ["train.init_hf=ex/model"], ["mode.name=rollplex"], tmp_path / "o", 7.0)
    assert seen.get("cwd") in (None, str(tmp_path)) and "train.init_hf=ex/model" in seen["cmd"]
    assert seen["env"]["PYTHONPATH"].split(os.pathsep)[0] == str(bench_run.ROOT)


def test_prefix_graph_counters_are_summarised_when_on():
    """mode.window_graphs' per-step counters reach the mode's window record as medians of the steady steps (the
    capture of step 1 stays with the warm-up steps); without the setting there is no such record."""
    assert bench_record.prefix_graph_summary([{"items_in_window": 4}, {"items_in_window": 4}]) is None
    steps = [{"prefix_graphs_captured": 0, "prefix_graph_replays": r, "prefix_graph_eager": 0,
              "prefix_graph_capture_s": 0.0, "prefix_graph_pool_gib": 0.5} for r in (16, 15, 16)]
    got = bench_record.prefix_graph_summary(steps)
    assert got == {"prefix_graphs_captured": 0, "prefix_graph_replays": 16, "prefix_graph_eager": 0,
                   "prefix_graph_capture_s": 0.0, "prefix_graph_pool_gib": 0.5}
    steps[1]["prefix_graph_error"] = "capture failed: RuntimeError: x"
    assert bench_record.prefix_graph_summary(steps)["error"] == "capture failed: RuntimeError: x"
