"""GPU-only: a configuration the planner accepts does not run out of memory, at the edge of its budget.

The planner (`trainer/runtime.py` `run_plan`, what `train` runs before building a model) is asked for the least
`memory.budget_gib` it accepts for a short `video_long`-shaped run of the 3B's widths (to 0.5 GiB, by bisection:
every size left at `auto` and `memory.plan=auto` choose for each budget tried). `train` then runs two steps at that
budget with torch's allocator capped there (`memory.cap_gib`): it must finish, every phase's measured peak within
the budget. The mutation: the same run capped 15% under the plan's own peak is refused by the planner, and a
process capped at 2 GiB cannot allocate 3 (the cap bites, so the passing run did fit under it).

Marked `gpu`: skipped, with a reason, without CUDA (tests/test_memory_plan.py and tests/test_auto_size.py hold the
planner's choices on CPU); run on the device machine with `benchmarks/gpu_env.sh`'s `gpu_tests`.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA: the allocator's cap and peaks exist on GPU only", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
# video_long's prompts and drawn lengths, 3B's widths, 4 of its 36 layers, a quarter of its batch, shorter answers
OVERRIDES = ["+bench=video_long", "model.num_layers=4", "model.vision.depth=2",
             "model.vision.fullatt_block_indexes=[1]", "workload.rollout_batch=32", "rollout.max_response_len=256",
             "task.max_answer_tokens=256", "rollout.length_mean=64", "train.steps=2", "train.save_every=0"]


def _plan(budget_gib: float) -> dict:
    """The planner's plan for the run under `budget_gib` (raises ValueError where it refuses)."""
    from rollplex_megatron.data import build_source
    from rollplex_megatron.recipes import load_run_config
    from rollplex_megatron.trainer.runtime import run_plan

    cfg = load_run_config(OVERRIDES + [f"memory.budget_gib={budget_gib:g}"])
    return run_plan(cfg, build_source(cfg))[1]


def _edge() -> tuple[float, dict]:
    """The least budget (to 0.5 GiB) the planner accepts, and its plan there."""
    free = torch.cuda.mem_get_info()[0] / 2**30 - 2.0
    lo, hi = 1.0, free
    plan = _plan(hi)  # the whole card: accepted, or this test's run is too large for it
    while hi - lo > 0.5:
        mid = (lo + hi) / 2
        try:
            plan, hi = _plan(mid), mid
        except ValueError:
            lo = mid
    return hi, plan


def _train(tmp: Path, budget: float, cap: float) -> tuple[subprocess.CompletedProcess, list[dict]]:
    cmd = [sys.executable, "-m", "rollplex_megatron", "train", "--debug", *OVERRIDES, f"memory.budget_gib={budget:g}",
           f"memory.cap_gib={cap:g}", f"run_dir={tmp}"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    runs = [d for d in tmp.iterdir() if (d / "metrics.jsonl").exists()] if tmp.exists() else []
    rows = [json.loads(line) for d in runs for line in (d / "metrics.jsonl").read_text().splitlines() if line]
    return p, rows


@pytest.fixture(scope="module")
def edge():
    return _edge()


def test_the_planners_choice_at_the_edge_of_its_budget_fits(edge, tmp_path):
    budget, plan = edge
    assert plan["peak_gib"] <= budget and plan["peak_gib"] > 0.8 * budget, (budget, plan["peak_gib"])
    p, rows = _train(tmp_path / "edge", budget, budget)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    steps = [r for r in rows if "phase_peak_bytes" in r]
    assert len(steps) == 2, rows
    for r in steps:
        over = {ph: b / 2**30 for ph, b in r["phase_peak_bytes"].items() if b / 2**30 > budget}
        assert not over, (budget, over)
    print(f"edge budget {budget:g} GiB, planned peak {plan['peak_gib']:.2f} GiB, measured "
          f"{max(b for r in steps for b in r['phase_peak_bytes'].values()) / 2**30:.2f} GiB, released "
          f"{plan['released']}, auto {plan.get('auto_choices')}")


def test_a_cap_under_the_plans_peak_is_refused_and_a_cap_bites(edge, tmp_path):
    """The mutation of the test above, in two parts: the same run capped 15% under the plan's peak is refused by
    the planner before any model; and the cap is real: a process capped at 2 GiB cannot allocate 3 GiB."""
    budget, plan = edge
    p, _ = _train(tmp_path / "mutant", budget, round(0.85 * plan["peak_gib"], 2))
    assert p.returncode != 0 and "is under the rollplex plan's peak" in p.stderr, p.stderr[-3000:]
    code = ("import torch\nfrom rollplex_megatron.trainer.runtime import cap_allocator\ncap_allocator(2)\n"
            "torch.empty(3 * 2**30, dtype=torch.uint8, device='cuda')")
    q = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert q.returncode != 0 and "out of memory" in q.stderr.lower(), q.stderr[-2000:]
