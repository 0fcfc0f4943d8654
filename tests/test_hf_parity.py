"""The megatron Qwen2.5-VL against transformers on the same checkpoint (fp32, CPU, 1e-4 max abs)."""
import pytest
import torch

from rollplex_megatron.dist import run_local
from rollplex_megatron.verify.parity import TOLERANCE, verify_rank
from tests.in_turn import case, in_turn


@pytest.mark.parametrize("tp", [1, 2])
def test_logits_match_transformers(request, tiny_hf, tp):
    res = [case(request.getfixturevalue("one_rank"), "tp1")] if tp == 1 else run_local(verify_rank, tp, tiny_hf, tp, 0)
    assert all(r["max_abs_logit_diff"] == res[0]["max_abs_logit_diff"] for r in res)
    r = res[0]
    assert r["logit_abs_max"] > 1.0, "logits too small for the comparison to mean anything"
    assert r["max_abs_logit_diff"] <= TOLERANCE, r


def test_tied_embeddings_match_transformers(tiny_hf_tied):
    r = run_local(verify_rank, 2, tiny_hf_tied, 2, 1)[0]
    assert r["max_abs_logit_diff"] <= TOLERANCE, r


def _verify_with_plain_qkv(hf_dir, tp):
    """Mutation: lay fused QKV out as [q; k; v] instead of megatron's group-major order."""
    from rollplex_megatron.models import hf_rules as layout  # the layout kinds every family shares

    layout._qkv_fuse = lambda q, k, v, ng: torch.cat([q, k, v])
    return verify_rank(hf_dir, tp, 0)


def _verify_with_1d_positions(hf_dir, tp):
    """Mutation: plain 1D positions instead of M-RoPE (vision tokens then sit at the wrong places)."""
    from rollplex_megatron.verify import parity

    def flat(cfg, inputs):
        s = inputs["input_ids"].shape
        return torch.arange(s[1]).expand(3, *s)

    parity.position_ids_for = flat
    return verify_rank(hf_dir, tp, 0)


def _restoring(mutant, hf_dir, tp):
    """`mutant` with the functions the mutations replace put back afterwards (the next case in the job runs
    unmutated, as in a process of its own)."""
    from rollplex_megatron.models import hf_rules as layout  # the layout kinds every family shares
    from rollplex_megatron.verify import parity

    saved = layout._qkv_fuse, parity.position_ids_for
    try:
        return mutant(hf_dir, tp)
    finally:
        layout._qkv_fuse, parity.position_ids_for = saved


MUTANTS = [_verify_with_plain_qkv, _verify_with_1d_positions]


@pytest.fixture(scope="module")
def one_rank(tiny_hf):
    """The one-process parity runs in one job (`tests.in_turn`): unmutated first, then each mutation with
    the replaced function restored after it."""
    calls = {"tp1": (verify_rank, (tiny_hf, 1, 0))}
    calls.update({m.__name__: (_restoring, (m, tiny_hf, 1)) for m in MUTANTS})
    return run_local(in_turn, 1, calls)[0]


@pytest.mark.parametrize("mutant", MUTANTS)
def test_parity_check_detects_mutations(one_rank, mutant):
    r = case(one_rank, mutant.__name__)
    assert r["max_abs_logit_diff"] > 100 * TOLERANCE, r
    assert not r["ok"]
