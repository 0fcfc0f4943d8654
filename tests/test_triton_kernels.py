"""The decode step's Triton kernels against the torch paths they replace.

On CPU the kernels run under Triton's interpreter (tests/__init__.py sets TRITON_INTERPRET=1 without
CUDA) in fp32; on the GPU machine the same tests run the compiled kernels, in bf16 for attention.
- attention: `triton_shared_prefix_decode_attention` equals the math path on uneven groups, ragged
  prefixes and responses, several key splits; mutations: prefix padding read, samples on the wrong
  group's prefix, the response part dropped;
- sampling: `fused_sample` draws the tokens `sample_tokens(row_uniforms(...))` draws, for several
  temperatures, seeds and logit magnitudes, never a banned id; log-probs within fp32 rounding;
  mutation: another step's uniforms draw other tokens;
- the engine: decode with both kernels gives the tokens and log-probs of the torch paths;
- RMSNorm (`models/triton_norm.py`, fp32 and bf16 under the interpreter): forward, gx and gw against
  torch.nn.RMSNorm's autograd on rows of very different scales, 3-D and strided inputs; mutations: a wrong
  epsilon, torch's default epsilon taken as bf16's, x * r rounded before the weight, gn rounded to bf16,
  the r^3 term dropped; `train.norm_kernel=triton` replaces every RMSNorm of the model and trains as torch's;
- RoPE (`models/triton_rope.py`): forward and input gradient bit-equal to megatron's unfused rotary in bf16
  (fp32 within 1e-6) for LLM and vision head sizes, a batch of mRoPE angles and strided inputs; mutations:
  a sign, the backward's sin halves swapped, a rounding dropped; `train.rope_kernel=triton` trains as torch's
  with the kernel run in every attention context, and the step fails when the contexts leave q and k
  unrotated.
"""
import importlib.util
import inspect

import pytest
import torch
import triton
import triton.language as tl

from rollplex_megatron.attention.decode import group_slots, shared_prefix_decode_attention
from rollplex_megatron.attention.triton_decode import (
    PREFIX_SPLIT,
    RESP_SPLIT,
    triton_index,
    triton_shared_prefix_decode_attention,
)
from rollplex_megatron.attention.triton_decode import _block as _real_block
from rollplex_megatron.attention import triton_decode
from rollplex_megatron.dist import run_local
from rollplex_megatron.models import triton_norm as TN
from rollplex_megatron.recipes import load_run_config
from rollplex_megatron.rollout.sampling import SamplingParams, row_uniforms, sample_tokens
from rollplex_megatron.rollout.triton_sampling import fused_sample

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
TOL = 1e-2 if GPU else 1e-5  # docs/design.md §3: bf16 on GPU 1e-2 relative, fp32 on CPU 1e-5


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


def _triton(c, plen=None, group=None, rlen=None, skip_empty=True, one_launch=True):  # the kernel's defaults
    group = c["group"] if group is None else group
    slot, s_max = group_slots(group, c["pk"].shape[0])
    idx = triton_index(group, slot, s_max, c["plen"] if plen is None else plen, c["rlen"] if rlen is None else rlen)
    return triton_shared_prefix_decode_attention(c["q"], c["pk"], c["pv"], c["rk"], c["rv"], idx, None,
                                                 skip_empty=skip_empty, one_launch=one_launch)


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


BLOCKS: list[int] = []  # the key blocks `_partial` ran, one entry a block (interpreter: plain Python side effects)


def _note_block():
    BLOCKS.append(1)


@triton.jit
def _counted_block(q, k_base, v_base, stride_kn, start, n_hi, scale, offs_d, m_i, l_i, acc, BLOCK_N: tl.constexpr):
    _note_block()
    return _real_block(q, k_base, v_base, stride_kn, start, n_hi, scale, offs_d, m_i, l_i, acc, BLOCK_N)


def test_skipping_the_empty_response_blocks_gives_the_same_bits(monkeypatch, tmp_path):
    """`skip_empty`: the response kernel runs only the key blocks that start before each sample's length (counted
    on CPU, where the interpreter runs the kernels as Python), and gives the output of running every block masked
    bit for bit, with responses of 0 keys, part of a block, several blocks and past one split; mutation: a skip
    one block too eager (the last keys dropped) changes it."""
    c = _attention_case(4, 9, 1, 90, RESP_SPLIT + 70)  # 9 groups of one sample
    lens = [0, 1, 63, 64, 65, 130, RESP_SPLIT, RESP_SPLIT + 1, RESP_SPLIT + 70]
    c["rlen"] = torch.tensor(lens, device=DEV)
    if not GPU:
        monkeypatch.setattr(triton_decode, "_block", _counted_block)
    ran = {}
    for skip in (False, True):
        BLOCKS.clear()
        out = _triton(c, skip_empty=skip)
        ran[skip] = (out, len(BLOCKS))
    ng, per_split, splits = 2, RESP_SPLIT // 64, -(-(RESP_SPLIT + 70) // RESP_SPLIT)
    resp_all = len(lens) * ng * splits * per_split  # every block of every split
    resp_live = ng * sum(-(-n // 64) for n in lens)  # the blocks holding keys
    if not GPU:
        assert ran[False][1] - ran[True][1] == resp_all - resp_live > 0
    assert torch.equal(ran[False][0], ran[True][0])
    assert _rel(ran[True][0], _reference(c)) < TOL
    mutant = _mutant(tmp_path, triton_decode._partial, "            if n_lo + start < n_hi:",
                     "            if n_lo + start + BLOCK_N < n_hi:",
                     "from rollplex_megatron.attention.triton_decode import _NEG, _block")
    monkeypatch.setattr(triton_decode, "_partial", mutant)
    # a compiled kernel keeps the `_partial` it was built with: fresh JITs of the response kernel and of the one-launch
    # kernel (the default path) pick up the mutant
    for name in ("_resp_kernel", "_parts_kernel"):
        monkeypatch.setattr(triton_decode, name, triton.jit(getattr(triton_decode, name).fn))
    assert not torch.equal(_triton(c, skip_empty=True), ran[False][0])
    assert not torch.equal(_triton(c, skip_empty=True, one_launch=False), ran[False][0])


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
    bound); under `fused_rms_norms` a [1, B, H] or [1, B, N, D] no-grad input on this thread takes the kernel, and
    an input with autograd, a longer one, or one on another thread takes torch's module unchanged."""
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
    head = torch.nn.RMSNorm(80, eps=1e-6).to(DEV, dtype)
    head_want = head(x.view(1, 9, 4, 80))
    assert _rel(triton_rms_norm(x, norm.weight, 1e-6), want) < TOL
    # mutation: a wrong epsilon (1e-2 against rows of rms 1e-2) is caught by the same bound
    assert _rel(triton_rms_norm(x, norm.weight, 1e-2), want) > 2 * TOL
    calls = []
    monkeypatch.setattr(triton_norm, "triton_rms_norm", lambda *a: calls.append(1) or triton_rms_norm(*a))
    with fused_rms_norms(torch.nn.ModuleList([norm, head])):
        with torch.no_grad():
            assert _rel(norm(x), want) < TOL and len(calls) == 1
            heads = x.view(1, 9, 4, 80)  # a per-head norm's decode input [1, B, N, D] (Qwen3's q/k): the kernel too
            assert _rel(head(heads), head_want) < TOL and len(calls) == 2
            norm(x.expand(3, 9, 320))  # a prefix-stage shape
            other = threading.Thread(target=norm, args=(x,))
            other.start()
            other.join()
        norm(x.requires_grad_(True)).sum().backward()  # autograd: torch's module
    assert len(calls) == 2 and norm.weight.grad is not None
    assert "forward" not in vars(norm)  # the module's own forward is back


def _norm_case(seed, xdt, wdt, shape=(3, 17), h=320, eps=1e-6, strided=False):
    """torch.nn.RMSNorm (weight of `wdt`) on x of `xdt` whose rows span 1e-2..1e2 in scale: the module, x, a
    gradient for y, and torch's y, gx and gw (the composite's autograd beside fp32 weights)."""
    g = torch.Generator().manual_seed(seed)
    rows = int(torch.tensor(shape).prod())
    scale = torch.logspace(-2, 2, rows)[torch.randperm(rows, generator=g)].view(*shape, 1)
    x = (torch.randn(*shape, 2 * h if strided else h, generator=g) * scale).to(DEV, xdt)
    x = x[..., ::2] if strided else x.transpose(0, 1).contiguous().transpose(0, 1)  # neither contiguous
    assert not x.is_contiguous()
    norm = torch.nn.RMSNorm(h, eps=eps).to(DEV, wdt)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(h, generator=g) * 2)
    gy = torch.randn(x.shape, generator=g).to(DEV, xdt)
    xr = x.detach().requires_grad_()
    y = norm(xr)
    y.backward(gy)
    return norm, x, gy, (y.detach(), xr.grad, norm.weight.grad.clone())


def _fused(norm, x, gy, eps=None):
    x = x.detach().requires_grad_()
    w = norm.weight.detach().clone().requires_grad_()
    y = TN.fused_rms_norm(x, w, norm.eps if eps is None else eps)
    y.backward(gy)
    return y.detach(), x.grad, w.grad


def _bits_apart(a, b):
    """How many representable values apart two same-dtype (16-bit) tensors are, elementwise."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def _agrees(got, want) -> bool:
    """The bound the fused norm is held to. fp32: 1e-5 relative (docs/design.md §3). bf16 y and gx: equal but for
    the rounding of a reduction in another order, i.e. at most 1 in 1000 elements differ and those by one
    ulp; gw (the weight's dtype) 1e-5 relative in fp32, the bf16 rule in bf16."""
    for a, b in zip(got, want):
        if a.dtype == torch.float32:
            if not _rel(a, b) < 1e-5:
                return False
        elif (a != b).float().mean() > 1e-3 or _bits_apart(a, b).max() > 1:
            return False
    return True


def _mutant(tmp_path, kernel, old, new, helpers="from rollplex_megatron.models.triton_norm import _cast"):
    """`kernel` (a JITFunction of models/triton_norm.py, or another module whose jitted helpers `helpers`
    imports) with the line `old` replaced by `new`."""
    src = inspect.getsource(kernel.fn)
    assert old in src
    path = tmp_path / f"mutant_{abs(hash(new))}.py"
    path.write_text("import triton\nimport triton.language as tl\n" + helpers + "\n\n" + src.replace(old, new))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, kernel.fn.__name__)


NORM_DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)]


@pytest.mark.parametrize("xdt,wdt", NORM_DTYPES, ids=["fp32", "bf16_fp32w", "bf16_bf16w"])
def test_fused_rms_norm_equals_torchs_autograd(xdt, wdt, tmp_path, monkeypatch):
    """y, gx and gw of `fused_rms_norm` against torch.nn.RMSNorm (fp32 weights beside bf16 inputs: torch's
    composite; matched dtypes: torch's own CPU kernel) on 3-D, non-contiguous and last-dim-strided inputs.
    Measured (CPU, interpreter, these seeds): fp32 y, gx and gw within 1.1e-7 relative; bf16 beside fp32
    weights y bit-equal, gx bit-equal but for 1 element in 5040 one ulp off, gw (fp32) within 1.0e-7; bf16
    weights y 1 element in 10^4 one ulp off, gx and gw bit-equal. Each mutation breaks `_agrees`."""
    cases = [_norm_case(0, xdt, wdt), _norm_case(1, xdt, wdt, shape=(2, 5, 7), h=72, strided=True)]
    for norm, x, gy, want in cases:
        got = _fused(norm, x, gy)
        assert [t.dtype for t in got] == [xdt, xdt, wdt] and got[1].shape == x.shape
        assert _agrees(got, want), [(_rel(a, b), float((a != b).float().mean())) for a, b in zip(got, want)]
    norm, x, gy, want = cases[0]
    assert not _agrees(_fused(norm, x, gy, eps=1e-2), want)  # a wrong epsilon (rows of rms 1e-2)
    bwd = {"gn_rounded": ("gn = gy * w[None, :]", "gn = (gy * w[None, :]).to(tl.bfloat16).to(tl.float32)"),
           "no_r3_term": ("gx = gn * r - (gr * (r * r * r) / n_cols) * x", "gx = gn * r")}
    for name, (old, new) in bwd.items():
        with monkeypatch.context() as m:
            m.setattr(TN, "_rms_norm_bwd", _mutant(tmp_path, TN._rms_norm_bwd, old, new))
            assert not _agrees(_fused(norm, x, gy), want), name
    if xdt == torch.bfloat16:  # the old decode kernel's rounding: x * r cast to bf16 before the weight product
        rounded = _mutant(tmp_path, TN._rms_norm_fwd, "y = _cast(x * r[:, None] * w[None, :],",
                          "y = _cast(_cast(x * r[:, None], y_ptr.dtype.element_ty, RNE_BF16).to(tl.float32)"
                          " * w[None, :],")
        monkeypatch.setattr(TN, "_rms_norm_fwd", rounded)
        assert not _agrees(_fused(norm, x, gy), want)


def test_fused_rms_norm_default_epsilon_is_torchs():
    """eps=None: torch.nn.RMSNorm takes fp32's machine epsilon for bf16 inputs too (not bf16's, 2^-7, which
    moves rows of rms 0.1 by far more than an ulp); the subclass through the module forward."""
    norm, x, gy, _ = _norm_case(2, torch.bfloat16, torch.float32, eps=None)
    want = norm(x)
    fused = TN.FusedRMSNorm.taking_over(norm)
    assert fused.weight is norm.weight and fused.eps is None
    got = fused(x)
    assert (got != want).float().mean() <= 1e-3 and _bits_apart(got, want).max() <= 1
    bf16_eps = TN.fused_rms_norm(x, norm.weight, torch.finfo(torch.bfloat16).eps)  # mutation
    assert (bf16_eps != want).float().mean() > 0.01


def _swapped_tiny_model():
    """In a rank process: the tiny model's RMSNorms before and after `use_norm_kernel`, and the decode context
    over the fused ones."""
    from rollplex_megatron.dist import init_parallel
    from rollplex_megatron.models.qwen25vl import build_model
    from rollplex_megatron.rollout import triton_norm as RN

    init_parallel(1, 1)
    cfg = load_run_config(["model=tiny"]).model
    model = build_model(cfg)
    before = dict(model.named_parameters())
    out = {"torch": TN.use_norm_kernel(model, "torch"), "triton": TN.use_norm_kernel(model, "triton"),
           "want": 2 * cfg.num_layers + 1 + 2 * cfg.vision.depth + 1,
           "types": sorted({type(m).__name__ for m in model.modules() if isinstance(m, torch.nn.RMSNorm)})}
    after = dict(model.named_parameters())
    out["same_params"] = after.keys() == before.keys() and all(after[n] is p for n, p in before.items())
    norm, calls, kernel = model.language_model.decoder.final_layernorm, [], RN.triton_rms_norm
    RN.triton_rms_norm = lambda *a: calls.append(1) or kernel(*a)
    x = torch.randn(1, 3, cfg.hidden_size, device=norm.weight.device)
    with RN.fused_rms_norms(model.language_model), torch.no_grad():
        out["decode_equal"] = torch.equal(norm(x), TN.FusedRMSNorm.forward(norm, x))  # the context's kernel
        out["decode_calls"] = len(calls)
        norm(torch.randn(2, 3, cfg.hidden_size, device=x.device))  # a prefix's shape: FusedRMSNorm's own forward
    out["calls"], out["restored"] = len(calls), "forward" not in vars(norm)
    return out


def test_norm_kernel_setting_resolves_and_replaces_every_rmsnorm(monkeypatch):
    """auto is torch's RMSNorm on CPU; triton (under the interpreter) replaces each of the tiny model's
    RMSNorms (LLM layers' two, the final norm, vision blocks' two, the merger's ln_q) by a FusedRMSNorm on
    the same Parameter; without the interpreter triton is refused, and a bad value names the setting.
    The decode context (rollout/triton_norm.py) runs over the subclass and falls back to its forward."""
    assert TN.norm_kernel_for("auto", "cpu") == "torch" and TN.norm_kernel_for("triton", DEV) == "triton"
    assert TN.norm_kernel_for("auto", DEV) == ("triton" if GPU else "torch")
    with pytest.raises(ValueError, match=r"^train.norm_kernel must be auto, triton or torch, got 'fast'$"):
        TN.norm_kernel_for("fast", "cpu")
    monkeypatch.setattr(triton_decode, "INTERPRET", False)  # what the resolver (runtime.kernel_for) reads
    with pytest.raises(ValueError, match="train.norm_kernel=triton needs a CUDA device"):
        TN.norm_kernel_for("triton", "cpu")
    out = run_local(_swapped_tiny_model, 1)[0]
    assert (out["torch"], out["triton"], out["types"]) == (0, out["want"], ["FusedRMSNorm"]) and out["same_params"]
    assert out["decode_equal"] and out["decode_calls"] == 1 and out["calls"] == 1 and out["restored"]


def test_trainer_step_with_the_fused_norm_gives_the_torch_update(tiny_hf):
    """A rollplex step at the tiny checkpoint with train.norm_kernel=triton (every RMSNorm of actor and
    reference fused, interpreted) against torch: the same tokens, loss and gradient norm within the first
    step's bound (STEP1_TOL; measured 0 and 1.0e-7) and every parameter after the optimizer step within TOL
    (measured 6e-7). A second step's loss differs by 9e-6, close to TOL: the KL term, at weights that already
    differ by the first step's rounding, amplifies it (test_trainer.py's note on lr 3e-4)."""
    from tests import trainer_workers as W
    from tests.in_turn import case, in_turn
    from tests.test_trainer import STEP1_TOL, TOL, _cfg, _param_err

    small = ["workload.rollout_batch=8", "workload.responses_per_micro_batch=4"]
    runs = run_local(in_turn, 1, {k: (W.run_steps, (_cfg("rollplex", *small, f"train.norm_kernel={k}", hf=tiny_hf),
                                                    1)) for k in ("torch", "triton")})[0]
    fused, plain = case(runs, "triton"), case(runs, "torch")
    assert (fused["norm_kernel"], fused["norms"]) == ("triton", ["FusedRMSNorm"])
    assert (plain["norm_kernel"], plain["norms"]) == ("torch", ["RMSNorm"])
    assert fused["tokens"] == plain["tokens"]
    (a,), (b,) = fused["records"], plain["records"]
    # on CPU both runs share every op but the norm's (interpreted): the mechanism's bound; on the GPU the
    # kernel's rsqrt and sums are the device's, beside other kernels: the fp32 bound of docs/design.md §3 (the H200 at
    # 3a15c52: the gradient norm 8.9e-6 relative apart, close to it)
    bound = TOL if GPU else STEP1_TOL
    for k in ("loss", "grad_norm"):
        assert abs(a[k] - b[k]) <= bound * abs(b[k]), (k, a[k], b[k])
    err, name = _param_err(fused, plain)
    assert err <= TOL, (name, err)


def _rope_case(seed, dtype, s=9, b=1, n=4, d=16, strided=False):
    """x [S,B,N,D] (a strided view when asked), fp32 angles with independent halves (so pairing errors of
    the two halves show) up to late positions, a gradient, and megatron's forward and input gradient."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    g = torch.Generator().manual_seed(seed)
    big = (torch.randn(s, b, 2 * n if strided else n, d, generator=g) * 3).to(DEV, dtype)
    x = big[:, :, ::2] if strided else big
    freqs = (torch.rand(s, b, 1, d, generator=g) * 400).to(DEV)
    gy = torch.randn(s, b, n, d, generator=g).to(DEV, dtype)
    xr = x.detach().clone().requires_grad_()
    want = _apply_rotary_pos_emb_bshd(xr, freqs)
    want.backward(gy)
    return x, freqs, gy, (want.detach(), xr.grad)


def _fused_rope(x, freqs, gy):
    from rollplex_megatron.models.triton_rope import fused_rope, rope_tables

    xr = x.detach().clone().requires_grad_()
    y = fused_rope(xr, rope_tables(freqs, x.dtype))
    y.backward(gy)
    return y.detach(), xr.grad


def _rope_agrees(got, want) -> bool:
    """bf16: bit-equal (the kernel rounds where megatron's ops round); fp32: 1e-6 relative (an FMA on the GPU)."""
    return all(torch.equal(a, b) if a.dtype != torch.float32 else _rel(a, b) <= 1e-6 for a, b in zip(got, want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_rope_equals_megatrons_rotary_and_its_gradient(dtype, tmp_path, monkeypatch):
    """y and dx of `fused_rope` against megatron's `_apply_rotary_pos_emb_bshd` under autograd: the LLM's
    head shape, the vision tower's 80-wide heads (half 40, not a power of two), a batch of 3 with angles per
    sample (mRoPE), a strided input. Each mutation breaks the agreement."""
    from rollplex_megatron.models import triton_rope as TR

    cases = [_rope_case(0, dtype), _rope_case(1, dtype, s=5, n=3, d=80), _rope_case(2, dtype, b=3, strided=True)]
    for x, freqs, gy, want in cases:
        got = _fused_rope(x, freqs, gy)
        assert [t.dtype for t in got] == [dtype, dtype] and got[1].shape == x.shape
        assert _rope_agrees(got, want), [_rel(a, b) for a, b in zip(got, want)]
    x, freqs, gy, want = cases[0]
    helpers = "from rollplex_megatron.models.triton_rope import _cast, _r"
    mutants = {"sign": "        y1 = _r(x1 * c1, dt, RNE_BF16) - _r(x2 * s1, dt, RNE_BF16)",
               "sin_halves": "        y1 = _r(x1 * c1, dt, RNE_BF16) + _r(x2 * s2, dt, RNE_BF16)"}
    new = {"sign": "        y1 = _r(x1 * c1, dt, RNE_BF16) + _r(x2 * s1, dt, RNE_BF16)",
           "sin_halves": "        y1 = _r(x1 * c1, dt, RNE_BF16) + _r(x2 * s1, dt, RNE_BF16)"}
    if dtype == torch.bfloat16:  # fp32 has no rounding to drop
        mutants["unrounded"] = "        y2 = _r(x2 * c2, dt, RNE_BF16) + _r(x1 * s2, dt, RNE_BF16)"
        new["unrounded"] = "        y2 = x2 * c2 + x1 * s2"
    for name, old in mutants.items():
        with monkeypatch.context() as m:
            m.setattr(TR, "_rope", _mutant(tmp_path, TR._rope, old, new[name], helpers))
            assert not _rope_agrees(_fused_rope(x, freqs, gy), want), name
    with pytest.raises(ValueError, match="fused RoPE rotates the whole head"):
        TR.fused_rope(x, TR.rope_tables(freqs[..., :8], dtype))


def test_trainer_step_with_the_fused_rope_gives_megatrons_update(tiny_hf):
    """A rollplex step at the tiny checkpoint with train.rope_kernel=triton (the prefix, response and vision
    contexts rotate q and k, interpreted) against megatron's rotary: the kernel ran forward and backward in
    actor and reference (128 forward and 46 backward launches); the same tokens, loss and gradient norm within
    STEP1_TOL and every parameter after the optimizer step within TOL (measured on CPU: all three equal, 0
    apart). Mutation: contexts that take the tables but leave q and k unrotated give a gradient norm 17%
    apart."""
    from tests import trainer_workers as W
    from tests.in_turn import case, in_turn
    from tests.test_trainer import STEP1_TOL, TOL, _cfg, _param_err

    small = ["workload.rollout_batch=8", "workload.responses_per_micro_batch=4"]
    cfgs = {k: _cfg("rollplex", *small, f"train.rope_kernel={k}", hf=tiny_hf) for k in ("torch", "triton")}
    runs = run_local(in_turn, 1, {k: (W.run_steps, (cfg, 1)) for k, cfg in cfgs.items()})[0]
    fused, plain = case(runs, "triton"), case(runs, "torch")
    unrotated = run_local(W.run_steps, 1, cfgs["triton"], 1, "unrotated_rope")[0]  # patches: a job of its own
    assert (fused["rope_kernel"], fused["ropes"], plain["rope_kernel"], plain["ropes"]) == \
        ("triton", ["triton"], "torch", ["torch"])
    assert plain["rope_launches"] == {"forward": 0, "backward": 0}
    assert min(fused["rope_launches"].values()) > 0, fused["rope_launches"]
    assert fused["tokens"] == plain["tokens"]
    (a,), (b,), (u,) = fused["records"], plain["records"], unrotated["records"]
    bound = TOL if GPU else STEP1_TOL
    for k in ("loss", "grad_norm"):
        assert abs(a[k] - b[k]) <= bound * abs(b[k]), (k, a[k], b[k])
    err, name = _param_err(fused, plain)
    assert err <= TOL, (name, err)
    assert abs(u["grad_norm"] - b["grad_norm"]) > 100 * bound * abs(b["grad_norm"]), (u["grad_norm"], b["grad_norm"])


@pytest.mark.parametrize("prefix_split,resp_split", [(64, 128), (128, 64)])
def test_other_key_splits_match_the_math_path(prefix_split, resp_split):
    """The programs' grain (`prefix_split` / `resp_split` keys each) changes only the order the terms are summed in:
    more splits than the default on both parts, with ragged last splits, still match the math path; a split that is
    not a power of two of at least the key block is refused by name."""
    c = _attention_case(3, 3, 4, 200, 150)
    slot, s_max = group_slots(c["group"], c["pk"].shape[0])
    idx = triton_index(c["group"], slot, s_max, c["plen"], c["rlen"])
    run = lambda **k: triton_shared_prefix_decode_attention(c["q"], c["pk"], c["pv"], c["rk"], c["rv"], idx,  # noqa
                                                            None, **k)
    ref = _reference(c)
    assert _rel(run(prefix_split=prefix_split, resp_split=resp_split), ref) < TOL
    no_resp = dict(c, rv=torch.zeros_like(c["rv"]))  # mutation: the response part dropped
    assert _rel(triton_shared_prefix_decode_attention(no_resp["q"], c["pk"], c["pv"], c["rk"], no_resp["rv"], idx,
                                                      None, prefix_split=prefix_split, resp_split=resp_split),
                ref) > 2 * TOL
    with pytest.raises(ValueError, match="prefix_split=96"):
        run(prefix_split=96)


@pytest.mark.parametrize("splits", [(256, 256), (64, 64)], ids=["default", "fine"])
def test_one_launch_gives_the_three_launch_bits(splits, tmp_path, monkeypatch):
    """`one_launch` (the prefix and response programs in one kernel) on uneven groups and ragged prefixes and
    responses: bit-equal to the separate kernels (each program's arithmetic is theirs) and to the math path within
    TOL. Mutation: the combined kernel's prefix programs all taking the first key split; caught."""
    c = _attention_case(5, 3, 4, 600, 300)  # several key splits of each part at either grain
    slot, s_max = group_slots(c["group"], c["pk"].shape[0])
    idx = triton_index(c["group"], slot, s_max, c["plen"], c["rlen"])
    run = lambda **k: triton_shared_prefix_decode_attention(c["q"], c["pk"], c["pv"], c["rk"], c["rv"], idx,  # noqa
                                                            None, prefix_split=splits[0], resp_split=splits[1], **k)
    three = run(one_launch=False)
    # the partials' scratch starts as NaN, not as whatever a freed block last held: a program that writes no
    # partial then shows in the output whatever the allocator hands back (it held this very output once in CI)
    monkeypatch.setattr(triton_decode, "torch", _NaNScratch())
    one = run()
    assert torch.equal(one, three)
    assert _rel(one, _reference(c)) < TOL
    mutant = _mutant(tmp_path, triton_decode._parts_kernel, "sp = pid % p_splits", "sp = 0",
                     "from rollplex_megatron.attention.triton_decode import _prefix_part, _resp_part")
    monkeypatch.setattr(triton_decode, "_parts_kernel", mutant)
    assert not torch.equal(run(), three)


class _NaNScratch:
    """torch, as a module's global, with `empty` returning NaN-filled tensors."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*size, **kw):
        size = size[0] if len(size) == 1 and not isinstance(size[0], int) else size
        return torch.full(size, float("nan"), **kw)


def test_the_kernel_shapes_benchmark_runs_its_attention_rows():
    """benchmarks/decode_kernel_shapes.py (a GPU benchmark) at tiny shapes on CPU: every split pair of a case gives
    the first pair's output up to rounding, with no time off CUDA; a split pair that drops the response part would
    not (`test_other_key_splits_match_the_math_path`)."""
    import importlib.util
    from pathlib import Path

    from rollplex_megatron.recipes import load_run_config

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "decode_kernel_shapes.py"
    spec = importlib.util.spec_from_file_location("decode_kernel_shapes", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    m = load_run_config(["model=tiny"]).model
    rows = mod.attention_rows(m, [(2, 3)], 150, 70, [(256, 256), (64, 64), (64, 256), (64, 64, 1)], 3.35, 1, 1,
                              device=DEV)
    assert [(r["prefix_split"], r["resp_split"], r["one_launch"]) for r in rows] == [
        (256, 256, False), (64, 64, False), (64, 256, False), (64, 64, True)]
    assert rows[0]["rel_err_vs_first_split"] == 0 and all(r["rel_err_vs_first_split"] < TOL for r in rows)
    assert all(r["kv_bytes"] == (2 * 2 * 150 + 2 * 6 * 70) * m.num_query_groups * m.head_dim * 2 for r in rows)
    assert all((r["us"] is None) == (DEV == "cpu") for r in rows)


def test_the_kernel_shapes_benchmark_runs_its_gemm_rows():
    """The same benchmark's GEMM rows at a tiny model's shapes (bf16; the interpreter on CPU, no times): every
    linear has cuBLAS's row and one per Triton tiling at the Triton rows only, linear_fc1+act included, and each
    Triton result is cuBLAS's within bf16 rounding (a tiling that dropped part of K would not be)."""
    import importlib.util
    from pathlib import Path

    from rollplex_megatron.recipes import load_run_config

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "decode_kernel_shapes.py"
    spec = importlib.util.spec_from_file_location("decode_kernel_shapes", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    m = load_run_config(["model=tiny"]).model
    cfgs = [(16, 16, 1, 4, 2), (32, 32, 3, 4, 2)]
    rows = mod.gemm_rows(m, [3, 40], 3.35, 1, 1, cfgs, triton_rows=(3,), device=DEV)
    linears = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc1+act", "linear_fc2", "output_layer"]
    want = [(lin, mm, kern) for lin in linears for mm in (3, 40)
            for kern in (["cublas+silu_mul" if lin.endswith("+act") else "cublas"]
                         + (["triton:16x16:s1:w4:st2", "triton:32x32:s3:w4:st2"] if mm == 3 else []))]
    assert [(r["linear"], r["m"], r["kernel"]) for r in rows] == want
    assert all("error" not in r and r["rel_err_vs_cublas"] < 1e-2 for r in rows if r["kernel"] != "cublas"), rows
    assert all((r.get("us") is None) == (DEV == "cpu") for r in rows)
