"""The public API on a plain megatron-core GPTModel (local spec, RoPE; not this project's model):
prefix stage + response stage + prefix backward around megatron's schedule equal full sequences (float64 weights
and activations, fp32 gradient buffers: `api_workers.prefix_vs_full` says why) within
the fp32 tolerance of docs/design.md §3, at TP=2 (Qwen2.5's layer: QKV bias) and at TP=2 x PP=2 with tied
embeddings and Qwen3's layer (per-head q/k RMSNorm, no QKV bias); a wrong response position is caught."""
import pytest

from rollplex_megatron.dist import run_local
from tests import api_workers as W

TOL = 1e-5  # docs/design.md §3, fp32 on CPU


@pytest.mark.parametrize("tp,pp,tied,qk_norm", [(2, 1, False, False), (2, 2, True, True)])
def test_prefix_path_on_a_plain_gpt_model_matches_full_sequences(tp, pp, tied, qk_norm):
    outs = run_local(W.prefix_vs_full, tp * pp, tp, pp, tied, 11, qk_norm)
    for o in outs:
        assert o["exact"]["logp"] <= TOL and o["exact"]["grad"] <= TOL, o["exact"]
        assert o["exact"]["grad_norm"] > 1e-3  # gradients exist and are compared
        assert o["mutant"]["grad"] > 10 * TOL  # the test can fail: positions off by one
        assert o["packed"]["logp"] <= TOL and o["packed"]["grad"] <= TOL, o["packed"]  # the prefixes as one forward
        if pp == 1:
            assert o["stock_forward_err"] <= 1e-6, o["stock_forward_err"]
    last = [o for o in outs if o["exact"]["logp"] > 0 or o["mutant"]["logp"] > 0]
    assert all(o["refuses_gathered_logits"] for o in last)
    assert last and all(o["mutant"]["logp"] > 10 * TOL for o in last)
