"""Qwen3-VL (models/qwen3vl/) against transformers' Qwen3VLForConditionalGeneration on a tiny random checkpoint
built with transformers' own Qwen3VLConfig (fp32, CPU, verify.parity's 1e-4 max abs logit difference): an image,
a video (one placeholder run per frame, timestamps as text), both; TP 1 and 2; a mutation that drops one DeepStack
injection must fail."""
import pytest
import torch

from rollplex_megatron.config import ModelConfig
from rollplex_megatron.dist import run_local
from rollplex_megatron.models import registry
from rollplex_megatron.models.qwen3vl import model as M
from rollplex_megatron.models.qwen3vl import positions as P
from rollplex_megatron.recipes import load_run_config
from rollplex_megatron.verify.parity import TOLERANCE, megatron_logits, verify_rank
from tests.hf_models import randomise_o1
from tests.in_turn import case, cases, in_turn

# head_dim 24 != hidden / heads (16): the LLM's own head dim; a 4x4 learned position table resampled to every grid
TINY_TEXT = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-6, max_position_embeddings=4096,
                 rope_parameters=dict(rope_type="default", rope_theta=5e6, mrope_interleaved=True,
                                      mrope_section=[4, 4, 4]), bos_token_id=0, eos_token_id=1, pad_token_id=None)
TINY_VISION = dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=8,
                   temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16,
                   deepstack_visual_indexes=[0, 2])
TINY_TOKENS = dict(image_token_id=310, video_token_id=311, vision_start_token_id=312, vision_end_token_id=313)
VISION = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


def make_tiny_qwen3vl(path, seed: int = 0, tie: bool = False) -> str:
    """Save a random tiny Qwen3VLForConditionalGeneration with O(1) logits (norms, biases randomised too)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    cfg = Qwen3VLConfig(text_config={**TINY_TEXT, "tie_word_embeddings": tie}, vision_config=TINY_VISION,
                        tie_word_embeddings=tie, **TINY_TOKENS)
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(cfg)
    randomise_o1(model, seed, lambda n: "norm" in n and n.endswith("weight"))
    model.save_pretrained(str(path))
    return str(path)


def sample_inputs(cfg: ModelConfig, kind: str, seed: int = 0, batch: int = 2) -> dict:
    """Rows of random text with an image (3x5 merge units), a 2-frame video (2x3 units a frame, each frame after
    its timestamp text, as Qwen3VLProcessor writes it), or both."""
    g = torch.Generator().manual_seed(seed)
    v, m = cfg.vision, cfg.vision.spatial_merge_size
    patch = v.in_channels * v.temporal_patch_size * v.patch_size**2
    text = lambda n: torch.randint(0, 300, (n,), generator=g)  # noqa: E731
    span = lambda tok, n: [torch.tensor([cfg.vision_start_token_id]), torch.full((n,), tok),  # noqa: E731
                           torch.tensor([cfg.vision_end_token_id])]
    image, video = (1, 3 * m, 5 * m), (2, 2 * m, 3 * m)
    rows = []
    for _ in range(batch):
        parts = [text(5)]
        if kind in ("image", "both"):
            parts += span(cfg.image_token_id, 15) + [text(4)]
        if kind in ("video", "both"):
            for _ in range(video[0]):
                parts += [text(3)] + span(cfg.video_token_id, 6)  # "<0.5 seconds>" then the frame
        rows.append(torch.cat(parts + [text(6)]))
    out = {"input_ids": torch.stack(rows)}
    if kind in ("image", "both"):
        out.update(pixel_values=torch.randn(batch * 6 * 10, patch, generator=g),
                   image_grid_thw=torch.tensor([image] * batch))
    if kind in ("video", "both"):
        out.update(pixel_values_videos=torch.randn(batch * 2 * 4 * 6, patch, generator=g),
                   video_grid_thw=torch.tensor([video] * batch))
    return out


def hf_logits(hf_dir: str, inputs: dict) -> torch.Tensor:
    """transformers' Qwen3-VL logits [B,S,V] (fp32, sdpa), positions from its own get_rope_index."""
    from transformers import Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa")
    ids, c = inputs["input_ids"], model.config
    mm = (ids == c.image_token_id).int() + 2 * (ids == c.video_token_id).int()
    with torch.no_grad():
        return model.eval()(input_ids=ids, mm_token_type_ids=mm,
                            **{k: inputs[k] for k in VISION if k in inputs}).logits.float()


def parity(hf_dir: str, tp: int, kind: str, drop_deepstack: bool = False) -> dict:
    """Megatron (through the registry) against transformers on `kind` inputs; `drop_deepstack`: the mutation that
    drops the last DeepStack level's injection."""
    cfg = registry.open_hf(hf_dir).model_config()
    inputs = sample_inputs(cfg, kind)
    full = {k: inputs.get(k) for k in ("input_ids", *VISION)}
    saved = M.Qwen3VLModel.embed_deepstack
    if drop_deepstack:
        M.Qwen3VLModel.embed_deepstack = lambda self, *a, **k: (lambda e, d: (e, d[:-1]))(*saved(self, *a, **k))
    try:
        ours = megatron_logits(hf_dir, full, tp)
    finally:
        M.Qwen3VLModel.embed_deepstack = saved
    ref = hf_logits(hf_dir, inputs)
    return {"diff": (ours - ref).abs().max().item(), "ref_max": ref.abs().max().item()}


KINDS = ("image", "video", "both")


def verify_dropped(hf_dir: str, tp: int) -> dict:
    """`verify-hf`'s comparison with the last DeepStack level dropped (the mutation its verdict must catch)."""
    saved = M.Qwen3VLModel.embed_deepstack
    M.Qwen3VLModel.embed_deepstack = lambda self, *a, **k: (lambda e, d: (e, d[:-1]))(*saved(self, *a, **k))
    try:
        return verify_rank(hf_dir, tp, 0)
    finally:
        M.Qwen3VLModel.embed_deepstack = saved


def rotary_host_ops(hf_dir: str, mutate: str = "") -> dict:
    """The LLM rotary of a built model, called three times on position ids of the meta device (standing in for a
    GPU): how many ops of the calls after the first touch a host tensor (a decode step's CUDA graph may copy
    nothing from the host; the GPU's capture refused such a copy) and whether the angles stayed the same.
    `mutate`: "uncached", the device tables are not kept; "host_axis", the axes are rebuilt on the host each call."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from rollplex_megatron.dist import init_parallel

    class HostOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in tree_leaves((args, kwargs, out))):
                self.ops.append(str(func))
            return out

    cfg = registry.open_hf(hf_dir).model_config()
    init_parallel(tp=1, pp=1)
    model = registry.model_spec(cfg).build(cfg, "float32")
    own = P.mrope_interleaved_freqs
    if mutate == "host_axis":
        P.mrope_interleaved_freqs = lambda pos, inv, axis: own(
            pos, inv, P.mrope_axes(inv.numel(), list(cfg.mrope_section)).to(pos.device))
    try:
        pos = torch.arange(12).view(1, 1, 12).expand(3, 2, 12).to("meta")
        first = model.rotary(pos)
        host = HostOps()
        later = []
        with host:
            for _ in range(2):
                if mutate == "uncached":
                    model._rope_tables.clear()
                later.append(model.rotary(pos))
    finally:
        P.mrope_interleaved_freqs = own
    same = all(r.shape == first.shape for r in later)
    cpu_pos = torch.arange(12).view(1, 1, 12).expand(3, 2, 12)  # the values, on the host: cached equals first call
    same = same and torch.equal(model.rotary(cpu_pos), model.rotary(cpu_pos))
    return {"host_ops_after_first": len(host.ops), "same": same}


def layer_norm_dtypes(hf_dir: str) -> list[str]:
    """The dtypes of every torch LayerNorm's parameters in a bf16 build of the model."""
    from rollplex_megatron.dist import init_parallel

    cfg = registry.open_hf(hf_dir).model_config()
    init_parallel(tp=1, pp=1)
    model = registry.model_spec(cfg).build(cfg, "bfloat16")
    return sorted({str(p.dtype) for m in model.modules() if isinstance(m, torch.nn.LayerNorm)
                   for p in m.parameters()})


@pytest.fixture(scope="module")
def tiny_qwen3vl(tmp_path_factory):
    """The tiny untied Qwen3-VL checkpoint."""
    return make_tiny_qwen3vl(tmp_path_factory.mktemp("hf3") / "tiny_qwen3vl")


@pytest.fixture(scope="module")
def parity_jobs(tiny_qwen3vl):
    """One job per TP size: every input kind, and at TP 1 the dropped-DeepStack mutation."""
    one = {k: (parity, (tiny_qwen3vl, 1, k)) for k in KINDS}
    one["drop"] = (parity, (tiny_qwen3vl, 1, "image", True))
    one["verify_hf"], one["verify_hf_drop"] = (verify_rank, (tiny_qwen3vl, 1, 0)), (verify_dropped, (tiny_qwen3vl, 1))
    one.update({f"rotary{m}": (rotary_host_ops, (tiny_qwen3vl, m)) for m in ("", "uncached", "host_axis")})
    one["layer_norm_dtypes"] = (layer_norm_dtypes, (tiny_qwen3vl,))
    two = {k: (parity, (tiny_qwen3vl, 2, k)) for k in KINDS}
    two["verify_hf"] = (verify_rank, (tiny_qwen3vl, 2, 0))
    return {1: run_local(in_turn, 1, one)[0], 2: run_local(in_turn, 2, two, False)}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(parity_jobs, tp, kind):
    per_rank = cases([parity_jobs[1]], kind) if tp == 1 else cases(parity_jobs[2], kind)
    assert all(r == per_rank[0] for r in per_rank)
    r = per_rank[0]
    assert r["ref_max"] > 1.0, "logits too small for the comparison to mean anything"
    assert r["diff"] <= TOLERANCE, r


def test_verify_hf_checks_qwen3vl_in_its_own_prompt_format(parity_jobs):
    """`verify-hf`'s own prompt (an image and a 4-step video, written one run per frame for this family) at TP 1
    and 2 is within its tolerance, and its verdict fails with one DeepStack level dropped."""
    for r in [case(parity_jobs[1], "verify_hf"), *cases(parity_jobs[2], "verify_hf")]:
        assert r["ok"] and r["logit_abs_max"] > 1.0, r
    bad = case(parity_jobs[1], "verify_hf_drop")
    assert not bad["ok"] and bad["max_abs_logit_diff"] > 100 * TOLERANCE, bad


def test_dropping_one_deepstack_injection_is_detected(parity_jobs):
    r = case(parity_jobs[1], "drop")
    assert r["diff"] > 100 * TOLERANCE, r


def test_config_reads_qwen3vl_fields(tiny_qwen3vl):
    cfg = registry.open_hf(tiny_qwen3vl).model_config()
    assert registry.model_spec(cfg) is registry.FAMILIES["qwen3_vl"]
    assert (cfg.head_dim, cfg.kv_channels, list(cfg.mrope_section)) == (24, 24, [4, 4, 4])
    assert (cfg.vision.num_position_embeddings, cfg.vision.deepstack_visual_indexes) == (16, [0, 2])
    back = registry.model_spec(cfg).hf.config_from_hf(registry.model_spec(cfg).hf.config_to_hf(cfg), cfg.name)
    assert back == cfg


def test_video_positions_go_frame_by_frame():
    """A video's frames are separate runs (HF's get_rope_index splits its grid); a video whose frames sit in one
    run is refused with the format named."""
    ids = torch.tensor([[0, 9, 9, 5, 9, 9, 7]])
    pos, delta = P.mrope_position_ids(ids, None, torch.tensor([[2, 2, 4]]), image_token_id=8, video_token_id=9,
                                      merge=2)
    assert pos[:, 0].tolist() == [[0, 1, 1, 3, 4, 4, 6], [0, 1, 1, 3, 4, 4, 6], [0, 1, 2, 3, 4, 5, 6]]
    assert delta.item() == 0
    with pytest.raises(ValueError, match="one run per video frame"):
        P.mrope_position_ids(torch.tensor([[0, 9, 9, 9, 9]]), None, torch.tensor([[2, 2, 4]]), image_token_id=8,
                             video_token_id=9, merge=2)


@pytest.mark.parametrize("preset", ["qwen3_vl_tiny", "qwen3_vl_2b", "qwen3_vl_4b", "qwen3_vl_8b", "qwen3_vl_32b"])
def test_presets_load_as_the_qwen3vl_family(preset):
    cfg = load_run_config([f"model={preset}"]).model
    assert cfg.family == "qwen3_vl" and cfg.vision.deepstack_visual_indexes
    assert sum(cfg.mrope_section) * 2 == cfg.head_dim


# Prefix/response exactness with DeepStack (docs/design.md section 3: fp32, 1e-5), as test_prefix_equivalence drives
# Qwen2.5-VL. verify.video_grid has one frame: verify's synthetic prompts hold a video in one placeholder run, which
# is a Qwen3-VL prompt only for one frame.
PREFIX_TOL = 1e-5


def _prefix_cfg(tp, pp, seed):
    return load_run_config(["model=qwen3_vl_tiny", f"parallel.tp={tp}", f"parallel.pp={pp}", "rollout.group_size=4",
                            f"verify.seed={seed}", "verify.video_grid=[1,4,4]"])


def prefix_without_one_deepstack(cfg, hf_dir):
    """Mutation: the prefix stage drops the last DeepStack level's injection (the full sequence keeps it)."""
    from tests import prefix_workers as W

    saved = M.Qwen3VLModel.forward_prefix

    def forward_prefix(self, *a, **k):
        embed = self.embed_deepstack
        self.embed_deepstack = lambda *x, **y: (lambda e, d: (e, d and d[:-1]))(*embed(*x, **y))
        try:
            return saved(self, *a, **k)
        finally:
            del self.embed_deepstack

    M.Qwen3VLModel.forward_prefix = forward_prefix
    try:
        return W.exact(cfg, hf_dir)
    finally:
        M.Qwen3VLModel.forward_prefix = saved


@pytest.fixture(scope="module")
def prefix_jobs(tiny_qwen3vl):
    """One job per layout; the one-process job also runs the mutation."""
    from tests import prefix_workers as W

    one = run_local(in_turn, 1, {"exact": (W.exact, (_prefix_cfg(1, 1, 7), tiny_qwen3vl)),
                                 "drop": (prefix_without_one_deepstack, (_prefix_cfg(1, 1, 7), tiny_qwen3vl))})[0]
    out = {(1, 1): case(one, "exact"), "drop": case(one, "drop")}
    for tp, pp in ((2, 1), (1, 2)):
        out[(tp, pp)] = run_local(W.exact, tp * pp, _prefix_cfg(tp, pp, 8 + tp + pp), tiny_qwen3vl)[0]
    return out


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_prefix_response_matches_full_sequence_with_deepstack(prefix_jobs, tp, pp):
    r = prefix_jobs[(tp, pp)]
    assert (r["tp"], r["pp"]) == (tp, pp)
    assert r["max_rel_err_logp"] <= PREFIX_TOL and r["max_rel_err_ref_logp"] <= PREFIX_TOL, r
    assert r["max_rel_err_loss"] <= PREFIX_TOL and r["max_rel_err_grad"] <= PREFIX_TOL, r
    assert r["ok"] and abs(r["loss"]) > 1e-3


def test_prefix_without_one_deepstack_injection_is_detected(prefix_jobs):
    r = prefix_jobs["drop"]
    assert r["max_rel_err_logp"] > 100 * PREFIX_TOL and not r["ok"], r


def test_the_llm_rotary_reads_nothing_from_the_host_after_its_first_call(parity_jobs):
    """A decode step's rotary reads the inverse frequencies and the M-RoPE axes kept on the device: after the first
    call no op touches a host tensor (a CUDA-graph capture refuses a pageable host copy); mutations: tables not
    kept, and axes rebuilt on the host each call (the failure the GPU capture reported), each touch the host."""
    assert case(parity_jobs[1], "rotary") == {"host_ops_after_first": 0, "same": True}
    for m in ("uncached", "host_axis"):
        r = case(parity_jobs[1], f"rotary{m}")
        assert r["host_ops_after_first"] > 0 and r["same"], (m, r)


def test_a_bf16_build_keeps_its_layer_norms_in_bf16(parity_jobs):
    """The vision blocks' LayerNorms (megatron's local spec builds torch's with fp32 weights) are in the model's
    dtype: CUDA's layer_norm takes no weights of another dtype than its input (CPU's does), which stopped the
    4B shape's first bf16 forward on a GPU."""
    assert case(parity_jobs[1], "layer_norm_dtypes") == ["torch.bfloat16"]
