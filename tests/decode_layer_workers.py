"""Workers for tests/test_decode_layer.py and tests/test_gpu_decode.py (importable for spawn): the embedded engine's
decode with the fused layer path (models/decode_layers.py) and with megatron's modules, on a tiny model of either
family with random O(1) weights, text prompts, the Triton decode attention (interpreted on CPU)."""
from __future__ import annotations

import tempfile
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from rollplex_megatron.dist import init_parallel
from rollplex_megatron.models import decode_layers as DL
from rollplex_megatron.models import registry
from rollplex_megatron.models import triton_layer as TL
from rollplex_megatron.prefix.batch import Prompt
from rollplex_megatron.recipes import load_run_config
from rollplex_megatron.rollout.embedded import EmbeddedEngine
from rollplex_megatron.rollout.engine import RolloutRequest
from tests.rollout_workers import _as_lists, recompute_generate

# power-of-two head dims (the Triton attention's): Qwen2.5-VL tiny's 16; Qwen3-VL tiny's 24 made 32 (its sections
# follow, summing to D/2), q/k norms and a head dim apart from hidden/heads kept
# two layers (the walk's boundaries: a next layer's input norm, then the final norm) keep the interpreter's time low
FAMILIES = {"qwen25": ["model=tiny", "model.num_layers=2"],
            "qwen3": ["model=qwen3_vl_tiny", "model.num_layers=2", "model.kv_channels=32",
                      "model.mrope_section=[4,6,6]"]}
NO_ADD = ("    x = _r32(a + b, h_ptr.dtype.element_ty, RNE_ADD)", "    x = _r32(a, h_ptr.dtype.element_ty, RNE_ADD)")
HELPERS = ("from rollplex_megatron.models.triton_norm import _cast\n"  # the jitted helpers a mutant kernel calls
           "from rollplex_megatron.models.triton_layer import _exp, _f32, _r32")


def build(family: str, dtype: str, tp: int = 1):
    """This rank's tiny model of `family` in `dtype`: norms' weights 1 + 0.3 N(0,1), biases 0.2 N(0,1), the rest
    N(0,1) * 1.5 / sqrt(fan-in) (O(1) logits), drawn in the same order on every TP rank."""
    cfg = load_run_config(FAMILIES[family] + [f"parallel.tp={tp}"])
    init_parallel(tp, 1, cfg.seed)
    model = registry.model_spec(cfg.model).build(cfg.model, dtype).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (1.5 / p[0].numel() ** 0.5))
    return cfg, model


def requests(n_req: int = 2, longer: int = 0) -> list[RolloutRequest]:
    """Text prompts of different lengths, G and limits (`longer` more new tokens each: steps that replay a captured
    graph); stop tokens end some samples early (the batch shrinks)."""
    g = torch.Generator().manual_seed(3)
    stops = tuple(range(20, 50))
    return [RolloutRequest(Prompt(torch.randint(0, 300, (9 + 7 * i,), generator=g)), n=2 + i,
                           max_new_tokens=4 + 2 * i + longer, stop_token_ids=stops, seed=100 + i) for i in range(n_req)]


@contextmanager
def counted_kernels(counts: dict):
    """Count the fused layer path's kernel calls (`decode_layers`' add_rms_norm, silu_mul, Qwen3's grouped query
    norm and, under a Triton decode_gemm, small_m_linear and small_m_gated) within the block."""
    own = {name: getattr(DL, name) for name in ("add_rms_norm", "silu_mul", "triton_rms_norm_grouped",
                                                "small_m_linear", "small_m_gated")}
    for name, fn in own.items():
        setattr(DL, name, lambda *a, _n=name, _f=fn, **kw: counts.__setitem__(_n, counts.get(_n, 0) + 1)
                or _f(*a, **kw))
    try:
        yield
    finally:
        for name, fn in own.items():
            setattr(DL, name, fn)


@contextmanager
def mutated(mutate: str):
    """`mutate="no_add"`: the add-and-norm kernel drops the residual (normalises the block's output alone);
    `"gemm_no_bias"`: the decode GEMM drops its bias (Qwen2.5-VL's linear_qkv has one)."""
    if mutate == "gemm_no_bias":
        own = DL.small_m_linear
        DL.small_m_linear = lambda x, w, bias=None, **kw: own(x, w, **kw)
        try:
            yield
        finally:
            DL.small_m_linear = own
        return
    if not mutate:
        yield
        return
    from tests.test_triton_kernels import _mutant

    own = TL._add_rms_norm
    TL._add_rms_norm = _mutant(Path(tempfile.mkdtemp()), own, *NO_ADD, HELPERS)
    try:
        yield
    finally:
        TL._add_rms_norm = own


def decode_paths(family: str, dtype: str, params, tp: int = 1, mutate: str = "", recompute: bool = False,
                 paths=(True, False), longer: int = 0, gemm: str = "torch") -> dict:
    """The same requests decoded with the fused layer path (True) and megatron's modules (False), each of `paths`:
    results, whether the path was on, the fused kernels' calls and steps; `recompute`: also the full-recompute
    loop's results. `mutate` (see `mutated`) applies to the fused path, `gemm` (rollout.decode_gemm) too."""
    cfg, model = build(family, dtype, tp)
    out = {}
    for fused in paths:
        eng = EmbeddedEngine(model, cfg.model, 4096, 16 + longer, 1.0, decode_attention="triton", fused_layer=fused,
                             decode_gemm=gemm)
        counts = {}
        with counted_kernels(counts), mutated(mutate) if fused else nullcontext(), torch.no_grad():
            res = eng.generate(requests(longer=longer), params)
        out[fused] = {"results": _as_lists(res.results), "fused_layer": eng.fused_layer, "graph_error": eng.graph_error,
                      "layer_error": eng.layer_error, "calls": counts, "steps": res.stats["decode_steps"],
                      "graph_replays": res.stats["graph_replays"], "layers": cfg.model.num_layers,
                      "gemm": eng.decode_gemm}
    if recompute:
        out["reference"] = recompute_generate(model, cfg, requests(longer=longer), params)
    return out


def unsupported_setting() -> dict:
    """`decode_layers.unsupported` on a plain tiny model and on one whose MLP clamps (a setting the walk does not
    reproduce), and the engine's fused_layer for each (clamped, plain)."""
    cfg, model = build("qwen25", "float32")
    config = model.language_model.decoder.config
    plain = DL.unsupported(model)
    on = EmbeddedEngine(model, cfg.model, 4096, 16, 1.0, decode_attention="triton", fused_layer=True).fused_layer
    config.activation_func_clamp_value = 7.0
    clamped = DL.unsupported(model)
    off = EmbeddedEngine(model, cfg.model, 4096, 16, 1.0, decode_attention="triton", fused_layer=True).fused_layer
    return {"plain": plain, "clamped": clamped, "engine": (off, on)}


def layer_kernel_setting() -> dict:
    """`rollout.layer_kernel` through `EmbeddedEngine.for_run` on the tiny model: triton and auto fused where the
    Triton attention runs (interpreted here), modules on megatron's modules; under the math attention triton
    refused and auto on the modules."""
    cfg, model = build("qwen25", "float32")
    out = {}
    for kernel in ("triton", "modules", "auto"):
        run = load_run_config(FAMILIES["qwen25"] + ["rollout.decode_attention=triton",
                                                    f"rollout.layer_kernel={kernel}"])
        out[kernel] = EmbeddedEngine.for_run(model, run).fused_layer
    out["auto_math"] = EmbeddedEngine.for_run(model, load_run_config(FAMILIES["qwen25"] + [
        "rollout.decode_attention=math", "rollout.layer_kernel=auto"])).fused_layer
    try:
        EmbeddedEngine.for_run(model, load_run_config(FAMILIES["qwen25"] + ["rollout.decode_attention=math",
                                                                              "rollout.layer_kernel=triton"]))
        out["math"] = ""
    except ValueError as e:
        out["math"] = str(e)
    return out
