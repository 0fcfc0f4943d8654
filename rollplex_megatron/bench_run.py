"""A bench mode's training run, in a process of its own from the caller's folder, and the machine it runs on
(its identity, which ratios may not mix, and the host's kernel-launch time).
"""
from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from pathlib import Path

import torch

from rollplex_megatron.bench_modes import split_env
from rollplex_megatron.report import read_metrics

ROOT = Path(__file__).resolve().parent.parent


class BenchModeError(ValueError):
    """A mode's training process failed (its own last error lines inside): reported as one line, no traceback."""


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
