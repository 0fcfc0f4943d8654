"""benchmarks/hf_parity_bf16.py on CPU with the tiny Qwen3-VL preset: the run that the GPU machine makes at a released
shape, end to end (random bf16 checkpoint, fp32 and bf16 comparisons, the built-in mutation)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_hf_parity_script_passes_and_its_mutation_fails(tmp_path):
    out = tmp_path / "parity.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "benchmarks/hf_parity_bf16.py",
           "--preset", "qwen3_vl_tiny", "--out", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["ok"] and r["fp32_rel_err"] <= r["fp32_tol"] and r["bf16_rel_err_ours"] <= r["bf16_bound"], r
    assert r["mutant_fp32_rel_err"] > 10 * r["fp32_tol"], r  # the 1% norm scaling is seen
    assert 0.3 < r["logit_rms"] < 10, r  # O(1) logits: the comparison is not of near-zero numbers
    assert r["bf16_argmax_agreement_with_hf"] > 0.8, r
