"""The decode step's fused layer path (models/decode_layers.py, models/triton_layer.py) against megatron's modules.

On CPU the kernels run under Triton's interpreter (tests/__init__.py); the GPU twins of the kernel tests are in
tests/test_gpu_decode.py.
- `add_rms_norm`: the new residual and the normed row bit-equal to torch's add followed by the decode norm kernel
  (fp32 and bf16, rows of scales 1e-2..1e2, a width that is not a power of two); mutation: the add dropped;
- `silu_mul`: megatron's silu(gate) * (up + glu_linear_offset) bit-equal in bf16 over every finite bf16 gate value,
  within an fp32 ulp's rounding in fp32; mutations: silu left unrounded before the product, gate and up swapped;
- the engine: the same requests decoded through the fused path and through the modules (the Triton attention, the
  fused RoPE and norms on both) on tiny Qwen2.5-VL and Qwen3-VL models: bf16 bit-equal, fp32 the same tokens and
  log-probs within 1e-6, and fp32 equal to the full-recompute loop (docs/design.md §3); the fused kernels ran 2 and
  1 times a layer a step; a model setting the walk does not reproduce keeps the module path; mutation: the
  add-and-norm kernel dropping the residual changes the rollout; TP=2 (gloo, two ranks): fused equals modules.
- `rollout.decode_gemm=all` (models/triton_linear.py: linear_qkv, linear_proj and linear_fc2 as small_m_linear,
  linear_fc1 with the activation as small_m_gated, at every layer of every step) and `gated` (small_m_gated only): fp32
  decode of Qwen2.5-VL under `all` equals the module path within GEMM rounding and the full-recompute loop at TP 1,
  the module path at TP 2 (the row-parallel all-reduce done by decode_layers); Qwen3-VL under `gated` equals the
  full-recompute loop; mutation: the GEMM dropping linear_qkv's bias changes the rollout; the setting is refused
  with layer_kernel=modules and where the layer path cannot run.
"""
import pytest
import torch
import torch.nn.functional as F

from rollplex_megatron.dist import run_local
from rollplex_megatron.models import triton_layer as TL
from rollplex_megatron.models.triton_layer import add_rms_norm, silu_mul
from rollplex_megatron.models.triton_norm import triton_rms_norm
from rollplex_megatron.rollout.sampling import SamplingParams
from tests import decode_layer_workers as W
from tests.in_turn import case, cases, in_turn
from tests.test_rollout import _same
from tests.test_triton_kernels import _mutant

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
PARAMS = SamplingParams(0.9)
# the engine cases' dtypes: CUDA's Triton decode attention takes bf16/fp16 weights, so fp32 is the CPU suite's
# (the attention under the interpreter)
ENGINE_DTYPES = ("bfloat16",) if GPU else ("float32", "bfloat16")
FP32_ON_CPU = "fp32 decode with the Triton attention runs under the interpreter on CPU only (the CPU suite runs it)"
FP32_TOL = 1e-6  # fused vs modules in fp32: silu's exp is numpy's under the interpreter, torch's is Sleef's (an ulp)
GEMM_TOL = 1e-5  # a Triton decode_gemm vs modules in fp32: the GEMMs sum in another order (docs/design.md §3)


def _add_norm_case(dtype, seed=0, rows=9, h=320):
    """x (the block's output) of rows spanning 1e-2..1e2, a residual, an RMSNorm weight: torch's add, then the
    decode norm kernel on the sum."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(1, rows, h, generator=g) * torch.logspace(-2, 2, rows)[None, :, None]).to(DEV, dtype)
    res = (torch.randn(1, rows, h, generator=g) * 3).to(DEV, dtype)
    w = (1 + 0.3 * torch.randn(h, generator=g)).to(DEV)
    want_h = x.clone()
    want_h.add_(res)  # megatron's bias-dropout-add in inference: in place on the block's output
    return x, res, w, want_h, triton_rms_norm(want_h, w, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_add_rms_norm_equals_torchs_add_then_the_decode_norm(dtype, tmp_path, monkeypatch):
    x, res, w, want_h, want_y = _add_norm_case(dtype)
    h, y = add_rms_norm(x, res, w, 1e-6)
    assert h.dtype == y.dtype == dtype and h.shape == y.shape == x.shape
    assert torch.equal(h, want_h) and torch.equal(y, want_y)
    # mutation: a kernel that skips the residual add
    monkeypatch.setattr(TL, "_add_rms_norm", _mutant(tmp_path, TL._add_rms_norm, *W.NO_ADD, W.HELPERS))
    h, y = add_rms_norm(x, res, w, 1e-6)
    assert not torch.equal(h, want_h) and not torch.equal(y, want_y)
    with pytest.raises(ValueError, match="residual .* must match x"):
        add_rms_norm(x, res.float() if dtype != torch.float32 else res.double(), w, 1e-6)


def _every_bf16_gate():
    """fc1 rows [gate | up]: the gate half holds every finite bf16 value once, the up half random of scales
    1e-3..1e3 with some -0.0 (which `up + 0.0` turns to +0.0)."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gate = bits[torch.isfinite(bits)]
    gate = torch.cat([gate, gate[: (-gate.numel()) % 256]]).view(-1, 256)
    g = torch.Generator().manual_seed(1)
    up = (torch.randn(gate.shape, generator=g) * 10.0 ** torch.randint(-3, 4, gate.shape, generator=g)).bfloat16()
    up[:, :8] = -0.0
    return torch.cat([gate, up], -1).to(DEV)


def _megatron_glu(fc1, offset):
    gate, up = torch.chunk(fc1, 2, dim=-1)  # mlp.py `glu`: silu(x_glu) * (x_linear + glu_linear_offset)
    return F.silu(gate) * (up + offset)


@pytest.mark.parametrize("offset", [0.0, 0.5])
def test_silu_mul_equals_megatrons_gated_activation(offset, tmp_path, monkeypatch):
    """bf16 bit-equal on every finite gate value (NaN where torch gives NaN); fp32 within 2e-7 relative (the exp's
    last bit); 3-D input of a width that is not a power of two. Mutations: silu unrounded before the product (bf16),
    gate and up swapped."""
    fc1 = _every_bf16_gate()
    want = _megatron_glu(fc1, offset)
    got = silu_mul(fc1, offset)
    assert got.dtype == torch.bfloat16 and torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    g = torch.Generator().manual_seed(2)
    x32 = (torch.randn(1, 5, 2 * 300, generator=g) * 4).to(DEV)
    got32, want32 = silu_mul(x32, offset), _megatron_glu(x32, offset)
    assert got32.shape == (1, 5, 300) and float((got32 - want32).norm() / want32.norm()) < 2e-7
    mutants = {"silu_unrounded": ("    s = _r32(tl.math.div_rn(g, 1.0 + _exp(-g, PRECISE)), dt, RNE)",
                                  "    s = tl.math.div_rn(g, 1.0 + _exp(-g, PRECISE))"),
               "gate_from_up": ("    g = _f32(tl.load(x_ptr + row * stride_x + c,",
                                "    g = _f32(tl.load(x_ptr + row * stride_x + n_cols + c,")}
    for name, (old, new) in mutants.items():
        with monkeypatch.context() as m:
            m.setattr(TL, "_silu_mul", _mutant(tmp_path, TL._silu_mul, old, new, W.HELPERS))
            assert not torch.equal(silu_mul(fc1, offset).nan_to_num(), want.nan_to_num()), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_query_norm_reads_linear_qkvs_output_in_place(dtype, tmp_path, monkeypatch):
    """Qwen3's query norm on the queries as views into linear_qkv's output [1,B,Ng,(rep+2)*D] (rows of scales
    1e-2..1e2): bit-equal to the decode norm kernel on megatron's copied queries, a new contiguous tensor, the
    output untouched; rows that are not contiguous within a group are refused. Mutation: the kernel reads the
    rows at one stride (as before the groups), which takes keys for queries."""
    from rollplex_megatron.models import triton_norm as TN
    from rollplex_megatron.models.triton_norm import triton_rms_norm_grouped

    g = torch.Generator().manual_seed(7)
    b, ng, rep, d = 5, 3, 4, 64
    mixed = torch.randn(1, b, ng, (rep + 2) * d, generator=g) * torch.logspace(-2, 2, b)[None, :, None, None]
    # cut from a larger buffer: the mutant below reads rows past `mixed`'s end, which must stay inside an allocation
    padded = torch.zeros(2 * mixed.numel(), dtype=dtype, device=DEV)
    mixed = padded[:mixed.numel()].view(mixed.shape).copy_(mixed.to(DEV, dtype))
    before = mixed.clone()
    q = mixed[..., :rep * d].unflatten(-1, (rep, d))  # the view decode_layers' _split_qkv makes
    w = (1 + 0.3 * torch.randn(d, generator=g)).to(DEV)
    want = triton_rms_norm(q.reshape(1, b, ng * rep, d), w, 1e-6)  # megatron's copied queries [1,B,Nq,D]
    got = triton_rms_norm_grouped(q, w, 1e-6)
    assert got.shape == q.shape and got.is_contiguous() and torch.equal(mixed, before)
    assert torch.equal(got.view(want.shape), want)
    with pytest.raises(ValueError, match="contiguous within a group"):
        triton_rms_norm_grouped(q.transpose(-1, -2), w, 1e-6)
    monkeypatch.setattr(TN, "_rms_norm_fwd", _mutant(tmp_path, TN._rms_norm_fwd,
                                                     "(rows % GROUP) * n_cols", "(rows % GROUP) * stride_x"))
    assert not torch.equal(triton_rms_norm_grouped(q, w, 1e-6).view(want.shape), want)


@pytest.fixture(scope="module")
def one_rank():
    """Every one-process engine case of this file in one job (`tests.in_turn`), each on a model of its own."""
    calls = {(fam, dt): (W.decode_paths, (fam, dt, PARAMS, 1, "", dt == "float32"))
             for fam in W.FAMILIES for dt in ENGINE_DTYPES}
    calls["qwen25", "no_add"] = (W.decode_paths, ("qwen25", "bfloat16", PARAMS, 1, "no_add", False, (True,)))
    if not GPU:  # the GEMM's bf16 twin is tests/test_triton_linear.py on the GPU machine (tokens may part in bf16)
        calls["qwen25", "gemm"] = (W.decode_paths, ("qwen25", "float32", PARAMS, 1, "", True, (True, False), 0, "all"))
        calls["qwen25", "gemm_no_bias"] = (W.decode_paths, ("qwen25", "float32", PARAMS, 1, "gemm_no_bias", False,
                                                             (True,), 0, "all"))
        calls["qwen3", "gated"] = (W.decode_paths, ("qwen3", "float32", PARAMS, 1, "", True, (True,), 0, "gated"))
    calls["unsupported", ""] = (W.unsupported_setting, ())
    calls["setting", ""] = (W.layer_kernel_setting, ())
    return run_local(in_turn, 1, calls)[0]


def _ran_fused(res, family) -> None:
    """The fused path ran its kernels at every layer of every step (2 add-and-norms, 1 activation, Qwen3's query
    norm read in place), the module path none."""
    on, off = res[True], res[False]
    assert (on["fused_layer"], off["fused_layer"], on["layer_error"]) == (True, False, "")
    n = on["steps"] * on["layers"]
    want = {"add_rms_norm": 2 * n, "silu_mul": n} | ({"triton_rms_norm_grouped": n} if family == "qwen3" else {})
    assert on["calls"] == want and n > 0, on["calls"]
    assert off["calls"] == {}


@pytest.mark.parametrize("family", list(W.FAMILIES))
@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=pytest.mark.skipif(GPU, reason=FP32_ON_CPU)),
                                   "bfloat16"])
def test_fused_layer_decode_equals_the_module_path(one_rank, family, dtype):
    """bf16: the same tokens, log-probs and finish reasons bit for bit; fp32: the same tokens, log-probs within
    FP32_TOL, and both equal to the full-recompute loop within docs/design.md §3's fp32 bound."""
    res = case(one_rank, (family, dtype))
    _ran_fused(res, family)
    fused, modules = res[True]["results"], res[False]["results"]
    assert sum(len(s) for toks, _, _ in fused for s in toks) > 10
    if dtype == "bfloat16":
        assert fused == modules
    else:
        _same(fused, modules, FP32_TOL)
        _same(fused, res["reference"])
        _same(modules, res["reference"])


def test_fused_layer_without_the_residual_add_is_detected(one_rank):
    """Mutation of the test above: the add-and-norm kernel drops the residual; the rollout changes."""
    res, modules = case(one_rank, ("qwen25", "no_add")), case(one_rank, ("qwen25", "bfloat16"))[False]["results"]
    assert res[True]["fused_layer"] and res[True]["calls"]["add_rms_norm"] > 0
    assert [t for t, _, _ in res[True]["results"]] != [t for t, _, _ in modules]


def test_a_setting_the_walk_does_not_reproduce_keeps_the_module_path(one_rank):
    """megatron.activation_func_clamp_value (the MLP clamps gate and up first): `unsupported` names it and the engine
    decodes through the modules; a plain model is supported."""
    res = case(one_rank, ("unsupported", ""))
    assert res == {"plain": "", "clamped": "megatron.activation_func_clamp_value", "engine": (False, True)}


GEMM_ON_CPU = pytest.mark.skipif(GPU, reason="fp32 engine decode with the Triton attention: the CPU suite's "
                                "(interpreter); the GEMM's GPU test is tests/test_triton_linear.py")


def _gemm_ran(res, gemm="all") -> None:
    on = res[True]
    n = on["steps"] * on["layers"]
    assert on["gemm"] == gemm and n > 0
    want = (3 * n if gemm == "all" else None, n)
    assert (on["calls"].get("small_m_linear"), on["calls"].get("small_m_gated")) == want, on["calls"]
    assert "silu_mul" not in on["calls"] and on["calls"]["add_rms_norm"] == 2 * n, on["calls"]
    if False in res:
        assert res[False]["gemm"] == "torch" and not {"small_m_linear", "small_m_gated"} & set(res[False]["calls"])


@GEMM_ON_CPU
@pytest.mark.parametrize("family", ["qwen25"])  # Qwen3-VL's layers run the gated kernel in the next test
def test_decode_gemm_triton_equals_the_module_path(one_rank, family):
    """decode_gemm=all: small_m_linear ran for linear_qkv, linear_proj and linear_fc2, small_m_gated for
    linear_fc1 and the activation, at every layer of every step; the same tokens as the modules, log-probs within
    GEMM_TOL, and the full-recompute loop's."""
    res = case(one_rank, (family, "gemm"))
    _gemm_ran(res)
    assert sum(len(s) for toks, _, _ in res[True]["results"] for s in toks) > 10
    _same(res[True]["results"], res[False]["results"], GEMM_TOL)
    _same(res[True]["results"], res["reference"])


@GEMM_ON_CPU
@GEMM_ON_CPU
def test_decode_gemm_gated_runs_only_the_gated_kernel(one_rank):
    """decode_gemm=gated on Qwen3-VL: small_m_gated for linear_fc1 and the activation at every layer of every step,
    no small_m_linear (the other linears on cuBLAS); the full-recompute loop's tokens and log-probs."""
    res = case(one_rank, ("qwen3", "gated"))
    _gemm_ran(res, "gated")
    _same(res[True]["results"], res["reference"])


def test_decode_gemm_without_the_bias_is_detected(one_rank):
    """Mutation of the test above: small_m_linear called without linear_qkv's bias; the rollout changes."""
    res, modules = case(one_rank, ("qwen25", "gemm_no_bias")), case(one_rank, ("qwen25", "gemm"))[False]["results"]
    assert res[True]["calls"].get("small_m_linear", 0) > 0
    with pytest.raises(AssertionError):
        _same(res[True]["results"], modules, GEMM_TOL)


def test_fused_layer_decode_tp2_equals_the_module_path():
    """TP=2 over gloo (one job, both families): each rank's fused decode equals its module decode (the row-parallel
    all-reduces run inside linear_proj and linear_fc2 as in the modules), and the ranks agree."""
    calls = {(fam, dt, "torch"): (W.decode_paths, (fam, dt, PARAMS, 2)) for fam, dt in (("qwen25", "bfloat16"),
                                                                                         ("qwen3", "float32"))}
    if not GPU:  # decode_gemm=all: the row-parallel linears' all-reduce by decode_layers
        calls["qwen25", "float32", "all"] = (W.decode_paths, ("qwen25", "float32", PARAMS, 2, "", False,
                                                              (True, False), 0, "all"))
    ranks = run_local(in_turn, 2, calls, False)
    for key in calls:
        a, b = cases(ranks, key)
        for res in (a, b):
            if key[2] == "all":
                _gemm_ran(res)
                _same(res[True]["results"], res[False]["results"], GEMM_TOL)
                continue
            _ran_fused(res, key[0])
            if key[1] == "bfloat16":
                assert res[True]["results"] == res[False]["results"]
            else:
                _same(res[True]["results"], res[False]["results"], FP32_TOL)
        assert a[True]["results"] == b[True]["results"]


def test_the_layer_kernel_setting_picks_the_path(one_rank):
    """rollout.layer_kernel reaches the engine: triton and auto (the default) fused, modules not; where it cannot
    run, triton is refused with the setting named and auto keeps the modules."""
    res = case(one_rank, ("setting", ""))
    assert (res["triton"], res["modules"], res["auto"], res["auto_math"]) == (True, False, True, False), res
    assert res["math"].startswith("rollout.layer_kernel=triton cannot run here: the decode attention is math"), res


def test_decode_kernel_settings_are_checked_before_any_model(monkeypatch):
    """The run's decode kernel settings are refused from the config alone (Runtime calls this before it builds a
    model), naming the setting: layer_kernel=triton under the math attention or a pipeline, the Triton sampler and
    the flash attention where they cannot run; a setting that can run passes."""
    from rollplex_megatron.recipes import load_run_config
    from rollplex_megatron.rollout import embedded

    def refused(*overrides):
        with pytest.raises(ValueError) as e:
            embedded.check_decode_settings(load_run_config(list(overrides)))
        return str(e.value)

    assert refused("rollout.decode_attention=math", "rollout.layer_kernel=triton").startswith(
        "rollout.layer_kernel=triton cannot run here: the decode attention is math")
    assert refused("rollout.decode_attention=triton", "rollout.layer_kernel=triton", "parallel.pp=2") == (
        "rollout.layer_kernel=triton cannot run here: parallel.pp=2 (it needs 1); use rollout.layer_kernel=modules")
    embedded.check_decode_settings(load_run_config(["rollout.decode_attention=triton", "rollout.layer_kernel=triton"]))
    gemm = refused("rollout.decode_attention=math", "rollout.decode_gemm=gated")
    assert gemm.startswith("rollout.decode_gemm=gated cannot run here: the decode attention is math"), gemm
    assert gemm.endswith("; use rollout.decode_gemm=torch"), gemm
    with pytest.raises(ValueError, match="rollout.decode_gemm=all runs on the fused layer path"):
        load_run_config(["rollout.decode_gemm=all", "rollout.layer_kernel=modules"])
    with pytest.raises(ValueError, match="rollout.decode_gemm must be torch, gated or all"):
        load_run_config(["rollout.decode_gemm=triton"])
    embedded.check_decode_settings(load_run_config(["rollout.decode_attention=triton", "rollout.decode_gemm=all"]))
    if not GPU:
        assert refused("rollout.decode_attention=flash").startswith("rollout.decode_attention=flash needs CUDA")
        monkeypatch.setattr(embedded, "TRITON_INTERPRET", False)  # a user's CPU run: no interpreter
        assert refused("rollout.sampling_kernel=triton").startswith("rollout.sampling_kernel=triton needs CUDA")
        assert refused("rollout.layer_kernel=triton").startswith(  # auto attention on CPU: math
            "rollout.layer_kernel=triton cannot run here: the decode attention is math")


def test_train_refuses_a_decode_kernel_it_cannot_run_before_building_a_model(tmp_path):
    """`train` with rollout.layer_kernel=triton on CPU (no Triton interpreter: a user's machine) stops at start-up
    with the setting named, raised by Runtime's check before any model is built (the traceback `--debug` prints; the
    engine's own check, after the build, gives the same line from `build_engine`), and leaves no run directory."""
    import os
    import subprocess
    import sys

    runs = tmp_path / "runs"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-m", "rollplex_megatron", "train", "--debug", "rollout.layer_kernel=triton",
                        "train.steps=1", f"run_dir={runs}"], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode != 0, p.stdout[-2000:]
    err = p.stderr
    assert "ValueError: rollout.layer_kernel=triton cannot run here: the decode attention is math" in err, err[-2000:]
    assert "in check_decode_settings" in err and "build_engine" not in err and "build_policy" not in err, err[-3000:]
    assert not runs.exists() or not any(runs.iterdir())


def test_gemm_gap_keeps_forwards_it_does_not_reproduce():
    """`gemm_gap` (the Triton decode_gemm's guard): a plain column- or row-parallel linear is taken; a subclass with its
    own forward (megatron's ColumnParallelLinearGathered gathers its output), a forward replaced on the instance
    (the split-GEMM executor), a gathered output, sequence parallelism and a strided weight keep the module's
    forward, each named."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from rollplex_megatron.models.decode_layers import gemm_gap

    def bare(cls, **attrs):
        m = torch.nn.Module.__new__(cls)
        torch.nn.Module.__init__(m)
        m.weight = torch.nn.Parameter(torch.zeros(4, 8))
        for k, v in ({"sequence_parallel": False, "explicit_expert_comm": False, "gather_output": False,
                      "input_is_parallel": True} | attrs).items():
            setattr(m, k, v)
        return m

    class Gathered(ColumnParallelLinear):
        def forward(self, x):
            return super().forward(x)

    assert gemm_gap(bare(ColumnParallelLinear)) == "" and gemm_gap(bare(RowParallelLinear)) == ""
    assert "not megatron's" in gemm_gap(bare(Gathered))
    replaced = bare(RowParallelLinear)
    replaced.forward = lambda x: (x, None)
    assert "not megatron's" in gemm_gap(replaced)
    assert gemm_gap(bare(ColumnParallelLinear, gather_output=True)) == "a gathered output"
    assert gemm_gap(bare(RowParallelLinear, sequence_parallel=True)) == "sequence parallel or expert communication"
    strided = bare(ColumnParallelLinear)
    strided.weight = torch.nn.Parameter(torch.zeros(8, 4).t())
    assert gemm_gap(strided) == "no weight of its own with unit column stride"
    assert "not a megatron tensor-parallel linear" in gemm_gap(torch.nn.Linear(8, 4))
