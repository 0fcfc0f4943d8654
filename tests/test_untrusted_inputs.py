"""What a run trusts: a checkpoint or a data row never runs code; damaged checkpoint files and data that changed
under a resumed run are named before any work.

A payload is a pickled object whose unpickling runs `touch MARKER`: the marker's absence after a command is
the proof that nothing ran; the mutation (torch's full unpickler) shows the same check catches a run payload.
"""
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from rollplex_megatron.checkpoint import train_state as T
from rollplex_megatron.models.qwen25vl.hf import CheckpointError

SMALL = ["workload.rollout_batch=8", "workload.responses_per_micro_batch=4", "rollout.group_size=4",
         "train.progress=false", "rollout.max_response_len=4"]


class Payload:
    """Unpickling this runs a shell command (what a hostile checkpoint would carry)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _cmd(*args, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "rollplex_megatron", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _cmds(*arglists, timeout=600):
    """Commands started together (they only read the run), their completed processes in order."""
    procs = [subprocess.Popen([sys.executable, "-m", "rollplex_megatron", *a], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for a in arglists]
    return [subprocess.CompletedProcess(a, p.returncode, *p.communicate(timeout=timeout))
            for a, p in zip(arglists, procs)]


def _error_line(p) -> str:
    assert p.returncode != 0, p.stdout[-2000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def data(example_dir, tmp_path_factory) -> dict:
    """A 1-step run on `make-example`'s rows (checkpoint step_000001), reading its own copy of the training file;
    each test works on a copy of the run, and only the last test changes the file."""
    root = tmp_path_factory.mktemp("trusted")
    shutil.copy(example_dir / "train.parquet", root / "train.parquet")
    args = [*SMALL, f"train.init_hf={example_dir / 'model'}", f"data.train_files=[{root / 'train.parquet'}]"]
    p = _cmd("train", *args, "train.steps=1", "train.save_final=true", f"train.out={root / 'run'}")
    assert p.returncode == 0, p.stderr[-3000:]
    return {"run": root / "run", "file": root / "train.parquet", "args": args,
            "val": [f"data.val_files=[{example_dir / 'val.parquet'}]", "val.max_rows=2"]}


def _copy(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest)
    return dest


def _rank0(run: Path, step: int = 1) -> Path:
    return run / T.CHECKPOINTS / T.step_dir_name(step) / T.rank_file_name(0)


def _pickle_bytes(f: Path) -> bytes:
    """The pickle stream of a torch.save file (the globals it names are in it as text)."""
    with zipfile.ZipFile(f) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))


def _plant(run: Path, marker: Path) -> None:
    """Replace the latest checkpoint's rank-0 extra state by the payload (the file stays a valid torch.save)."""
    f = _rank0(run)
    state = torch.load(f, weights_only=True)
    state.pop("extra_json")
    state["extra"] = {"lr_scheduler": Payload(marker)}
    torch.save(state, f)


def test_a_checkpoint_payload_runs_in_no_command(data, tmp_path):
    hostile, marker = _copy(data["run"], tmp_path / "hostile"), tmp_path / "PWNED"
    _plant(hostile, marker)
    procs = _cmds(["convert", "train-to-hf", "--run", str(hostile), "--out", str(tmp_path / "export")],
                  ["eval", "--run", str(hostile), *data["val"]], ["generate", "--run", str(hostile), data["val"][0]])
    procs.append(_cmd("train", *data["args"], "train.steps=2", "train.resume=true", f"train.out={hostile}"))
    for p in procs:
        line = _error_line(p)
        assert "rank00000.pt: refused, it names Python code" in line and "posix.system" in line, (p.args, line)
    assert not marker.exists()
    assert not (tmp_path / "export").exists()


def test_the_payload_check_fails_with_the_full_unpickler(data, tmp_path, monkeypatch):
    """The mutation: torch's full unpickler, as before the safe loader, runs the payload on load."""
    hostile, marker = _copy(data["run"], tmp_path / "hostile"), tmp_path / "PWNED"
    _plant(hostile, marker)
    with pytest.raises(CheckpointError, match="refused"):
        T.read_rank_state(_rank0(hostile))
    assert not marker.exists()
    full = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: full(*a, **{**k, "weights_only": False}))
    T.read_rank_state(_rank0(hostile))
    assert marker.exists()


def test_a_data_row_cannot_name_code_to_import(example_dir, tmp_path):
    """A row's data_source chooses among the built-ins and reward.fns, never imports what it names; the same module
    named on the command line (where code may be named) is imported, which shows the marker would appear."""
    marker = tmp_path / "IMPORTED"
    (tmp_path / "payload_mod.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                             "raise ImportError('the payload module ran')\n")
    table = pq.read_table(example_dir / "train.parquet")
    sources = table.column("data_source").to_pylist()
    rows = table.set_column(table.schema.get_field_index("data_source"), "data_source",
                            [["payload_mod:fn"] * len(sources)])
    pq.write_table(rows, tmp_path / "rows.parquet")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    common = [*SMALL, f"train.init_hf={example_dir / 'model'}", f"train.out={tmp_path / 'run'}"]
    p = _cmd("train", *common, f"data.train_files=[{tmp_path / 'rows.parquet'}]", env=env)
    assert "data_source 'payload_mod:fn' has no reward function" in _error_line(p)
    assert not marker.exists()
    p = _cmd("train", *common, f"data.train_files=[{example_dir / 'train.parquet'}]", "reward.fn=payload_mod:fn",
             env=env)
    assert "cannot import module 'payload_mod'" in _error_line(p) and marker.exists()


def test_damaged_checkpoint_files_name_the_file_and_the_key(data, tmp_path):
    meta_run, rank_run = _copy(data["run"], tmp_path / "meta"), _copy(data["run"], tmp_path / "rank")
    meta = meta_run / T.CHECKPOINTS / "step_000001" / T.META
    meta.write_text(json.dumps({"format": 2, "tp": 1}))
    state = torch.load(_rank0(rank_run), weights_only=True)
    del state["optimizer"]
    torch.save(state, _rank0(rank_run))
    p_meta, p_rank = _cmds(["convert", "train-to-hf", "--run", str(meta_run), "--out", str(tmp_path / "a")],
                           ["convert", "train-to-hf", "--run", str(rank_run), "--out", str(tmp_path / "b")])
    assert f"{meta}: missing key 'step'" in _error_line(p_meta)
    assert f"{_rank0(rank_run)}: missing key 'optimizer'" in _error_line(p_rank)
    p = _cmd("train", *data["args"], "train.steps=2", "train.resume=true", f"train.out={meta_run}")
    assert f"{meta}: missing key 'step'" in _error_line(p)


def test_a_format_1_run_directory_still_resumes(data, tmp_path):
    """Run directories written before format 2 (numpy's RNG state as an ndarray, extra as a dict, no data
    fingerprint) resume through the safe loader, and the resumed run writes format 2."""
    old = _copy(data["run"], tmp_path / "old")
    f = _rank0(old)
    state = torch.load(f, weights_only=True)
    state.pop("format")
    state["extra"] = json.loads(state.pop("extra_json"))
    state["rng"]["numpy"] = T._numpy_state(state["rng"]["numpy"])
    torch.save(state, f)
    assert b"_reconstruct" in _pickle_bytes(f)  # numpy's ndarray, as format 1 held it
    meta_file = f.parent / T.META
    meta = json.loads(meta_file.read_text())
    meta["format"] = 1
    del meta["data"]
    meta_file.write_text(json.dumps(meta))
    p = _cmd("train", *data["args"], "train.steps=2", "train.resume=true", f"train.out={old}")
    assert p.returncode == 0, p.stderr[-3000:]
    new = T.read_meta(old / T.CHECKPOINTS / "step_000002")
    assert new["format"] == T.FORMAT == 2 and new["step"] == 2 and list(new["data"]) == [str(data["file"])]
    assert b"_reconstruct" not in _pickle_bytes(_rank0(old, 2))


def test_changed_data_under_a_resumed_run_is_refused(data, tmp_path):
    """Last in this file: it changes the training file the other tests' run read."""
    run, f = _copy(data["run"], tmp_path / "run"), data["file"]
    saved = T.read_meta(run / T.CHECKPOINTS / "step_000001")["data"]
    assert list(saved) == [str(f)] and saved[str(f)]["rows"] == 24
    resume = [*data["args"], "train.steps=2", "train.resume=true", f"train.out={run}"]
    table = pq.read_table(f)
    pq.write_table(table.slice(0, 3), f)  # 24 rows cut to 3
    line = _error_line(_cmd("train", *resume))
    assert f"data file {f} changed (rows 24 -> 3) since step_000001" in line
    assert "data.accept_changed_files=true" in line
    # the same rows with every ground truth moved to the next letter: same row count, other content
    rm = table.column("reward_model").to_pylist()
    pq.write_table(table.set_column(table.schema.get_field_index("reward_model"), "reward_model",
                                    [[{**r, "ground_truth": "BCDA"["ABCD".index(r["ground_truth"])]} for r in rm]]), f)
    assert f"data file {f} changed" in _error_line(_cmd("train", *resume))
    p = _cmd("train", *resume, "data.accept_changed_files=true")
    assert p.returncode == 0, p.stderr[-3000:]
    now = T.read_meta(run / T.CHECKPOINTS / "step_000002")["data"][str(f)]
    assert now["rows"] == 24 and now["sha256"] != saved[str(f)]["sha256"]
