"""The decode step's Triton kernels against the torch paths they replace.

On CPU the kernels run under Triton's interpreter (tests/__init__.py sets TRITON_INTERPRET=1 without
CUDA) in fp32; on the GPU machine the same tests run the compiled kernels, in bf16 for attention.
- attention: `triton_shared_prefix_decode_attention` equals the math path on uneven groups, ragged
  prefixes and responses, several key splits; mutations: prefix padding read, samples on the wrong
  group's prefix, the response part dropped;
- sampling: `fused_sample` draws the tokens `sample_tokens(row_uniforms(...))` draws, for several
  temperatures, seeds and logit magnitudes, never a banned id; log-probs within fp32 rounding;
  mutation: another step's uniforms draw other tokens;
- the engine: decode with both kernels gives the tokens and log-probs of the torch paths.
"""
import pytest
import torch

from rollplex_megatron.attention.decode import group_slots, shared_prefix_decode_attention
from rollplex_megatron.attention.triton_decode import (
    PREFIX_SPLIT,
    RESP_SPLIT,
    triton_index,
    triton_shared_prefix_decode_attention,
)
from rollplex_megatron.dist import run_local
from rollplex_megatron.recipes import load_run_config
from rollplex_megatron.rollout.sampling import SamplingParams, row_uniforms, sample_tokens
from rollplex_megatron.rollout.triton_sampling import fused_sample

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
TOL = 1e-2 if GPU else 1e-5  # DESIGN: bf16 on GPU 1e-2 relative, fp32 on CPU 1e-5


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _attention_case(seed, groups, per_group, p_max, rm, ng=2, rep=4, d=32):
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if GPU else torch.float32
    counts = torch.randint(1, per_group + 1, (groups,), generator=g)
    counts[0] = per_group
    group_B = torch.repeat_interleave(torch.arange(groups), counts)[torch.randperm(int(counts.sum()), generator=g)]
    b = group_B.numel()
    mag = 10.0 ** torch.randint(-1, 2, (1,), generator=g).item()
    mk = lambda *s, m=1.0: (torch.randn(*s, generator=g) * m).to(DEV, dtype)  # noqa: E731
    case = dict(q=mk(b, ng * rep, d, m=mag), pk=mk(groups, p_max, ng, d), pv=mk(groups, p_max, ng, d, m=mag),
                rk=mk(b, rm, ng, d), rv=mk(b, rm, ng, d, m=3.0),
                plen=torch.randint(1, p_max + 1, (groups,), generator=g).to(DEV),
                rlen=torch.randint(1, rm + 1, (b,), generator=g).to(DEV), group=group_B.to(DEV))
    case["plen"][0] = p_max
    for i, n in enumerate(case["plen"].tolist()):  # the buffers' padding: large keys and values, far off if read
        case["pk"][i, n:] = case["q"].abs().max() * case["q"].sign()[:1].mean(1, keepdim=True)
        case["pv"][i, n:] = 100 * mag
    return case


def _triton(c, plen=None, group=None, rlen=None):
    group = c["group"] if group is None else group
    slot, s_max = group_slots(group, c["pk"].shape[0])
    idx = triton_index(group, slot, s_max, c["plen"] if plen is None else plen, c["rlen"] if rlen is None else rlen)
    return triton_shared_prefix_decode_attention(c["q"], c["pk"], c["pv"], c["rk"], c["rv"], idx, None)


def _reference(c):
    d = lambda t: t.double()  # noqa: E731
    return shared_prefix_decode_attention(d(c["q"]), d(c["pk"]), d(c["pv"]), c["plen"], c["group"], d(c["rk"]),
                                          d(c["rv"]), c["rlen"], None)


@pytest.mark.parametrize("seed,groups,per_group,p_max,rm", [
    (0, 3, 4, PREFIX_SPLIT + 37, 20),  # two prefix splits, the second ragged
    (1, 5, 1, 40, RESP_SPLIT + 9),  # unshared samples, two response splits
    (2, 2, 20, 70, 33),  # 20 samples x 4 heads = 80 query rows: two row blocks of a program
])
def test_triton_decode_attention_matches_the_math_path(seed, groups, per_group, p_max, rm):
    c = _attention_case(seed, groups, per_group, p_max, rm)
    ref = _reference(c)
    out = _triton(c)
    assert out.dtype == c["q"].dtype and out.shape == ref.shape
    assert _rel(out, ref) < TOL
    # mutations: the padding keys read, every sample on group 0's prefix, the response part dropped
    # (each at least twice the bound the test holds the kernel to, so the assertion above would fail)
    assert _rel(_triton(c, plen=torch.full_like(c["plen"], p_max)), ref) > 2 * TOL
    assert _rel(_triton(c, group=torch.zeros_like(c["group"])), ref) > 2 * TOL
    no_resp = dict(c, rv=torch.zeros_like(c["rv"]))
    assert _rel(_triton(no_resp), ref) > 2 * TOL


def test_triton_decode_attention_never_reads_past_the_lengths():
    """Keys past a prefix's or a response's length are garbage in the engine's buffers."""
    c = _attention_case(3, 4, 3, 90, 50)
    ref = _reference(c)
    for t, lens in ((c["pk"], c["plen"]), (c["pv"], c["plen"])):
        for i, n in enumerate(lens.tolist()):
            t[i, n:] = float("nan")
    for t in (c["rk"], c["rv"]):
        for i, n in enumerate(c["rlen"].tolist()):
            t[i, n:] = float("nan")
    out = _triton(c)
    assert torch.isfinite(out).all() and _rel(out, ref) < TOL


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_fused_sampling_draws_the_reference_tokens(temperature):
    g = torch.Generator().manual_seed(int(temperature * 10))
    b, vocab = 12, 3001  # not a multiple of the block: the last block is ragged
    scale = 10.0 ** torch.randint(-1, 3, (b, 1), generator=g)
    logits = (torch.randn(b, vocab, generator=g) * scale).to(DEV, torch.bfloat16 if GPU else torch.float32)
    seed = torch.randint(0, 2**62, (b,), generator=g).to(DEV)
    sample = torch.randint(0, 16, (b,), generator=g).to(DEV)
    step = torch.tensor([int(temperature * 7)], device=DEV)
    banned = torch.tensor([0, 5, vocab - 1], device=DEV)
    logits[:, 5] = logits.max() + 100  # a banned id that would otherwise always win
    tok, lp = fused_sample(logits, temperature, seed, sample, step, banned, block=256)
    params = SamplingParams(temperature=temperature)
    ref_tok, ref_lp = sample_tokens(logits.index_fill(1, banned, float("-inf")), params,
                                    row_uniforms(seed, sample, step, vocab))
    assert torch.equal(tok, ref_tok)
    assert not torch.isin(tok, banned).any()
    assert float((lp - ref_lp).abs().max()) <= 1e-5 * max(1.0, float(ref_lp.abs().max()))
    # mutation: the uniforms of another step draw other tokens for most rows
    other, _ = fused_sample(logits, temperature, seed, sample, step + 1, banned, block=256)
    assert int((other != ref_tok).sum()) >= b // 3


def test_engine_with_triton_kernels_equals_the_torch_paths(tiny_hf):
    """The engine decoding through both kernels gives the torch paths' tokens, log-probs within fp32
    rounding. CPU (fp32, interpreted): against the math attention and torch sampling. GPU (bf16, CUDA
    graphs): the fused draw against the torch draw on the same Triton attention, whose logits are the
    same bits, so the tokens must be equal."""
    from tests import rollout_workers as W

    cfg = load_run_config(["model=tiny"])
    ref_path = ("triton", "torch") if GPU else ("math", "torch")
    res = run_local(W.engine_kernel_paths, 1, cfg, str(tiny_hf), SamplingParams(0.9), "bfloat16" if GPU else "float32",
                    [ref_path, ("triton", "triton")])[0]
    (t_ref, lp_ref), (t_tri, lp_tri) = res[ref_path], res[("triton", "triton")]
    assert t_tri == t_ref and sum(len(s) for r in t_ref for s in r) > 10
    flat = lambda x: torch.tensor([v for r in x for s in r for v in s])  # noqa: E731
    assert _rel(flat(lp_tri), flat(lp_ref)) < 1e-5


def test_fused_rope_and_cache_write_equal_megatrons_rope_and_index_copy():
    """Within rounding of megatron's unfused RoPE: the kernel rounds where it rounds, but CUDA's cos/sin
    (libdevice) and torch's differ in the last bits for large angles, so bf16 results differ by an ulp
    here and there (GPU: bf16 tolerance; CPU, fp32 interpreted: 1e-5). Only the step's slot is written."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from rollplex_megatron.attention.triton_decode import triton_rope_and_write

    g = torch.Generator().manual_seed(11)
    dtype = torch.bfloat16 if GPU else torch.float32
    b, nq, ng, d, rm = 6, 8, 2, 64, 12
    q, k, v = (torch.randn(1, b, h, d, generator=g).to(DEV, dtype) * 4 for h in (nq, ng, ng))
    freqs = (torch.rand(1, b, 1, d, generator=g) * 300).to(DEV)  # angles up to late positions
    rk, rv = torch.zeros(b, rm, ng, d, dtype=dtype, device=DEV), torch.zeros(b, rm, ng, d, dtype=dtype, device=DEV)
    step = torch.tensor([5], device=DEV)
    q_rot = triton_rope_and_write(q[0], k[0], v[0], freqs[0, :, 0], rk, rv, step)
    want_q, want_k = _apply_rotary_pos_emb_bshd(q, freqs)[0], _apply_rotary_pos_emb_bshd(k, freqs)[0]
    assert _rel(q_rot, want_q) <= TOL and _rel(rk[:, 5], want_k) <= TOL and torch.equal(rv[:, 5], v[0])
    others = [i for i in range(rm) if i != 5]
    assert not rk[:, others].any() and not rv[:, others].any()
    # mutation: keys not rotated (or rotated the other way) are far from megatron's
    assert _rel(k[0], want_k) > 0.1
    assert _rel(triton_rope_and_write(q[0], k[0], v[0], -freqs[0, :, 0], rk, rv, step), want_q) > 0.1


def test_fused_rms_norm_equals_torchs_and_is_swapped_in_only_for_decode_inputs(monkeypatch):
    """`triton_rms_norm` within rounding of torch.nn.RMSNorm (fp32 on CPU: 1e-5; bf16 on GPU: the bf16
    bound); under `fused_rms_norms` a [1, B, H] no-grad input on this thread takes the kernel, and an input
    with autograd, a longer one, or one on another thread takes torch's module unchanged."""
    import threading

    from rollplex_megatron.rollout import triton_norm
    from rollplex_megatron.rollout.triton_norm import fused_rms_norms, triton_rms_norm

    g = torch.Generator().manual_seed(5)
    dtype = torch.bfloat16 if GPU else torch.float32
    norm = torch.nn.RMSNorm(320, eps=1e-6).to(DEV, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(320, generator=g) * 2)
    x = (torch.randn(1, 9, 320, generator=g) * torch.logspace(-2, 2, 9)[None, :, None]).to(DEV, dtype)
    want = norm(x)
    assert _rel(triton_rms_norm(x, norm.weight, 1e-6), want) < TOL
    # mutation: a wrong epsilon (1e-2 against rows of rms 1e-2) is caught by the same bound
    assert _rel(triton_rms_norm(x, norm.weight, 1e-2), want) > 2 * TOL
    calls = []
    monkeypatch.setattr(triton_norm, "triton_rms_norm", lambda *a: calls.append(1) or triton_rms_norm(*a))
    with fused_rms_norms(norm):
        with torch.no_grad():
            assert _rel(norm(x), want) < TOL and len(calls) == 1
            norm(x.expand(3, 9, 320))  # a prefix-stage shape
            other = threading.Thread(target=norm, args=(x,))
            other.start()
            other.join()
        norm(x.requires_grad_(True)).sum().backward()  # autograd: torch's module
    assert len(calls) == 1 and norm.weight.grad is not None
    assert "forward" not in vars(norm)  # the module's own forward is back
