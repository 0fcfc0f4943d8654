"""Hostile run paths and damaged run directories: a train.out that is no place for a run, a `latest` that is
missing or damaged while a complete checkpoint exists, a link named like a save's leftover, paths Hydra cannot
read unquoted, and every command's `--help`."""
import json
import os
import pwd
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollplex_megatron.checkpoint import run_dir as R
from rollplex_megatron.checkpoint import train_state as T
from rollplex_megatron.cli import COMMANDS, main
from rollplex_megatron.cli.train import _check_kind
from rollplex_megatron.recipes import load_run_config

CONFIG = "seed: 1\n"


def _error(capsys, argv) -> str:
    """The one `error:` line a refused command prints (exit status 1)."""
    assert main(argv) == 1, argv
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


# --- train.out: no filesystem root, home folder, checkout or foreign folder ----------------------------------

def test_train_out_refuses_root_home_checkout_and_a_foreign_folder(tmp_path, monkeypatch, capsys):
    """Each refusal names the folder and why, from the command line, before anything is written."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for out, why in (("/", "is a filesystem root"), (str(home), "is the home folder"),
                     (str(R.CHECKOUT), "is the folder that holds the rollplex_megatron package (its checkout)")):
        err = _error(capsys, ["train", "train.steps=1", f"train.out={out}"])
        assert f"train.out={out} {why}" in err and "a folder of its own" in err, err
    assert sorted(os.listdir(home)) == []  # refused before anything was written
    foreign = tmp_path / "photos"
    foreign.mkdir()
    for name in ("a.jpg", "b.jpg", "c.jpg", "d.jpg"):
        (foreign / name).write_text("x")
    err = _error(capsys, ["train", "train.steps=1", f"train.out={foreign}"])
    assert f"train.out={foreign} is a folder that holds other files (a.jpg, b.jpg, c.jpg and 1 more) and no run " \
           f"of this project" in err and "choose a new or empty folder" in err, err
    assert sorted(os.listdir(foreign)) == ["a.jpg", "b.jpg", "c.jpg", "d.jpg"]


def test_train_out_keeps_empty_missing_and_existing_runs(tmp_path, monkeypatch):
    """A missing or empty folder, a run's own folder (to resume), a --modes comparison's and one under a home folder
    that an earlier version let a run write into: all accepted."""
    home = tmp_path / "home"
    (home / "checkpoints").mkdir(parents=True)  # a run written into the home folder before it was refused
    (home / "config.yaml").write_text(CONFIG)
    monkeypatch.setenv("HOME", str(home))
    run, compared, empty = tmp_path / "run", tmp_path / "compared", tmp_path / "empty"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(CONFIG)
    (compared / "rollplex" / "checkpoints").mkdir(parents=True)
    empty.mkdir()
    for out, modes in ((tmp_path / "new", None), (empty, None), (run, None), (compared, ["rollplex"]),
                       (home / "runs" / "x", None)):
        _check_kind(out, modes)
    locked = tmp_path / "locked"  # a start whose launcher died before the trainer wrote a file
    locked.mkdir()
    (locked / R.LOCK).write_text("{}")
    _check_kind(locked, None)


# --- `latest` missing or damaged while a complete checkpoint exists ---------------------------------------------

def _checkpoint(run: Path, step: int, world: int = 1, ranks: int | None = None) -> Path:
    """A published-looking step directory: meta.json and `ranks` (default `world`) torch files."""
    d = run / T.CHECKPOINTS / T.step_dir_name(step)
    d.mkdir(parents=True)
    (d / T.META).write_text(json.dumps({"format": 1, "step": step, "world_size": world, "tp": 1, "pp": 1,
                                        "dp": world, "config": CONFIG}))
    for r in range(world if ranks is None else ranks):
        torch.save({"step": step}, d / T.rank_file_name(r))
    return d


@pytest.fixture
def two_checkpoints(tmp_path):
    """A run with complete checkpoints at steps 1 and 2, `latest` naming step 2."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(CONFIG)
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    _checkpoint(run, 1)
    _checkpoint(run, 2)
    (run / T.CHECKPOINTS / T.LATEST).write_text("step_000002\n")
    return run


def _publish_advice(err: str) -> str:
    """The shell command a message gives between backquotes."""
    return err.split("`")[1]


def test_a_missing_latest_names_the_complete_checkpoint_and_how_to_publish_it(two_checkpoints, capsys):
    """Deleting `latest` is never answered with "remove that directory": the message names step_000002 and a
    command that publishes it; after running that command the run resumes from step 2."""
    run = two_checkpoints
    pointer = run / T.CHECKPOINTS / T.LATEST
    pointer.unlink()
    for resume in (True, False):
        with pytest.raises(R.RunDirError, match=r"latest is missing, but step_000002 holds a complete checkpoint "
                                                r"\(step 2: meta.json and its 1 rank file\(s\)\); publish it with `"
                                                r"echo step_000002 > .*latest`") as e:
            R.check_start(run, resume, 3, CONFIG)
        assert "remove" not in str(e.value)
    err = _error(capsys, ["train", *"train.resume=true train.steps=3".split(), f"train.out={run}"])
    assert "step_000002 holds a complete checkpoint" in err and "remove" not in err, err
    assert not pointer.exists()  # a refused start changes nothing
    subprocess.run(["sh", "-c", _publish_advice(err)], check=True)
    assert R.check_start(run, True, 3, CONFIG) == 2


@pytest.mark.parametrize("text,damage", [
    (b"hello\x00\xff\n", "latest holds 'hello\\\\x00\ufffd', not a checkpoint's directory name"),
    (b"../../../etc\n", r"latest holds '../../../etc', not a checkpoint's directory name"),
    (b"step_000005\n", r"latest points at step_000005, which has no meta.json"),
    (b"step_000003\n", r"latest points at step_000003, which has no meta.json"),  # a step without its meta.json
])
def test_a_damaged_latest_names_the_newest_complete_checkpoint(two_checkpoints, text, damage):
    run = two_checkpoints
    (run / T.CHECKPOINTS / "step_000003").mkdir()
    (run / T.CHECKPOINTS / "step_000003" / T.rank_file_name(0)).write_bytes(b"half")
    (run / T.CHECKPOINTS / T.LATEST).write_bytes(text)
    with pytest.raises(R.RunDirError, match=damage + r".*, but step_000002 holds a complete checkpoint") as e:
        R.check_start(run, True, 3, CONFIG)
    assert "remove" not in str(e.value)
    subprocess.run(["sh", "-c", _publish_advice(str(e.value))], check=True)
    assert R.check_start(run, True, 3, CONFIG) == 2


def test_complete_means_meta_and_every_rank_file_of_its_world_size(two_checkpoints):
    """A step lacking one of its world size's rank files, or with a damaged one, is not offered; the newest
    complete one is, also when `latest` names an incomplete step; with none complete, no advice to remove."""
    run = two_checkpoints
    _checkpoint(run, 3, world=2, ranks=1)  # rank00001.pt missing
    d4 = _checkpoint(run, 4)
    (d4 / T.rank_file_name(0)).write_bytes(b"truncated")
    assert [p.name for p in R.complete_steps(run)] == ["step_000002", "step_000001"]
    (run / T.CHECKPOINTS / T.LATEST).unlink()
    with pytest.raises(R.RunDirError, match="but step_000002 holds a complete checkpoint"):
        R.check_start(run, True, 5, CONFIG)
    (run / T.CHECKPOINTS / T.LATEST).write_text("step_000003\n")  # latest names the incomplete step
    with pytest.raises(R.RunDirError, match=r"step_000003 lacks rank00001.pt of its world size 2 .*restore those "
                                            r"files, or resume from an earlier checkpoint: step_000002 is the newest "
                                            r"complete one \(publish it with `echo step_000002 > "):
        R.check_start(run, True, 5, CONFIG)
    for step in (1, 2):
        (run / T.CHECKPOINTS / T.step_dir_name(step) / T.rank_file_name(0)).unlink()
    (run / T.CHECKPOINTS / T.LATEST).unlink()
    with pytest.raises(R.RunDirError, match="checkpoints are incomplete") as e:
        R.check_start(run, True, 5, CONFIG)
    assert "remove" not in str(e.value)


# --- a link named like an interrupted save's leftover ------------------------------------------------------------

def test_cleaning_removes_a_link_named_like_a_leftover_and_keeps_its_target(two_checkpoints, tmp_path, capsys):
    run = two_checkpoints
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious.txt").write_text("keep")
    (tmp_path / "precious.jsonl").write_text("keep")
    (run / T.CHECKPOINTS / "step_000003.tmp-x").symlink_to(elsewhere, target_is_directory=True)
    (run / ".metrics.jsonl.tmp-1").symlink_to(tmp_path / "precious.jsonl")
    (run / T.CHECKPOINTS / "step_000004.tmp-y").mkdir()  # a real leftover: removed as before
    with R.RunLock(run) as lock:
        removed = R.clean_interrupted(run, lock)
    assert sorted(removed) == [".metrics.jsonl.tmp-1", "step_000003.tmp-x", "step_000004.tmp-y"]
    assert (elsewhere / "precious.txt").read_text() == "keep" and (tmp_path / "precious.jsonl").read_text() == "keep"
    assert not any(".tmp-" in p.name for p in [*(run / T.CHECKPOINTS).iterdir(), *run.iterdir()])
    notes = capsys.readouterr().err.splitlines()
    assert len(notes) == 2 and all(n.startswith("note: removed the link ") and "is kept" in n for n in notes), notes
    assert f"its target {elsewhere} is kept" in "\n".join(notes)


# --- paths Hydra cannot read unquoted; `~` and `~user` ---------------------------------------------------------

@pytest.mark.parametrize("argv,quoted,value", [
    (["train.out=runs/my", "run"], "\"train.out='runs/my run'\"", "runs/my run"),  # the shell split it
    (["train.out=runs/my", "big", "run", "train.steps=2"], "\"train.out='runs/my big run'\"", "runs/my big run"),
    (["train.out=~/my", "run"], "\"train.out='~/my run'\"", "HOME/my run"),
    (["train.out=runs/🚀"], "\"train.out='runs/🚀'\"", "runs/🚀"),
    (["train.out=~/runs/x"], "\"train.out='~/runs/x'\"", "HOME/runs/x"),
])
def test_a_value_hydra_cannot_read_gets_the_quoting_that_works(argv, quoted, value, tmp_path, monkeypatch, capsys):
    """One line with the setting quoted as a shell user types it; the quoted form, as the shell hands it on, reads
    the value meant (`~` expanded)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    err = _error(capsys, ["print-config", *argv])
    split = len([w for w in argv if not w.startswith("train.steps")])
    want = f"the shell split this setting at its spaces into {split} words; quote it whole: {quoted}" if split > 1 \
        else f"Hydra cannot read this value unquoted (it holds a space, `~`, an emoji or another character outside " \
             f"Hydra's plain values); quote it: {quoted}"
    assert want in err and "Lexer" not in err and "EQUAL" not in err, err
    (given,) = shlex.split(quoted)  # what the shell passes on
    assert load_run_config([given]).train.out == value.replace("HOME", str(tmp_path))
    if split == 1:
        return
    err = _error(capsys, ["print-config", "train.out='runs/x'", "stray"])  # no value of a setting to join it to
    assert err.startswith("error: stray: not a setting; settings are key=value"), err


def test_home_folders_are_expanded_in_run_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_run_config(["train.out='~/runs/x'", "run_dir='~/runs'"])
    assert (cfg.train.out, cfg.run_dir) == (str(tmp_path / "runs" / "x"), str(tmp_path / "runs"))
    user = pwd.getpwuid(os.getuid())
    assert load_run_config([f"train.out='~{user.pw_name}/x'"]).train.out == str(Path(user.pw_dir) / "x")
    with pytest.raises(ValueError, match=r"train.out=~no_such_user_zq/x: no user 'no_such_user_zq' on this machine "
                                         r"to expand ~no_such_user_zq to; write the folder out in full"):
        load_run_config(["train.out='~no_such_user_zq/x'"])


# --- every command's --help -------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [[c] for c in COMMANDS] + [["convert", d] for d in
                                                            ("hf-to-mcore", "mcore-to-hf", "train-to-hf")])
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_every_command_prints_its_usage_and_exits_0(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        main([*argv, flag])
    assert e.value.code == 0
    out = capsys.readouterr()
    assert out.out.startswith(f"usage: rollplex {' '.join(argv)}") and not out.err, out


def test_help_of_an_overrides_command_as_a_user_runs_it():
    p = subprocess.run([sys.executable, "-m", "rollplex_megatron", "smoke", "--help"], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.startswith("usage: rollplex smoke [hydra overrides]"), p.stderr[-2000:]
