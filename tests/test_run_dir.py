"""Runs a user can trust: run directories, locks, resume, records, preemption, export, bad input.

Each test drives the `train` / `convert` / `verify-hf` commands as a user does (subprocesses), and
checks what the run directory holds afterwards, byte for byte where nothing may change.
"""
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rollplex_megatron.checkpoint import convert
from rollplex_megatron.models.qwen25vl import hf as H
from rollplex_megatron.models.registry import open_hf
from rollplex_megatron.checkpoint import run_dir as R
from rollplex_megatron.checkpoint import train_state as T
from rollplex_megatron.dist import LocalRunError, run_local
from rollplex_megatron.recipes import RECIPES_DIR, load_run_config
from rollplex_megatron.report import read_metrics
from tests import launch_workers

SMALL = ["workload.rollout_batch=8", "workload.responses_per_micro_batch=4", "rollout.group_size=4",
         "train.progress=false"]


def _cmd(*args, timeout=600, env=None):
    return subprocess.run([sys.executable, "-m", "rollplex_megatron", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _train(*args, **kw):
    return _cmd("train", *SMALL, *args, **kw)


def _cmds(*arglists, timeout=600):
    """Several commands that read but do not write the same files, started together (each is its own fresh
    process, as `_cmd` runs it); their completed processes in order."""
    procs = [subprocess.Popen([sys.executable, "-m", "rollplex_megatron", *a], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for a in arglists]
    out = []
    for a, p in zip(arglists, procs):
        stdout, stderr = p.communicate(timeout=timeout)
        out.append(subprocess.CompletedProcess([sys.executable, "-m", "rollplex_megatron", *a], p.returncode,
                                               stdout, stderr))
    return out


def _popen_train(*args):
    return subprocess.Popen([sys.executable, "-m", "rollplex_megatron", "train", *SMALL, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _snapshot(d: Path) -> dict:
    """Every file under `d` with its content hash (a refused start must change nothing)."""
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


def _steps(run: Path) -> list[int]:
    return [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def _wait_for_steps(run: Path, n: int, proc, timeout=300) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if (run / "metrics.jsonl").exists() and len(_steps(run)) >= n:
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    raise AssertionError(f"no {n} steps within {timeout} s")


def _one_line_error(p, *needles):
    assert p.returncode != 0
    err = [ln for ln in p.stderr.splitlines() if ln.startswith("error: ")]
    assert len(err) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    for n in needles:
        assert n in err[0], err[0]
    return err[0]


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory):
    """One 2-step default run (checkpoints at steps 1 and 2): its directory, which the reuse test goes on
    with, its launcher's completed process, and an untouched copy taken right after it for the export test."""
    root = tmp_path_factory.mktemp("two_step")
    out = root / "run"
    p = _train("train.steps=2", "train.save_every=1", f"train.out={out}")
    assert p.returncode == 0, p.stderr[-3000:]
    shutil.copytree(out, root / "pristine")
    return out, p, root / "pristine"


def test_run_directory_reuse_resume_settings_and_records(two_step_run, tmp_path):
    """A reused train.out is refused without resume; a resume refuses changed settings and steps at
    or below the checkpoint; a resume after a crash cuts the log back to the checkpoint, removes what
    interrupted saves left, and reports over the whole run. Refusals change nothing on disk."""
    out, p, _ = two_step_run
    assert p.stdout.strip().splitlines()[-1] == str(out)
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rec = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    need = {"step", "reward_mean", "loss", "step_time_s", "phase_times", "peak_mem_bytes"}
    assert need <= set(rec) and {"rollout", "update", "optimizer"} <= set(rec["phase_times"])
    assert "kl" not in rec and "ref_logp" not in rec["phase_times"]  # kl_coef 0: no reference (train.reference)
    before = _snapshot(out)
    # the refusals fail before any lock or process (check_start reads the directory only): started together
    reused, changed, done, empty = _cmds(["train", *SMALL, "train.steps=2", f"train.out={out}"],
                                         ["train", *SMALL, "train.steps=3", "train.resume=true", "optim.lr=0.5",
                                          f"train.out={out}"],
                                         ["train", *SMALL, "train.steps=2", "train.resume=true", f"train.out={out}"],
                                         ["train", *SMALL, "train.steps=3", "train.resume=true",
                                          f"train.out={tmp_path / 'none'}"])
    _one_line_error(reused, "already holds a run", "train.resume=true", "new train.out")
    _one_line_error(changed, "optim.lr is 0.5 here but 0.0005", "set optim.lr=0.0005 (the checkpoint's)")
    _one_line_error(done, "train.steps=2 but step_000002 is at step 2")
    _one_line_error(empty, "has no checkpoint to resume from")
    assert _snapshot(out) == before
    assert not (tmp_path / "none").exists()
    # A crash after step 3 was logged but before its checkpoint, during a save, and mid-log-rewrite:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("\n".join(lines + [lines[-1].replace('"step": 2', '"step": 3')]) + "\n")
    (out / "checkpoints" / "step_000003.tmp-0123").mkdir()
    (out / "checkpoints" / "step_000003.tmp-0123" / "rank00000.pt").write_bytes(b"half")
    (out / ".metrics.jsonl.tmp-99").write_text("partial")
    p = _train("train.steps=4", "train.resume=true", "train.save_every=1", "mode.name=serial", f"train.out={out}")
    assert p.returncode == 0, p.stderr[-3000:]
    assert _steps(out) == [1, 2, 3, 4]  # step 3 trained again, logged once
    assert not list((out / "checkpoints").glob("*.tmp-*")) and not list(out.glob(".*.tmp-*"))
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["modes"]) == ["serial"] and summary["modes"]["serial"]["steps"] == 4  # the whole run
    assert "name: serial" in (out / "config.yaml").read_text()  # what ran is what is recorded
    assert "steps: 4" in (out / "config.yaml").read_text()


def test_a_failed_rank_stops_the_others_even_if_they_ignore_sigterm():
    t0 = time.monotonic()
    with pytest.raises(LocalRunError, match="rank 0 broke"):
        run_local(launch_workers.one_fails_one_ignores_sigterm, 2, grace_s=1.0)
    assert time.monotonic() - t0 < 40  # not the 60 s the stuck rank would wait


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_workers_see_the_launchers_environment_at_each_call(method, monkeypatch):
    """Under the CPU default, a forkserver started at an earlier call forks the workers: each call's
    workers still get the launcher's environment as it is at that call (as spawned ones would), and the
    per-rank thread count."""
    monkeypatch.setenv("ROLLPLEX_START_METHOD", method)
    monkeypatch.delenv("ROLLPLEX_NUM_THREADS", raising=False)
    for value in ("first", "second"):
        monkeypatch.setenv("ROLLPLEX_TEST_VALUE", value)
        got = run_local(launch_workers.environment_and_threads, 2, "ROLLPLEX_TEST_VALUE")
        threads = max(1, (os.cpu_count() or 1) // 2)
        assert got == [(value, "0", threads), (value, "1", threads)]
    monkeypatch.delenv("ROLLPLEX_TEST_VALUE")
    assert run_local(launch_workers.environment_and_threads, 1, "ROLLPLEX_TEST_VALUE")[0][0] is None
    monkeypatch.setenv("ROLLPLEX_START_METHOD", "fork")
    with pytest.raises(ValueError, match="ROLLPLEX_START_METHOD='fork': choose auto, spawn or forkserver"):
        run_local(launch_workers.environment_and_threads, 1, "X")


def test_torchrun_ranks_leave_together_and_close_their_groups():
    """`dist.leave_torchrun` (the end of every successful command under torchrun): no rank returns
    before the last one arrives, and none leaves its process group or megatron's groups to the
    interpreter's exit."""
    late = 1.5
    got = run_local(launch_workers.leave_after_the_last_rank, 2, late)
    assert got[1]["arrived"] - got[0]["arrived"] > late / 2  # rank 1 came late indeed (it slept after a barrier)
    assert got[0]["left"] >= got[1]["arrived"]  # rank 0 waited for it
    assert [(g["dist"], g["megatron"]) for g in got] == [(False, False), (False, False)]


def test_run_dir_edge_cases(tmp_path):
    """A run that stopped before its first checkpoint: neither restart nor resume, one message for
    both; a torn last record is dropped on resume; a reused worker pid does not block the lock."""
    run = tmp_path / "early"
    run.mkdir()
    (run / "config.yaml").write_text("seed: 1\n")
    for resume in (False, True):
        with pytest.raises(R.RunDirError, match="stopped before its first checkpoint.*remove that directory"):
            R.check_start(run, resume, 3, "seed: 1\n")
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')
    assert R.truncate_metrics(run, 1) == 2 and _steps(run) == [1]
    other = subprocess.Popen(["sleep", "30"])
    try:
        start = R._start_time(other.pid)
        info = {"pid": 1, "host": os.uname().nodename, "workers": [other.pid]}
        (run / R.LOCK).write_text(json.dumps({**info, "worker_starts": [start]}))
        with pytest.raises(R.RunDirError, match="still running"):
            R.RunLock(run).acquire()
        (run / R.LOCK).write_text(json.dumps({**info, "worker_starts": [start - 1]}))  # the pid was reused
        R.RunLock(run).acquire().release()
    finally:
        other.kill()
        other.wait()


def test_resume_change_rule_and_its_mutation():
    """Only settings that do not change the computed update may differ on resume."""
    saved = "optim:\n  lr: 0.001\ntrain:\n  steps: 2\nmode:\n  name: rollplex\n"
    assert R.resume_changes(saved, saved.replace("steps: 2", "steps: 9").replace("rollplex", "serial")) == []
    assert R.resume_changes(saved, saved.replace("0.001", "0.5")) == [("optim.lr", 0.001, 0.5)]
    assert R.resume_changes(saved, saved + "seed: 3\n") == [("seed", None, 3)]  # the default seed is 1234
    assert R.resume_changes(saved, saved + "seed: 1234\ndata:\n  source: auto\n") == []  # newer, at default
    assert R.resume_changes(saved, saved + "data:\n  source: other\n") == [("data.source", None, "other")]


def test_lock_refuses_a_second_launcher_and_takes_over_a_stale_one(tmp_path):
    run = tmp_path / "run"
    with R.RunLock(run):
        err = _one_line_error(_train("train.steps=1", f"train.out={run}"), "is in use by pid", str(os.getpid()))
        assert "wait for that run to end" in err
        with pytest.raises(R.RunDirError, match="in use"):
            R.RunLock(run).acquire()
        (run / "config.yaml").write_text("seed: 1\n")  # a live run before its first checkpoint: never "remove it"
        with pytest.raises(R.RunDirError, match=f"is in use by pid {os.getpid()}"):
            R.check_start(run, False, 1, "")
    with pytest.raises(R.RunDirError, match="stopped before its first checkpoint, so"):  # its launcher gone
        R.check_start(run, False, 1, "")
    (run / "checkpoints" / "step_000001").mkdir(parents=True)  # saved, killed before `latest` was written
    with pytest.raises(R.RunDirError, match="step_000001 written but never published as latest"):
        R.check_start(run, True, 2, "")
    shutil.rmtree(run / "checkpoints")
    # A lock left by a dead launcher (no holder): taken over; one whose worker still lives: refused.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (run / R.LOCK).write_text(json.dumps({"pid": int(dead.stdout), "host": os.uname().nodename, "workers": []}))
    R.RunLock(run).acquire().release()
    worker = subprocess.Popen(["sleep", "30"])
    try:
        (run / R.LOCK).write_text(json.dumps({"pid": int(dead.stdout), "host": os.uname().nodename,
                                              "workers": [worker.pid]}))
        with pytest.raises(R.RunDirError, match=f"{worker.pid}.*still running"):
            R.RunLock(run).acquire()
    finally:
        worker.kill()
        worker.wait()
    R.RunLock(run).acquire().release()


def test_kill9_of_the_launcher_stops_its_worker_and_sigterm_checkpoints(tmp_path):
    """kill -9 of the launcher: its worker stops within a second (nothing more is written) and the
    lock is free for a resume. SIGTERM: the step finishes, a checkpoint is written, exit 0, and a
    resume continues from it."""
    run = tmp_path / "killed"
    proc = _popen_train("train.steps=200", "train.save_every=1", f"train.out={run}")
    _wait_for_steps(run, 1, proc)
    workers = json.loads((run / R.LOCK).read_text())["workers"]
    assert len(workers) == 1
    proc.kill()
    proc.wait()
    time.sleep(2.0)
    assert not R._pid_alive(workers[0]) or open(f"/proc/{workers[0]}/stat").read().split()[2] == "Z"
    n = len(_steps(run))
    time.sleep(1.0)
    assert len(_steps(run)) == n  # nobody writes any more
    R.RunLock(run).acquire().release()

    run = tmp_path / "preempted"
    proc = _popen_train("train.steps=200", f"train.out={run}")
    _wait_for_steps(run, 1, proc)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    latest = T.read_meta(T.latest_checkpoint(run))["step"]
    assert 1 <= latest < 200 and _steps(run) == list(range(1, latest + 1))
    assert "train.resume=true" in stdout and stdout.strip().splitlines()[-1] == str(run)
    p = _train(f"train.steps={latest + 1}", "train.resume=true", f"train.out={run}")
    assert p.returncode == 0, p.stderr[-3000:]
    assert _steps(run) == list(range(1, latest + 2))

    # SIGTERM while the workers still import: held until the trainer's handler is in, then honoured
    run = tmp_path / "early_term"
    proc = _popen_train("train.steps=200", f"train.out={run}")
    t0 = time.monotonic()
    while not (run / R.LOCK).exists() or not json.loads((run / R.LOCK).read_text() or "{}").get("workers"):
        assert time.monotonic() - t0 < 120 and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    # the step it stops after depends on when the re-sent signal meets the handler (0.5 s period)
    stop = T.read_meta(T.latest_checkpoint(run))["step"]
    assert 1 <= stop < 20 and _steps(run) == list(range(1, stop + 1))


def test_launched_process_count_must_match_the_layout(tmp_path):
    script = RECIPES_DIR.parent / "scripts" / "train.sh"
    env = {**os.environ, "PYTHON_BIN": sys.executable}
    p = subprocess.run(["bash", str(script), "2", *SMALL, "train.steps=1", f"train.out={tmp_path / 'x'}"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode != 0 and "launched 2 processes but parallel.tp*parallel.pp*parallel.dp = 1*1*1 = 1;" in p.stderr
    assert not (tmp_path / "x" / "metrics.jsonl").exists()


def test_process_count_check_counts_the_rollout_ranks(monkeypatch):
    """mode=disaggregated: the rollout's own ranks are part of the count the launch must match, and said so."""
    from rollplex_megatron.config import ParallelConfig
    from rollplex_megatron.dist import check_world_size

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    p = ParallelConfig(tp=2, rollout_ranks=1)
    with pytest.raises(ValueError, match=r"launched 2 processes but parallel.tp\*parallel.pp\*parallel.dp = 2\*1\*1 "
                                         r"plus parallel.rollout_ranks=1 = 3; launch 3 processes or set parallel.dp "
                                         r"\(or parallel.rollout_ranks\)"):
        check_world_size(p)
    monkeypatch.setenv("WORLD_SIZE", "3")
    check_world_size(p)  # tp*pp*dp + rollout_ranks processes: the layout



@pytest.mark.parametrize("command", ["smoke", "verify-equivalence"])
def test_smoke_and_verify_check_the_process_count_under_torchrun(command, monkeypatch, capsys):
    """Under torchrun, smoke and verify-equivalence run only at their layout's process count (megatron would
    otherwise take dp from the launch, and smoke would gather a world it did not plan)."""
    from rollplex_megatron.cli import main

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main([command, "model=tiny", "parallel.tp=2"]) == 1
    err = capsys.readouterr().err
    assert "launched 4 processes but parallel.tp*parallel.pp*parallel.dp = 2*1*1 = 2" in err, err


@pytest.mark.parametrize("override,match", [
    ("+train.stepz=3", "unknown config key 'train.stepz'.*did you mean train.steps"),
    ("+rollout.tempreature=0.5", "unknown config key 'rollout.tempreature'.*did you mean rollout.temperature"),
    ("+model.vision.foo=1", "unknown config key 'model.vision.foo'"),
    ("+nothing=1", "unknown config key 'nothing'"),
])
def test_added_keys_are_rejected_too(override, match):
    with pytest.raises(ValueError, match=match):
        load_run_config([override])


def test_group_size_one_is_refused_for_grpo():
    cfg = load_run_config(["rollout.group_size=1", "workload.rollout_batch=8"])
    with pytest.raises(ValueError, match="rollout.group_size=1: GRPO's advantage"):
        cfg.check_training()
    load_run_config(["rollout.group_size=2", "workload.rollout_batch=8"]).check_training()


def _hf_copy(src, dst: Path, edit=None) -> Path:
    shutil.copytree(src, dst)
    if edit is not None:
        cfg = json.loads((dst / "config.json").read_text())
        edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_checkpoint_errors_name_model_type_file_and_tensor(tiny_hf, tmp_path):
    llama = _hf_copy(tiny_hf, tmp_path / "llama", lambda c: c.update(model_type="llama",
                                                                        architectures=["LlamaForCausalLM"]))
    with pytest.raises(H.CheckpointError, match=r"model_type 'llama' \(LlamaForCausalLM\) is not supported; "
                                                 r"supported: qwen2_5_vl"):
        H.HFCheckpoint(llama)
    with pytest.raises(H.CheckpointError, match=r"model_type 'llama' \(LlamaForCausalLM\) is not supported; supported: "
                                                 r"qwen2_5_vl \(Qwen2_5_VLForConditionalGeneration\), qwen3_vl "
                                                 r"\(Qwen3VLForConditionalGeneration\)$"):
        open_hf(llama)  # how every command opens a checkpoint: each family's types
    qwen2vl = _hf_copy(tiny_hf, tmp_path / "q2vl", lambda c: c.update(model_type="qwen2_vl"))
    with pytest.raises(H.CheckpointError, match="model_type 'qwen2_vl'"):
        H.HFCheckpoint(qwen2vl)
    trunc = _hf_copy(tiny_hf, tmp_path / "trunc")
    f = next(trunc.glob("*.safetensors"))
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(H.CheckpointError, match=f"{f.name}: not a readable safetensors file.*truncated"):
        H.HFCheckpoint(trunc).model_config()
    cut = _hf_copy(tiny_hf, tmp_path / "cut")
    text = (cut / "config.json").read_text()
    (cut / "config.json").write_text(text[: len(text) // 2])
    with pytest.raises(H.CheckpointError, match=f"{cut / 'config.json'}: not valid JSON .*truncated or damaged"):
        H.HFCheckpoint(cut)
    wide = _hf_copy(tiny_hf, tmp_path / "wide", lambda c: c["text_config"].update(hidden_size=128))
    with pytest.raises(H.CheckpointError, match=r"embed_tokens.weight the shape \(320, 128\), but the tensor "
                                                r"has \(320, 64\)"):
        H.HFCheckpoint(wide).model_config()
    deep = _hf_copy(tiny_hf, tmp_path / "deep", lambda c: c["text_config"].update(num_hidden_layers=6))
    with pytest.raises(H.CheckpointError, match="num_hidden_layers=6 but the weights hold 4"):
        H.HFCheckpoint(deep).model_config()
    H.HFCheckpoint(tiny_hf).model_config()  # the untouched copy loads
    # From the CLI: one line; --debug gives the traceback.
    plain, p = _cmds(["verify-hf", "--hf-dir", str(llama)], ["verify-hf", "--hf-dir", str(llama), "--debug"])
    _one_line_error(plain, "model_type 'llama'")
    assert p.returncode != 0 and "Traceback" in p.stderr and "CheckpointError" in p.stderr


def test_train_to_hf_exports_the_trained_actor_exactly(tiny_hf, tmp_path):
    """A TP=2 run from an HF checkpoint, exported per step: the HF tensors re-sharded at TP=2 equal the
    checkpoint's shards bit for bit; the two steps differ; config, generation config and processor
    files come along; verify-hf passes on the export; a missing step is a clear error."""
    init = _hf_copy(tiny_hf, tmp_path / "init")
    (init / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "Qwen2Tokenizer"}))
    run = tmp_path / "run"
    p = _train("parallel.tp=2", f"train.init_hf={init}", "train.steps=2", "train.save_every=1", f"train.out={run}")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "note: no data.train_files: the run trains the built-in rendered task" in p.stderr  # said, not silent
    exports = {}
    for step, p in zip((1, 2), _cmds(*[["convert", "train-to-hf", "--run", str(run), "--step", str(step), "--out",
                                        str(tmp_path / f"hf{step}")] for step in (1, 2)])):  # two exports at once
        assert p.returncode == 0, p.stderr[-3000:]
        exports[step] = H.HFCheckpoint(tmp_path / f"hf{step}")
    ck = exports[2]
    assert json.loads((ck.path / "config.json").read_text()) == json.loads((init / "config.json").read_text())
    assert (ck.path / "tokenizer_config.json").read_text() == (init / "tokenizer_config.json").read_text()
    assert (ck.path / "generation_config.json").is_file()
    assert json.loads((ck.path / convert.EXPORT_META).read_text())["step"] == 2
    cfg = ck.model_config()
    for step, exp in exports.items():
        ckdir = run / "checkpoints" / T.step_dir_name(step)
        for rank in range(2):
            state = torch.load(ckdir / T.rank_file_name(rank), map_location="cpu", weights_only=False)
            shards = H.shard_checkpoint(exp, cfg, state["ranks"]["tp"], 2, 0, 1)
            assert set(shards) == {n for n in state["model"] if not n.endswith("_extra_state")}  # none left out
            for name, t in shards.items():
                assert torch.equal(t, state["model"][name]), (step, rank, name)
    names = sorted(ck.keys())
    assert any(not torch.equal(exports[1].get(n), exports[2].get(n)) for n in names)  # training moved them
    export = _snapshot(ck.path)
    to_hf = ["convert", "train-to-hf", "--run", str(run)]
    p, missing, exists = _cmds(["verify-hf", "--hf-dir", str(ck.path), "--json"],  # all three only read
                               [*to_hf, "--step", "7", "--out", str(tmp_path / "x")], [*to_hf, "--out", str(ck.path)])
    assert p.returncode == 0 and json.loads(p.stdout.strip().splitlines()[-1])["ok"] is True, p.stderr[-3000:]
    _one_line_error(missing, "no checkpoint at step 7", "step_000001, step_000002")
    _one_line_error(exists, "already exists")
    assert not (tmp_path / "x").exists() and _snapshot(ck.path) == export
    init.rename(tmp_path / "moved")  # the run's train.init_hf gone: no silent export without its files
    _one_line_error(_cmd(*to_hf, "--out", str(tmp_path / "y")), f"train.init_hf={init}", "put it back")
    assert not (tmp_path / "y").exists()


def test_train_to_hf_without_init_builds_config_with_transformers(two_step_run, tmp_path):
    """The embedded default (no HF checkpoint): config.json from transformers' Qwen2_5_VLConfig,
    stop tokens of the task in generation_config.json; it reads back as the run's model (its latest
    checkpoint, which the export takes without --step). The run is the reuse test's first one, as it was
    when it finished."""
    run = two_step_run[2]
    assert T.read_meta(T.latest_checkpoint(run))["step"] == 2
    p = _cmd("convert", "train-to-hf", "--run", str(run), "--out", str(tmp_path / "hf"))
    assert p.returncode == 0, p.stderr[-3000:]
    ck = H.HFCheckpoint(tmp_path / "hf")
    want = load_run_config(["train.steps=1"]).model
    assert convert._same_model(ck.model_config(), want)
    H.validate_checkpoint(ck, ck.model_config())
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert gen["eos_token_id"] and all(t < want.vocab_size for t in gen["eos_token_id"])
    state = torch.load(run / "checkpoints" / "step_000002" / T.rank_file_name(0), weights_only=False)
    back = H.shard_checkpoint(ck, ck.model_config(), 0, 1, 0, 1)
    # Rows past the true vocabulary (Megatron's TP padding) are masked out of every softmax and not
    # exported; from random init they hold random values, so only the real rows can match.
    v = want.vocab_size
    real = lambda n, t: t[:v] if "word_embeddings" in n or "output_layer" in n else t  # noqa: E731
    bad = [n for n, t in back.items() if not torch.equal(real(n, t), real(n, state["model"][n]))]
    assert not bad and len(back) == len([k for k in state["model"] if not k.endswith("_extra_state")]), bad


def test_a_longer_resume_is_refused_where_the_decay_runs_over_train_steps(tmp_path):
    """optim.lr_decay_steps=0 decays over train.steps: a run of 2 steps resumed as one of 3 would keep the 2-step
    decay (megatron's scheduler takes the checkpoint's) while its record said 3, so it is refused naming both ways
    out; with a constant rate the same extension runs. Both resumes give only train.resume, train.out and
    train.steps: the other settings are the saved run's."""
    decaying, constant = tmp_path / "decaying", tmp_path / "constant"
    linear = ["optim.lr_decay_style=linear", "optim.min_lr=1e-4"]
    first = _cmds(["train", *SMALL, *linear, "train.steps=2", f"train.out={decaying}"],
                  ["train", *SMALL, "train.steps=2", f"train.out={constant}"])
    assert [p.returncode for p in first] == [0, 0], first[0].stderr[-2000:]
    before = _snapshot(decaying)
    # the docs' form: a resume names only the run and its new length; the rest is the saved run's config
    longer, extended = _cmds(["train", "train.steps=3", "train.resume=true", f"train.out={decaying}"],
                             ["train", "train.steps=3", "train.resume=true", f"train.out={constant}",
                              "train.progress=false"])
    _one_line_error(longer, "train.steps is 3 here but 2", "optim.lr_decay_steps=0", "optim.lr_decay_steps set")
    assert "resume with train.steps=2" not in longer.stderr  # the 2-step schedule has ended: no way back to it
    assert _snapshot(decaying) == before
    assert extended.returncode == 0, extended.stderr[-2000:]
    assert _steps(constant) == [1, 2, 3]
    rec = json.loads((constant / "metrics.jsonl").read_text().splitlines()[-1])
    assert rec["response_tokens"] <= 8 * 12  # SMALL's 8 responses a step, not the root recipe's 128


def test_schedule_refusal_offers_only_ways_that_exist_and_yields_to_a_changed_style():
    """The longer-resume refusal offers the saved length only where the checkpoint is short of it; a resume that
    changes optim.lr_decay_style is refused for that change, not for train.steps."""
    saved = "train:\n  steps: 10\noptim:\n  lr_decay_style: linear\n  lr_decay_steps: 0\n"
    longer = saved.replace("steps: 10", "steps: 12")
    assert "resume with train.steps=10, or start a new run" in R._schedule_change(saved, longer, 4)
    assert "resume with" not in R._schedule_change(saved, longer, 10)
    constant = "train:\n  steps: 2\noptim:\n  lr_decay_style: constant\n  lr_decay_steps: 0\n"
    cosine = constant.replace("constant", "cosine").replace("steps: 2\n", "steps: 3\n", 1)
    changed = R.resume_changes(constant, cosine)
    assert changed and changed[0][0] == "optim.lr_decay_style"  # check_start reports this before the schedule


def test_lr_schedule_resumes_with_the_checkpoint_and_tensorboard_gets_the_scalars(tmp_path):
    """Warm-up + linear decay, two PPO mini-batches and dynamic sampling: a run stopped at step 2 and
    resumed to 4 takes the same learning rates (the scheduler state is in the checkpoint), the same
    prompts (the data stream's position, moved on by the resampling rounds, is in it too) and the same
    weights as an uninterrupted run; the TensorBoard event files hold metrics.jsonl's scalars."""
    sched = ["optim.lr=1e-3", "optim.lr_warmup_steps=2", "optim.lr_decay_style=linear", "optim.lr_decay_steps=4",
             "optim.min_lr=1e-4", "train.tensorboard=true", "train.ppo_mini_batches=2", "train.dynamic_sampling=true",
             "train.max_resample_rounds=2"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert _train(*sched, "train.steps=4", f"train.out={whole}").returncode == 0
    assert _train(*sched, "train.steps=2", f"train.out={part}").returncode == 0
    p = _train(*sched, "train.steps=4", "train.resume=true", f"train.out={part}")
    assert p.returncode == 0, p.stderr[-2000:]
    a, b = read_metrics(whole / R.METRICS), read_metrics(part / R.METRICS)
    assert [r["lr"] for r in a] == pytest.approx([0.0, 5e-4, 1e-3, 1e-4 + (1e-3 - 1e-4) * 0.5])
    assert [r["lr"] for r in b] == [r["lr"] for r in a] and [r["loss"] for r in b] == [r["loss"] for r in a]
    assert all(r["optimizer_steps"] == 2 for r in a)
    rounds = [r["rollout"]["dynamic_sampling"]["rounds_mean"] for r in a]
    assert max(rounds[:2]) > 1, rounds  # the stream moved past one batch per step before the checkpoint
    acc = EventAccumulator(str(whole / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("lr")] == [r["step"] for r in a]
    assert [e.value for e in acc.Scalars("lr")] == pytest.approx([r["lr"] for r in a])
    assert [e.value for e in acc.Scalars("phase_times/update")] == pytest.approx(
        [r["phase_times"]["update"] for r in a])


def test_tensorboard_drops_the_steps_a_resume_trains_again(tmp_path):
    """Steps 1-3 logged, the run interrupted after its step-2 checkpoint, then resumed there: step 3 is trained
    again, and its first logging is dropped from the event files, as metrics.jsonl is cut back (once per step)."""
    from rollplex_megatron.trainer.tracking import Tracker

    for start, steps in ((0, (1, 2, 3)), (2, (3, 4))):
        tracker = Tracker(tmp_path, True, False, {}, "run", start)
        for step in steps:
            tracker.log({"step": step, "lr": 0.1 * step + start})  # the resumed run's values differ
        tracker.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("lr")] == [(1, 0.1), (2, 0.2), (3, 2.3), (4, 2.4)]


def test_a_resume_takes_the_saved_config_and_what_its_command_line_sets(tmp_path):
    """What the resume's command line names wins, even where it is the root recipe's default (`memory.plan=phase`
    over the saved keep; `mode=rollplex`, the default group, over the saved serial: the whole mode.* subtree);
    everything else is the saved run's (its batch, its learning rate)."""
    from rollplex_megatron.recipes import resumed_config, to_yaml

    saved = load_run_config(["mode=serial", "memory.plan=keep", "workload.rollout_batch=8", "rollout.group_size=4",
                             "optim.lr=5e-4", "mode.window=stream"])
    over = ["train.resume=true", f"train.out={tmp_path}", "train.steps=9", "memory.plan=phase", "mode=rollplex"]
    got = resumed_config(load_run_config(over), over, to_yaml(saved))
    assert (got.memory.plan, got.mode.name, got.mode.window) == ("phase", "rollplex", "auto")  # the recipe's
    assert (got.workload.rollout_batch, got.rollout.group_size, got.optim.lr) == (8, 4, 5e-4)
    assert (got.train.steps, got.train.resume) == (9, True)
    bare = resumed_config(load_run_config(over[:3]), over[:3], to_yaml(saved))
    assert (bare.memory.plan, bare.mode.name, bare.mode.window) == ("keep", "serial", "stream")


def test_a_resume_that_empties_a_mapping_applies_it_and_is_refused(tmp_path):
    """`reward.fns={}` on a resume's command line is a setting like any other: the resumed config holds the empty
    mapping (not the saved one), so the resume check sees the change and refuses it, naming the saved entry."""
    from rollplex_megatron.checkpoint.run_dir import resume_changes
    from rollplex_megatron.recipes import resumed_config, to_yaml

    saved = load_run_config(["+reward.fns={multiple_choice: 'pkg.mod:first_letter'}"])
    over = ["train.resume=true", f"train.out={tmp_path}", "reward.fns={}"]
    got = resumed_config(load_run_config(over), over, to_yaml(saved))
    assert got.reward.fns == {}
    assert resume_changes(to_yaml(saved), to_yaml(got)) == [
        ("reward.fns.multiple_choice", "pkg.mod:first_letter", None)]
    # not named: the saved mapping would be taken, but it names code, which a run directory may not
    with pytest.raises(ValueError, match=r"train.resume=true: the run's saved config names reward.fns"):
        resumed_config(load_run_config(over[:2]), over[:2], to_yaml(saved))
    again = [*over[:2], "+reward.fns={multiple_choice: 'pkg.mod:first_letter'}"]  # named again by the user
    bare = resumed_config(load_run_config(again), again, to_yaml(saved))
    assert bare.reward.fns == {"multiple_choice": "pkg.mod:first_letter"}
    assert resume_changes(to_yaml(saved), to_yaml(bare)) == []


def test_an_evaluation_of_a_run_takes_its_reading_and_scoring_settings():
    """`eval --run`: the run's reward, response length, validation sampling and data reading where the command line
    names nothing, whatever it names instead (an emptied mapping too); never the run's rows or training settings."""
    from rollplex_megatron.recipes import run_eval_config, to_yaml

    saved = load_run_config(["+reward.fns={multiple_choice: 'pkg.mod:first_letter'}", "reward.format_reward=0.5",
                             "rollout.max_response_len=4", "val.n=4", "data.max_pixels=3136", "optim.lr=1e-4",
                             "data.train_files=[run_rows.parquet]", "rollout.group_size=4",
                             "data.val_files=[run_val.parquet]", "train.val_every=1"])
    over = ["data.val_files=[val.parquet]", "data.train_files=[val.parquet]", "val.n=2"]  # as eval composes it
    # code the run's config names (a dotted-path reward) is imported only when this command line names it too
    with pytest.raises(ValueError, match=r"--run: the run's saved config names reward.fns.multiple_choice="
                                         r"'pkg.mod:first_letter', code to import; .* give \+reward.fns="):
        run_eval_config(load_run_config(over), over, to_yaml(saved))
    over.append("+reward.fns={multiple_choice: 'pkg.mod:first_letter'}")
    got, taken = run_eval_config(load_run_config(over), over, to_yaml(saved))
    assert (got.reward.fns, got.reward.format_reward, got.rollout.max_response_len) == (
        {"multiple_choice": "pkg.mod:first_letter"}, 0.5, 4)
    val = str(Path("val.parquet").resolve())  # data files are recorded absolute
    assert (got.val.n, got.data.max_pixels, got.data.val_files, got.data.train_files) == (2, 3136, [val], [val])
    root = load_run_config([])
    assert (got.optim.lr, got.rollout.group_size) == (root.optim.lr, root.rollout.group_size)
    assert taken == {"reward.format_reward": 0.5, "rollout.max_response_len": 4, "data.max_pixels": 3136}
    mine = ["data.val_files=[val.parquet]", "data.train_files=[val.parquet]", "reward.fns={}", "reward.fn=exact_match"]
    got, _ = run_eval_config(load_run_config(mine), mine, to_yaml(saved))
    assert (got.reward.fns, got.reward.fn, got.reward.format_reward) == ({}, "exact_match", 0.5)


def test_data_paths_are_recorded_absolute(tmp_path, monkeypatch):
    """Relative data files and processor are resolved when the config is built, so config.yaml names the files the
    run read, and a resume started from another folder reads those, not that folder's namesakes."""
    from rollplex_megatron.recipes import to_yaml

    monkeypatch.chdir(tmp_path)
    cfg = load_run_config(["data.train_files=[ex/train.parquet]", "data.val_files=[ex/val.parquet]",
                           "data.processor=ex/model"])
    root = tmp_path.resolve()
    assert cfg.data.train_files == [str(root / "ex" / "train.parquet")]
    assert (cfg.data.val_files, cfg.data.processor) == ([str(root / "ex" / "val.parquet")], str(root / "ex" / "model"))
    assert f"- {root / 'ex' / 'train.parquet'}" in to_yaml(cfg)
    assert load_run_config([]).data.processor == ""  # unset stays unset


def test_a_file_as_train_out_and_a_damaged_checkpoint_are_refused_before_any_work(two_step_run, tmp_path):
    """train.out naming a file, and a resume whose latest checkpoint lost a rank's file: one error naming the
    setting or the missing file and the way out, before any model is built; nothing is changed."""
    plain = tmp_path / "afile"
    plain.write_text("x")
    with pytest.raises(R.RunDirError, match=r"train\.out=.*afile is a file, not a run directory; choose another"):
        R.check_start(plain, False, 2, "seed: 1\n")
    _, _, pristine = two_step_run
    run = tmp_path / "damaged"
    shutil.copytree(pristine, run)
    config = (run / "config.yaml").read_text()
    assert R.check_start(run, True, 3, config) == 2  # intact: resumes at step 2
    (run / "checkpoints" / "step_000002" / "rank00000.pt").unlink()
    before = _snapshot(run)
    with pytest.raises(R.RunDirError, match=r"step_000002 lacks rank00000\.pt of its world size 1 .*restore those "
                                            r"files, or resume from an earlier checkpoint"):
        R.check_start(run, True, 3, config)
    assert _snapshot(run) == before
    # a truncated rank file, and a damaged meta.json: named before any work, and by the exporter
    cut = tmp_path / "cut"
    shutil.copytree(pristine, cut)
    rank = cut / "checkpoints" / "step_000002" / "rank00000.pt"
    rank.write_bytes(rank.read_bytes()[: rank.stat().st_size // 2])
    with pytest.raises(R.RunDirError, match=r"step_000002/rank00000\.pt is not a readable checkpoint file "
                                            r"\(truncated or damaged after it was written\); restore it, or resume"):
        R.check_start(cut, True, 3, config)
    with pytest.raises(H.CheckpointError, match=r"rank00000\.pt: not a readable checkpoint file \(.*\); the file is "
                                                r"truncated or damaged"):
        convert.train_to_hf(cut, tmp_path / "hf_out", step=2)
    assert not (tmp_path / "hf_out").exists()
    # a resume that changes the decay style (and the length) is refused for the style, the change it makes
    longer_cosine = yaml.safe_load(config)
    longer_cosine["optim"]["lr_decay_style"], longer_cosine["train"]["steps"] = "cosine", 3
    cosine = yaml.safe_dump(longer_cosine)
    with pytest.raises(R.RunDirError, match=r"optim.lr_decay_style is 'cosine' here but 'constant'"):
        R.check_start(pristine, True, 3, cosine)
    (cut / "checkpoints" / "step_000002" / "meta.json").write_text("{bad")
    with pytest.raises(H.CheckpointError, match=r"step_000002/meta\.json: not valid JSON"):
        R.check_start(cut, True, 3, config)


def test_a_resume_under_the_phase_plan_equals_the_uninterrupted_run(tmp_path):
    """memory.plan=phase releases the masters, Adam's states, the reference and the grads at start-up; a resume
    brings each group back only while its checkpoint state loads (`MemoryManager.holding`). 1 step + resume + 1
    equals 2 uninterrupted steps bit for bit (model, reference, masters and Adam's states of the last checkpoint).
    Each save writes the released classes from their host copies (`MemoryManager.host_reader`): the phase plan's
    checkpoints equal, bit for bit, those of memory.plan=keep, which holds everything on the device. Mutation: the
    load with nothing brought back writes into released storage and fails."""
    plan = ["memory.plan=phase", "train.reference=always", "train.save_every=1"]
    full, part, keep = tmp_path / "full", tmp_path / "part", tmp_path / "keep"
    a, b, c = _cmds(["train", *SMALL, *plan, "train.steps=2", f"train.out={full}"],
                    ["train", *SMALL, *plan, "train.steps=1", f"train.out={part}"],
                    ["train", *SMALL, *plan, "memory.plan=keep", "train.steps=2", f"train.out={keep}"])
    assert a.returncode == 0 and b.returncode == 0 and c.returncode == 0, (a.stderr[-3000:], b.stderr[-3000:],
                                                                           c.stderr[-3000:])
    p = _train(*plan, "train.steps=2", "train.resume=true", f"train.out={part}")
    assert p.returncode == 0, p.stderr[-3000:]
    states = [T.read_rank_state(T.latest_checkpoint(r) / T.rank_file_name(0)) for r in (full, part)]
    assert states[0]["step"] == states[1]["step"] == 2

    def flat(x, key=""):
        if torch.is_tensor(x):
            return {key: x}
        items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, (list, tuple)) else ()
        return {k: v for i, y in items for k, v in flat(y, f"{key}/{i}").items()}
    kept = T.read_rank_state(T.latest_checkpoint(keep) / T.rank_file_name(0))
    want, got, held = (flat({k: s[k] for k in ("model", "reference", "optimizer")}) for s in (*states, kept))
    assert want.keys() == got.keys() == held.keys() and len(want) > 10
    assert [k for k in want if not torch.equal(want[k], got[k])] == []
    assert [k for k in want if not torch.equal(want[k], held[k])] == []
    # the mutation: the load's classes left released
    from tests import memory_workers

    cfg = load_run_config([*SMALL, *plan, "train.steps=2", "train.resume=true", f"train.out={part}"])
    with pytest.raises(LocalRunError):
        run_local(memory_workers.load_without_holding, 1, cfg)
