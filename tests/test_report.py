"""Run reports: metrics.jsonl parsing, summary numbers against hand-computed values, the PNG and the CLI."""
import json

import matplotlib.image
import pytest

from rollplex_megatron import report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _records(mode: str, steps: int) -> list[dict]:
    """Synthetic GRPO metrics: reward 0.1*i, warm-up step 1 of 100 s, ref_logp only on even steps."""
    out = []
    for i in range(1, steps + 1):
        phases = {"rollout": 1.0, "update": 0.5 * i}
        if i % 2 == 0:
            phases["ref_logp"] = 0.4
        if mode == "rollplex":
            phases["weight_refresh"] = 0.25
        out.append({"step": i, "mode": mode, "reward_mean": 0.1 * i, "kl": 0.01 * i, "loss": 1.0 / i,
                    "entropy": 2.0, "step_time_s": 100.0 if i == 1 else 2.0 + 0.1 * i,
                    "phase_times": phases, "peak_mem_bytes": 2**30 * (3 if i == 4 else 1)})
    return out


def _write_run(run_dir, records):
    run_dir.mkdir(parents=True)
    # Shuffled line order: readers and summaries must order by `step`, not by file position.
    lines = [json.dumps(r) for r in records[1::2] + records[::2]]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


def _assert_png(path):
    with open(path, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] > 0 and img.shape[1] > 0


def test_summarize_matches_hand_computed():
    s = report.summarize(list(reversed(_records("serial", 10))))
    assert s["steps"] == 10
    assert s["reward_first"] == pytest.approx(0.1) and s["reward_last"] == pytest.approx(1.0)
    assert s["reward_first20"] == pytest.approx(0.15)   # steps 1, 2
    assert s["reward_last20"] == pytest.approx(0.95)    # steps 9, 10
    assert s["step_time_s"] == pytest.approx(2.6)       # mean of 2.2..3.0, step 1 (100 s) left out
    assert s["phase_times"] == pytest.approx({"rollout": 1.0, "update": 3.0, "ref_logp": 2.0 / 9})
    assert s["peak_mem_bytes"] == 3 * 2**30


def test_summarize_short_runs():
    three = report.summarize(_records("serial", 3))
    assert three["reward_first20"] == pytest.approx(0.1) and three["reward_last20"] == pytest.approx(0.3)
    assert three["step_time_s"] == pytest.approx(2.25)
    one = report.summarize(_records("serial", 1))
    assert one["step_time_s"] == 100.0 and one["phase_times"] == {"rollout": 1.0, "update": 0.5}


def test_plot_runs_writes_valid_png(tmp_path):
    runs = {"serial": _records("serial", 10), "rollplex": _records("rollplex", 10)}
    out = tmp_path / "plots" / "r.png"
    out.parent.mkdir()
    assert report.plot_runs(runs, str(out), chance=0.25) == str(out)
    _assert_png(out)
    assert [p.name for p in out.parent.iterdir()] == ["r.png"]   # no temp file left behind
    assert report.phase_names(runs) == ["rollout", "update", "ref_logp", "weight_refresh"]


def test_read_metrics_names_malformed_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    good = json.dumps(_records("serial", 1)[0])
    path.write_text(f"{good}\n\n{good[:-5]}\n")
    with pytest.raises(ValueError, match=r"metrics\.jsonl:3: malformed JSON"):
        report.read_metrics(path)
    path.write_text(f"{good}\n[1, 2]\n")
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: expected a JSON object"):
        report.read_metrics(path)
    path.write_text(json.dumps({"step": 1}) + "\n")
    with pytest.raises(ValueError, match=r"metrics\.jsonl:1: record lacks mode"):
        report.read_metrics(path)


def test_cli_labels_table_and_png(tmp_path, capsys):
    a = _write_run(tmp_path / "run_a", _records("serial", 10))
    b = _write_run(tmp_path / "run_b", _records("rollplex", 5))
    c = _write_run(tmp_path / "run_c", _records("rollplex", 5))
    assert len(report.read_metrics(a / "metrics.jsonl")) == 10
    assert report.main([str(a), str(b), str(c), "--chance", "0.5"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == str(a / "report.png")
    _assert_png(lines[-1])
    assert [ln.split()[0] for ln in lines[1:4]] == ["serial", "rollplex", "rollplex"]
    assert "[run_c]" in lines[3] and "weight_refresh_s" in lines[0]


def test_cli_missing_metrics_exits_with_path(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        report.main([str(tmp_path / "nope")])
    assert exc.value.code == 2
    assert "nope/metrics.jsonl" in capsys.readouterr().err
