"""User code that never returns, and stopping a run: `reward.timeout_s`, SIGTERM / Ctrl-C while a reward function
is stuck, Ctrl-C at a step boundary, the launcher's own interruption, plain progress lines without a terminal,
and the report's KL panel without a reference model.

The CLI tests drive `train` as a user does (a subprocess, in a session of its own so that a "Ctrl-C" reaches its
whole process group as a terminal's would) on a small dataset scored by a user function that hangs from a chosen
call on (its worker counts the calls: one step is 8 responses).
"""
import faulthandler
import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from matplotlib.figure import Figure

from rollplex_megatron import report, user_code
from rollplex_megatron.checkpoint import train_state as T
from rollplex_megatron.data.dataset import DatasetSource
from rollplex_megatron.data.example import make_example
from rollplex_megatron.data.rewards import RewardRegistry
from rollplex_megatron.dist import LocalRunError, run_local
from rollplex_megatron.recipes import load_run_config
from rollplex_megatron.trainer import loop

STEP = 8  # responses per step (workload.rollout_batch below)
SMALL = [f"workload.rollout_batch={STEP}", "workload.responses_per_micro_batch=4", "rollout.group_size=4",
         "rollout.max_response_len=4"]


@pytest.fixture
def watchdog():
    """Ends this pytest process, with every thread's stack, should a test hang (a reward without a limit would);
    C-level, so it fires even while a thread holds the GIL."""
    faulthandler.dump_traceback_later(60, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def slow_module(tmp_path, monkeypatch):
    """A user reward module on sys.path: `hang` sleeps, `c_loop` spins in C holding the GIL, `fast` returns."""
    (tmp_path / "slow_rewards.py").write_text(textwrap.dedent("""
        import os
        import time

        def hang(response, ground_truth, extra_info):
            time.sleep(3600)

        def c_loop(response, ground_truth, extra_info):
            return float(sum(range(10**14)))  # one C call: SIGALRM's handler could only run after it

        def fast(response, ground_truth, extra_info):
            return {"score": 1.0, "pid": os.getpid()}
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "slow_rewards"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited
        return f.read().split()[2] != "Z"


# --- reward.timeout_s and the stop signal, on the registry ---------------------------------------------------------
@pytest.mark.parametrize("fn", ["hang", "c_loop"])
def test_a_reward_that_never_returns_is_stopped_at_reward_timeout_s(slow_module, watchdog, fn):
    reg = RewardRegistry(fns={"geo": f"{slow_module}:{fn}", "ok": f"{slow_module}:fast"}, timeout_s=1)
    first = int(reg.score("x", "y", {}, "ok", "r0").extra["pid"])  # the worker is up: the limit times the call alone
    t0 = time.monotonic()
    with pytest.raises(user_code.UserCodeTimeout, match=(
            rf"^train\.parquet row 17: reward function {slow_module}:{fn} \(data_source 'geo'\) did not return "
            r"within reward\.timeout_s=1 s and was stopped; make it return sooner, or raise reward\.timeout_s "
            r"\(0: no limit\)$")):
        reg.score("x", "y", {}, "geo", "train.parquet row 17")
    assert 1 <= time.monotonic() - t0 < 5
    assert not _pid_alive(first)  # the worker running it was killed
    assert reg.score("x", "y", {}, "ok", "r1").score == 1.0  # a fresh worker scores the next response


def test_a_stop_signal_abandons_a_stuck_reward_and_lets_quick_ones_finish(slow_module, watchdog, monkeypatch):
    monkeypatch.setattr(user_code, "STOP_GRACE_S", 1.0)
    reg = RewardRegistry(fns={"geo": f"{slow_module}:hang", "ok": f"{slow_module}:fast"}, timeout_s=0)
    try:
        user_code.ask_stop()
        assert reg.score("x", "y", {}, "ok", "r0").score == 1.0  # a call that returns within the grace counts
        t0 = time.monotonic()
        with pytest.raises(user_code.UserCodeStopped, match=r"^d\.jsonl row 2: reward function slow_rewards:hang "
                                                            r"\(data_source 'geo'\) was still running 1 s after the "
                                                            r"stop signal; the step was abandoned"):
            reg.score("x", "y", {}, "geo", "d.jsonl row 2")
        assert time.monotonic() - t0 < 4
    finally:
        user_code.clear_stop()


def test_reward_timeout_s_is_checked_and_reaches_the_registry(hang_env):
    with pytest.raises(ValueError, match=r"^reward\.timeout_s must be a finite number of seconds >= 0 \(0: no limit\), "
                                         r"got -1$"):
        RewardRegistry(timeout_s=-1)
    assert load_run_config([]).reward.timeout_s == 60.0
    ex = hang_env[1]
    data = [f"train.init_hf={ex / 'model'}", f"data.train_files=[{ex / 'train.parquet'}]"]
    assert DatasetSource(load_run_config(data)).rewards.timeout_s == 60.0
    assert DatasetSource(load_run_config([*data, "reward.timeout_s=7.5"])).rewards.timeout_s == 7.5


# --- the launcher: the first failure in time, an interrupted wait ---------------------------------------------------
def rank1_fails_first() -> None:
    """Rank 1 fails at once; rank 0 fails 2 s later (as a rank whose collective lost its peer would)."""
    if os.environ["RANK"] == "1":
        raise RuntimeError("rank 1 broke first")
    time.sleep(2)
    raise RuntimeError("rank 0 lost its peer")


def sleeps() -> None:
    """A rank that would run a minute."""
    time.sleep(60)


def test_the_launcher_reports_the_rank_that_failed_first():
    with pytest.raises(LocalRunError, match="rank 1 broke first") as e:
        run_local(rank1_fails_first, 2)
    assert e.value.summary == "rank 1: RuntimeError: rank 1 broke first"


def test_an_interrupted_launcher_stops_its_workers_before_it_returns():
    """A KeyboardInterrupt in the launcher's wait: the workers are gone when it propagates (they would otherwise
    go on, and fail writing their results into the launcher's removed temporary folder)."""
    pids = []

    def started(p):
        pids.extend(p)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_local(sleeps, 2, on_start=started, defer_sigterm=True)
    assert pids and not any(_pid_alive(p) for p in pids)


# --- progress lines and the report ----------------------------------------------------------------------------------
class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_bar_is_drawn_only_on_a_terminal(monkeypatch):
    cfg = load_run_config([])
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert loop._progress(cfg, 0, True) is None  # a log file: plain step lines
    monkeypatch.setattr(sys, "stdout", _Terminal())
    assert loop._progress(cfg, 0, True) is None  # tqdm draws on stderr, still a file
    monkeypatch.setattr(sys, "stderr", _Terminal())
    bar = loop._progress(cfg, 0, True)
    assert bar is not None
    bar.close()


def _records(kl: bool) -> list[dict]:
    """Three steps' records, with `kl` (a run with a reference model) or without."""
    return [{"step": i, "mode": "serial", "reward_mean": 0.1 * i, "accuracy": 0.5, "loss": 1.0, "entropy": 2.0,
             "step_time_s": 1.0, "phase_times": {"rollout": 1.0}, "peak_mem_bytes": 1}
            | ({"kl": 0.01 * i} if kl else {}) for i in range(1, 4)]


def test_the_kl_panel_says_when_there_is_no_reference_model(tmp_path):
    texts = {}
    for kl in (False, True):
        ax = Figure().subplots()
        report._plot_kl(ax, {"serial": _records(kl)})
        texts[kl] = ([t.get_text() for t in ax.texts], len(ax.lines))
    assert texts[False] == (["no reference model: KL not computed"], 0)
    assert texts[True] == ([], 1)
    assert report.plot_runs({"serial": _records(False)}, str(tmp_path / "r.png")) == str(tmp_path / "r.png")


# --- the train command --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hang_env(tmp_path_factory):
    """A small dataset, and a user module whose `score_until` hangs from call HANG_AFTER + 1 on (each call before
    it is answered at once); the environment that puts the module on the path."""
    root = tmp_path_factory.mktemp("hang")
    ex = make_example(root / "ex", load_run_config([]).model, train_rows=8, val_rows=1)
    (root / "hang_rewards.py").write_text(textwrap.dedent("""
        import os
        import time

        CALLS = [0]

        def score_until(response, ground_truth, extra_info):
            CALLS[0] += 1
            if CALLS[0] > int(os.environ["HANG_AFTER"]):
                with open(os.environ["HANG_MARK"], "w") as f:  # this worker is stuck now
                    f.write(str(os.getpid()))
                time.sleep(3600)
            return float(response.strip() == str(ground_truth))
    """))
    return root, ex


@pytest.fixture
def started():
    """The train commands a test starts; each one's process group is killed when the test ends (a failing test
    leaves none running)."""
    procs = []
    yield procs
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()


def _start(hang_env, started, out: Path, hang_after: int, *extra) -> subprocess.Popen:
    root, ex = hang_env
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
           "HANG_AFTER": str(hang_after), "HANG_MARK": str(out) + ".stuck"}
    args = ["train", *SMALL, f"train.init_hf={ex / 'model'}", f"data.train_files=[{ex / 'train.parquet'}]",
            "reward.fn=hang_rewards:score_until", f"train.out={out}", *extra]
    started.append(subprocess.Popen([sys.executable, "-m", "rollplex_megatron", *args], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=env, start_new_session=True))
    return started[-1]


def _wait_stuck(proc: subprocess.Popen, out: Path, timeout: float = 400) -> int:
    """The pid of the reward worker once it is stuck."""
    mark, t0 = Path(str(out) + ".stuck"), time.monotonic()
    while not (mark.exists() and mark.read_text()):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() - t0 < timeout, "the reward never got stuck"
        time.sleep(0.2)
    return int(mark.read_text())


def _checkpoint_steps(out: Path) -> list[int]:
    """The steps of the checkpoints on disk, each checked complete (meta.json and a rank file); nothing
    half-written may be left beside them."""
    root = out / T.CHECKPOINTS
    names = sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) if root.is_dir() else []
    assert all(re.fullmatch(r"step_\d+", n) for n in names), names  # no step_N.tmp-... of an unfinished save
    for n in names:
        assert (root / n / T.META).is_file() and any((root / n).glob("*rank*")), n
    return [T.read_meta(root / n)["step"] for n in names]


def _metric_steps(out: Path) -> list[int]:
    return [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def _one_stop_line(stderr: str, *needles: str) -> str:
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [ln for ln in stderr.splitlines() if ln.startswith("stopped by ")]
    assert len(lines) == 1, stderr[-3000:]
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def test_sigterm_stops_a_run_stuck_in_a_reward_within_seconds_and_saves_no_half_step(hang_env, started, tmp_path):
    """Step 1 is scored and saved; step 2's first reward call never returns (reward.timeout_s=0: no limit). SIGTERM:
    the rank abandons the call STOP_GRACE_S later, the run exits with one line naming the checkpoint of step 1 and
    the resume command, and nothing of step 2 is written. Without a terminal the log has plain step lines."""
    out = tmp_path / "run"
    proc = _start(hang_env, started, out, STEP, "train.steps=3", "train.save_every=1", "reward.timeout_s=0")
    worker = _wait_stuck(proc, out)
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert time.monotonic() - t0 < user_code.STOP_GRACE_S + 25
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    _one_stop_line(stderr, "stopped by SIGTERM inside a step", "hang_rewards:score_until", "was still running",
                   "the last checkpoint is step 1", f"continue with train.resume=true train.out={out}")
    assert _checkpoint_steps(out) == [1] and _metric_steps(out) == [1]
    assert not _pid_alive(worker)
    assert "\r" not in stdout + stderr and re.search(r"^step +1 reward ", stdout, re.M), stdout


def test_ctrl_c_twice_while_a_reward_is_stuck_stops_at_once(hang_env, started, tmp_path):
    out = tmp_path / "run"
    proc = _start(hang_env, started, out, STEP, "train.steps=3", "train.save_every=1", "reward.timeout_s=0",
                  "train.progress=false")
    _wait_stuck(proc, out)
    os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole foreground group
    time.sleep(1.0)
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 15
    assert proc.returncode == 130, stderr[-3000:]
    assert "Ctrl-C: stopping after this step with a checkpoint; Ctrl-C again stops now" in stderr
    _one_stop_line(stderr, "stopped by SIGINT inside a step (the workers were killed by a second Ctrl-C)",
                   "the last checkpoint is step 1", f"train.resume=true train.out={out}")
    assert _checkpoint_steps(out) == [1]


def test_ctrl_c_stops_at_the_step_boundary_with_a_checkpoint(hang_env, started, tmp_path):
    out = tmp_path / "run"
    proc = _start(hang_env, started, out, 10**6, "train.steps=50", "train.progress=false")
    t0 = time.monotonic()
    while not ((out / "metrics.jsonl").exists() and _metric_steps(out)):
        assert proc.poll() is None and time.monotonic() - t0 < 400, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    stop = _checkpoint_steps(out)
    assert len(stop) == 1 and _metric_steps(out) == list(range(1, stop[0] + 1))
    assert f"stopped by SIGINT after step {stop[0]}: checkpoint written; continue with train.resume=true " \
           f"train.out={out}" in stdout


def test_a_reward_past_reward_timeout_s_stops_the_run_with_one_line(hang_env, started, tmp_path):
    out = tmp_path / "run"
    proc = _start(hang_env, started, out, 0, "train.steps=1", "reward.timeout_s=1", "train.progress=false")
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 1 and "Traceback" not in stderr, stderr[-3000:]
    err = [ln for ln in stderr.splitlines() if ln.startswith("error: ")]
    assert len(err) == 1, stderr[-3000:]
    assert re.search(r"UserCodeTimeout: .*train\.parquet row \d+: reward function hang_rewards:score_until "
                     r"\(data_source '[^']*'\) did not return within reward\.timeout_s=1 s", err[0]), err[0]
    assert _checkpoint_steps(out) == []
