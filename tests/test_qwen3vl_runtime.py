"""Qwen3-VL through the runtime (issue 56 item 3) on the tiny random checkpoint of tests/test_qwen3vl.py, fp32 CPU:
the embedded engine (greedy equals transformers' `generate`; decode equals the full-recompute loop), `convert` both
ways and `train-to-hf`, and the three modes' GRPO steps on the rendered task's two-frame videos, with mutations
that prove each comparison can fail."""
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from megatron.core import parallel_state as ps

from rollplex_megatron.checkpoint import convert
from rollplex_megatron.checkpoint import train_state as T
from rollplex_megatron.data import build_source
from rollplex_megatron.dist import init_parallel, run_local
from rollplex_megatron.models import registry
from rollplex_megatron.models.qwen3vl import model as M
from rollplex_megatron.prefix.batch import Prompt
from rollplex_megatron.recipes import load_run_config
from rollplex_megatron.rollout.embedded import EmbeddedEngine
from rollplex_megatron.rollout.engine import RolloutRequest
from rollplex_megatron.rollout.sampling import SamplingParams
from rollplex_megatron.verify.parity import TOLERANCE
from tests import trainer_workers as TW
from tests.in_turn import case, in_turn
from tests.test_checkpoint import _load_all
from tests.rollout_workers import _as_lists, recompute_generate
from tests.test_qwen3vl import make_tiny_qwen3vl, sample_inputs
from tests.test_rollout import _same
from tests.verl_qwen3vl_workers import drop_prefix_deepstack
from tests.test_trainer import BASE, STEP1_TOL, TOL, _param_err, _records_close

GREEDY = SamplingParams(top_k=1)
SAMPLED = SamplingParams(0.8, 0.9, 40)


def _cfg(tp: int = 1, pp: int = 1):
    return load_run_config(["model=qwen3_vl_tiny", f"parallel.tp={tp}", f"parallel.pp={pp}"])


def _setup(cfg, hf_dir: str):
    """This rank's stage of the checkpoint's model, built and loaded through the registry."""
    ck = registry.open_hf(hf_dir)
    cfg.model = ck.model_config()
    spec = registry.model_spec(cfg.model)
    init_parallel(cfg.parallel.tp, cfg.parallel.pp, cfg.seed)
    model = spec.build(cfg.model, "float32")
    spec.hf.load(model, ck, cfg.model, ps.get_tensor_model_parallel_rank(), cfg.parallel.tp,
                 ps.get_pipeline_model_parallel_rank(), cfg.parallel.pp)
    return model.eval()


def _prompt(cfg, kind: str, seed: int) -> Prompt:
    """One Qwen3-VL prompt (test_qwen3vl's format: a video is one placeholder run per frame after its timestamp)."""
    x = sample_inputs(cfg.model, kind, seed, batch=1)
    return Prompt(x["input_ids"][0], x.get("pixel_values"), x.get("image_grid_thw"), x.get("pixel_values_videos"),
                  x.get("video_grid_thw"))


def requests(cfg, stops=tuple(range(20, 60))) -> list[RolloutRequest]:
    """An image, a video (two frames) and an image-and-video prompt, of different G and limits."""
    return [RolloutRequest(_prompt(cfg, kind, 11 + i), n=2 + i, max_new_tokens=4 + 2 * i, stop_token_ids=stops,
                           seed=100 + i) for i, kind in enumerate(("image", "video", "both"))]


def _engine(model, cfg, mutate: str = "") -> EmbeddedEngine:
    """The engine; `mutate="positions"`: its decode steps run one rotary position late (must fail the tests)."""
    eng = EmbeddedEngine(model, cfg.model, 4096, 64, 1.0)
    if mutate == "positions":
        late = lambda last, step, f=eng.spec.decode.positions: f(last, step) + 1  # noqa: E731
        eng.spec = dataclasses.replace(eng.spec, decode=dataclasses.replace(eng.spec.decode, positions=late))
    return eng


def engine_vs_recompute(cfg, hf_dir: str, params: SamplingParams, mutate: str = "") -> dict:
    """Engine results and the recompute loop's, on the same weights and requests."""
    model = _setup(cfg, hf_dir)
    reqs = requests(cfg)
    with torch.no_grad():
        out = _engine(model, cfg, mutate).generate(reqs, params)
    return {"engine": _as_lists(out.results), "reference": recompute_generate(model, cfg, reqs, params)}


def _drop_prefix_deepstack(model) -> None:
    """Mutation: the engine's prefill (the prefix stage, the only place vision enters) drops the last DeepStack
    level's injection."""
    embed = model.embed_deepstack
    model.embed_deepstack = lambda *a, **k: (lambda e, d: (e, d and d[:-1]))(*embed(*a, **k))


def engine_greedy(cfg, hf_dir: str, mutate: str = "") -> list:
    """Greedy engine results on image prompts without stop tokens (every sample runs to its limit)."""
    model = _setup(cfg, hf_dir)
    if mutate == "deepstack":
        _drop_prefix_deepstack(model)
    reqs = [dataclasses.replace(r, stop_token_ids=()) for r in requests(cfg)]
    with torch.no_grad():
        return _as_lists(_engine(model, cfg, mutate).generate(reqs, GREEDY).results)


def hf_greedy(hf_dir: str, cfg) -> list:
    """transformers' `generate` (greedy, the vision tokens suppressed as the engine bans them) on the same
    requests: per request (tokens, log-probs of its raw logits with the vision tokens out of the softmax)."""
    from transformers import Qwen3VLForConditionalGeneration

    hf = Qwen3VLForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa")
    m = registry.open_hf(hf_dir).model_config()
    banned = list(m.vision_token_ids)
    out = []
    for r in requests(cfg):
        p = r.prompt
        ids = p.input_ids[None]
        mm = (ids == m.image_token_id).int() + 2 * (ids == m.video_token_id).int()
        vis = {k: getattr(p, k) for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
               if getattr(p, k) is not None}
        with torch.no_grad():
            g = hf.eval().generate(input_ids=ids, mm_token_type_ids=mm, **vis, do_sample=False,
                                   max_new_tokens=r.max_new_tokens, min_new_tokens=r.max_new_tokens,
                                   suppress_tokens=banned, output_logits=True, return_dict_in_generate=True,
                                   pad_token_id=0)
        toks = g.sequences[0, ids.shape[1]:].tolist()
        logits = torch.stack(g.logits)[:, 0].float().index_fill(1, torch.tensor(banned), float("-inf"))
        lps = torch.log_softmax(logits, -1).gather(-1, torch.tensor(toks)[:, None])[:, 0].tolist()
        out.append((toks, lps))
    return out


@pytest.fixture(scope="module")
def tiny_qwen3vl(tmp_path_factory):
    """The tiny untied Qwen3-VL checkpoint."""
    return make_tiny_qwen3vl(tmp_path_factory.mktemp("hf3r") / "tiny_qwen3vl")


@pytest.fixture(scope="module")
def one_rank(tiny_qwen3vl):
    """Every one-process case of this file in one job (`tests.in_turn`), each on a model of its own."""
    hf = tiny_qwen3vl
    calls = {("recompute", "greedy"): (engine_vs_recompute, (_cfg(), hf, GREEDY)),
             ("recompute", "sampled"): (engine_vs_recompute, (_cfg(), hf, SAMPLED)),
             ("recompute", "positions"): (engine_vs_recompute, (_cfg(), hf, SAMPLED, "positions")),
             ("greedy", ""): (engine_greedy, (_cfg(), hf)),
             ("greedy", "deepstack"): (engine_greedy, (_cfg(), hf, "deepstack")),
             ("hf", ""): (hf_greedy, (hf, _cfg()))}
    return run_local(in_turn, 1, calls)[0]


@pytest.mark.parametrize("name", ["greedy", "sampled"])
def test_engine_matches_full_recompute_loop(one_rank, name):
    res = case(one_rank, ("recompute", name))
    _same(res["engine"], res["reference"])
    assert sum(len(t) for toks, _, _ in res["engine"] for t in toks) > 20


def test_engine_with_late_decode_positions_is_detected(one_rank):
    res = case(one_rank, ("recompute", "positions"))
    with pytest.raises(AssertionError):
        _same(res["engine"], res["reference"])


def _vs_hf(engine, hf) -> float:
    """Max abs log-prob difference of the engine's greedy samples against `generate`'s; every token equal."""
    diff = 0.0
    for (toks, lps, _), (want, want_lp) in zip(engine, hf, strict=True):
        for t, lp in zip(toks, lps, strict=True):
            assert t == want, (t, want)
            diff = max(diff, max(abs(a - b) for a, b in zip(lp, want_lp, strict=True)))
    return diff


def test_greedy_engine_equals_transformers_generate(one_rank):
    diff = _vs_hf(case(one_rank, ("greedy", "")), case(one_rank, ("hf", "")))
    assert diff <= TOLERANCE, diff


def test_greedy_without_one_prefill_deepstack_injection_is_detected(one_rank):
    engine, hf = case(one_rank, ("greedy", "deepstack")), case(one_rank, ("hf", ""))
    with pytest.raises(AssertionError):
        assert _vs_hf(engine, hf) <= TOLERANCE


# convert: hf-to-mcore then mcore-to-hf gives the checkpoint back bit for bit (DeepStack mergers, q/k norms and the
# learned position table included), at every layout.
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_convert_round_trip_is_exact(tiny_qwen3vl, tmp_path, tp, pp):
    mc = convert.hf_to_mcore(tiny_qwen3vl, tmp_path / "mc", tp, pp)
    assert json.loads((mc / convert.META).read_text())["model"]["family"] == "qwen3_vl"
    src, back = _load_all(tiny_qwen3vl), _load_all(convert.mcore_to_hf(mc, tmp_path / "hf"))
    assert set(src) == set(back) and any("deepstack_merger_list" in k for k in src)
    assert all(torch.equal(src[k], back[k]) for k in src), [k for k in src if not torch.equal(src[k], back[k])]
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == json.loads(
        (Path(tiny_qwen3vl) / "config.json").read_text())


def test_convert_round_trip_check_detects_a_swapped_deepstack_merger(tiny_qwen3vl, tmp_path):
    """Mutation: the megatron shards' two DeepStack mergers swapped; the export no longer equals the checkpoint."""
    mc = convert.hf_to_mcore(tiny_qwen3vl, tmp_path / "mc", 1, 1)
    f = mc / convert.rank_file(0, 0)
    state = torch.load(f)
    a, b = "vision.deepstack_mergers.0.fc1.weight", "vision.deepstack_mergers.1.fc1.weight"
    state[a], state[b] = state[b], state[a]
    torch.save(state, f)
    src, back = _load_all(tiny_qwen3vl), _load_all(convert.mcore_to_hf(mc, tmp_path / "hf"))
    assert [k for k in src if not torch.equal(src[k], back[k])] == [
        f"model.visual.deepstack_merger_list.{i}.linear_fc1.weight" for i in (0, 1)]


# The three modes (docs/design.md section 3: fp32, 1e-5) on the rendered task with two-frame videos: a Qwen3-VL prompt
# holds one placeholder span per frame (envs/motion.py reads the family's `video_run_per_frame`).
QWEN3_TASK = ["task.question=motion", "task.frames=4", "task.image_size=112", "workload.rollout_batch=16"]


def _mode_cfg(mode: str, hf: str, *extra):
    over = [o for o in BASE if not o.startswith(("model=", "workload.rollout_batch"))]
    return load_run_config(over + QWEN3_TASK + [f"mode.name={mode}", f"train.init_hf={hf}", *extra])


def rollplex_without_one_prefix_deepstack(cfg, steps: int) -> dict:
    """Mutation: the prefix stage (the rollout's prefill and rollplex's actor prefix) drops the last DeepStack
    level's injection; the full sequences keep it."""
    saved = drop_prefix_deepstack()
    try:
        return TW.run_steps(cfg, steps)
    finally:
        M.Qwen3VLModel.forward_prefix = saved


@pytest.fixture(scope="module")
def mode_runs(tiny_qwen3vl):
    """Three steps of each mode and one of the mutant, in one job, each on a Runtime of its own."""
    calls = {m: (TW.run_steps, (_mode_cfg(m, tiny_qwen3vl), 3)) for m in ("serial", "prefix_shared", "rollplex")}
    calls["drop"] = (rollplex_without_one_prefix_deepstack, (_mode_cfg("rollplex", tiny_qwen3vl), 1))
    return run_local(in_turn, 1, calls)[0]


def test_rendered_videos_are_one_span_per_frame(tiny_qwen3vl):
    cfg = _mode_cfg("serial", tiny_qwen3vl)
    cfg.model = registry.open_hf(tiny_qwen3vl).model_config()
    p = build_source(cfg).rows(0, 0, 1, 1)[0].prompt
    assert p.video_grid_thw.tolist() == [[2, 14, 14]]
    assert int((p.input_ids == cfg.model.vision_start_token_id).sum()) == 2
    pos = registry.model_spec(cfg.model).positions.prompt(cfg.model, p)
    assert pos.shape == (3, 1, p.input_ids.numel())


def _first_step_matches(run, ref) -> None:
    """The first step's rollout tokens equal, its loss, gradient norm and entropy within STEP1_TOL (the steps start
    from identical weights: the mechanism alone)."""
    assert run["tokens"][0] == ref["tokens"][0]
    for k in ("loss", "grad_norm", "entropy"):
        assert abs(run["records"][0][k] - ref["records"][0][k]) <= STEP1_TOL * abs(ref["records"][0][k]), k


@pytest.mark.parametrize("mode", ["prefix_shared", "rollplex"])
def test_modes_match_serial_over_three_steps(mode_runs, mode):
    run, ref = case(mode_runs, mode), case(mode_runs, "serial")
    _first_step_matches(run, ref)
    assert run["tokens"] == ref["tokens"]  # same rollouts every step
    _records_close(run["records"], ref["records"])
    assert ref["records"][-1]["kl"] > 1e-3 and any(r["reward_mean"] > 0 for r in ref["records"])
    err, name = _param_err(run, ref)
    assert err <= TOL, (name, err)


def test_mode_equivalence_detects_a_dropped_prefix_deepstack_injection(mode_runs):
    with pytest.raises(AssertionError):
        _first_step_matches(case(mode_runs, "drop"), case(mode_runs, "serial"))


# train-to-hf: a TP=2 Qwen3-VL run's checkpoint exported; the export re-sharded equals the trained shards bit for bit.
def test_train_to_hf_exports_the_trained_qwen3vl_actor(tiny_qwen3vl, tmp_path):
    run = tmp_path / "run"
    over = [o for o in BASE if not o.startswith(("model=", "workload."))]
    p = subprocess.run([sys.executable, "-m", "rollplex_megatron", "train", *over, *QWEN3_TASK[:3],
                        "workload.rollout_batch=8", "workload.responses_per_micro_batch=4", "train.progress=false",
                        "parallel.tp=2", "train.steps=1", f"train.init_hf={tiny_qwen3vl}", f"train.out={run}"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    out = convert.train_to_hf(run, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text()) == json.loads((Path(tiny_qwen3vl) / "config.json").read_text())
    exp = registry.open_hf(out)
    cfg = exp.model_config()
    ckdir = T.latest_checkpoint(run)
    for rank in range(2):
        state = torch.load(ckdir / T.rank_file_name(rank), map_location="cpu", weights_only=False)
        shards = registry.model_spec(cfg).hf.shard(exp, cfg, state["ranks"]["tp"], 2, 0, 1)
        assert set(shards) == {n for n in state["model"] if not n.endswith("_extra_state")}
        for name, t in shards.items():
            assert torch.equal(t, state["model"][name]), (rank, name)
    src = _load_all(tiny_qwen3vl)
    assert any(not torch.equal(exp.get(n), src[n]) for n in src)  # the step trained the exported weights
