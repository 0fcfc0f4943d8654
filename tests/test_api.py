"""The public API on a plain megatron-core GPTModel (local spec, RoPE; not this project's model):
prefix stage + response stage + prefix backward around megatron's schedule equal full sequences (float64 weights
and activations, fp32 gradient buffers: `api_workers.prefix_vs_full` says why) within
the fp32 tolerance of docs/design.md §3, at TP=2 (Qwen2.5's layer: QKV bias) and at TP=2 x PP=2 with tied
embeddings and Qwen3's layer (per-head q/k RMSNorm, no QKV bias); a wrong response position is caught."""
import pytest
import torch

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


def test_bad_batches_are_refused_naming_the_argument():
    """The extension's batch builders are public: a bad prompt, response, advantage count or packing argument is
    one error naming the group and the argument, before any model work (unchecked, each case below fails later,
    deep in megatron or torch, or passes silently)."""
    from rollplex_megatron.api import TEXT_POSITIONS, full_micro_batches, response_micro_batches, text_groups

    p, r = torch.tensor([1, 2, 3]), [torch.tensor([4, 5]), torch.tensor([6])]
    adv = torch.tensor([1.0, -1.0])
    for args, want in [(([torch.tensor([1])], [r], [adv]), "prompt 0 has 1 tokens; it needs at least 2"),
                       (([p], [r], [torch.tensor([1.0, 2.0, 3.0])]), "group 0 has 2 responses but 3 advantages"),
                       (([p], [r], [torch.tensor([1.0])]), "group 0 has 2 responses but 1 advantages"),
                       (([p], [[torch.tensor([], dtype=torch.long)]], [torch.tensor([1.0])]),
                        "group 0 response 0 has 0 tokens"),
                       (([p.float()], [r], [adv]), "prompt 0 must be a 1-D tensor of token ids"),
                       (([p[None]], [r], [adv]), "got a 2-D torch.int64 tensor"),
                       (([[1, 2, 3]], [r], [adv]), "got list"),
                       (([p], [r], [torch.tensor([1.0, float("nan")])]), "advantages are not all finite")]:
        with pytest.raises(ValueError, match=want):
            text_groups(*args)
    groups = text_groups([p], [r], [adv])
    for build in (response_micro_batches, full_micro_batches):
        assert len(build(TEXT_POSITIONS, groups, 1, 3)) == 2  # the arguments the cases below get wrong
        for kw, want in [(dict(per_mb=0), "per_mb=0"), (dict(per_mb=-1), "per_mb=-1"),
                         (dict(total_tokens=0), "total_tokens=0"), (dict(max_tokens=-1, per_mb=0), "per_mb=0"),
                         (dict(select=[5]), r"select=\[5\] must name distinct groups in 0..0")]:
            args = {"per_mb": 1, "total_tokens": 3, **kw}
            with pytest.raises(ValueError, match=f"{build.__name__}: {want}"):
                build(TEXT_POSITIONS, groups, **args)
