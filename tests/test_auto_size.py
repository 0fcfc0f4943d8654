"""Fast by default (issue 53): the planner sizes what is left at auto (micro-batch, prefix packs, the kept decode
state) for a budget, counts serial's micro-batches with their prompts, names every setting that would make a refused
run fit, and the window's `auto` never picks a mechanism the table measured slower than no window (`after`).
Budgets here are fake (GiB figures taken from the planner itself), so no GPU is needed."""
import json

import pytest

from rollplex_megatron.config import AUTO_SIZE
from rollplex_megatron.memory import auto as A
from rollplex_megatron.memory import planner as M
from rollplex_megatron.memory import tensor_bytes as T
from rollplex_megatron.prefix.batch import pack_responses
from rollplex_megatron.recipes import load_run_config
from rollplex_megatron.rollout.window import DecodeWindow, policy_mechanism
from rollplex_megatron.rollout.window.policy import POLICY_PATH, build_policy

BASE = ["model=tiny", "workload.rollout_batch=32", "rollout.group_size=4", "train.reference=always"]
MB, PACK, KEEP = "workload.micro_batch_tokens", "workload.prefix_pack_tokens", "rollout.keep_decode_state"


def _shape(cfg):
    """8 prompts of 200 prefix tokens and 64 patches per rank, G=4, responses up to 64 tokens."""
    return M.workload_shape(cfg, 200, 64, 64, 200)


def _peak(cfg, s, mb, pack, keep):
    """The planner's peak (GiB) of `cfg` at these sizes, as auto sizing judges it."""
    return A.sized_summary(A.with_settings(M.runtime_cfg(cfg), {MB: mb, PACK: pack, KEEP: keep}), s)["peak_gib"]


def test_serial_micro_batches_under_a_token_budget_are_counted_with_their_prompts():
    """A response-token budget packs short responses in numbers, each carrying its whole prompt in serial: the plan
    holds what `pack_responses` really forms (the issue's `serial:tokens1024` passed the planner and ran out of
    memory); the response stage of rollplex carries no prompt and keeps its count."""
    budget = 64
    cfg = load_run_config([*BASE, "mode.name=serial", f"{MB}={budget}"])
    s = _shape(cfg)
    lens = [2] * s.samples  # short responses: the budget admits many of them
    largest = max(pack_responses(lens, cfg.workload.responses_per_micro_batch, budget), key=len)
    tokens, patches = sum(s.P + lens[i] for i in largest), len(largest) * s.patches
    m, norm, rope = cfg.model, M.norm_kernel(cfg), M.rope_kernel(cfg)
    serial = M.summarize(M.plan(cfg, "serial", "keep", "embedded", s), "serial")["classes"]
    assert len(largest) == 32 and s.mb == 1  # the shape's response count: 64 tokens of 64-token responses
    assert serial["update_activations"]["gib"] * M.GIB >= T.training_forward_bytes(m, 1, 1, False, tokens, patches,
                                                                                     norm, rope)
    assert serial["old_logp_workspace"]["gib"] * M.GIB >= T.score_logits_bytes(m, 1, tokens, M.logprob_kernel(cfg))
    rollplex = M.summarize(M.plan(cfg, "rollplex", "keep", "embedded", s), "rollplex")["classes"]
    assert rollplex["update_activations"]["gib"] * M.GIB == T.training_forward_bytes(
        m, 1, 1, False, s.mb * s.R, 0, norm, rope, M.logprob_kernel(cfg), cfg.param_bytes)


@pytest.mark.parametrize("kernel,dtype,per_logit", [("triton", "bfloat16", 4), ("triton", "float32", 8),
                                                     ("torch", "bfloat16", 10)])
def test_scoring_workspace_counts_the_log_prob_kernels_bytes(kernel, dtype, per_logit):
    """A forward-only scoring pass over packed rows holds the logits and their contiguous copy with the fused
    log-prob kernel (twice the compute dtype's bytes a logit; counted with torch's 10, the H100 video_long record's
    scoring phases were planned at 1.26-1.34 of their measured peaks), torch's fp32 copies without it; the update's
    response micro-batch (one packed row) counts the same loss workspace at its first backward op (the logits the
    kernel saved and their gradient; counted with 10, the Qwen3-VL-2B image_short record's update was planned at
    1.11 of its measured peak), and serial's whole sequences keep torch's 10."""
    cfg = load_run_config([*BASE, "mode.name=prefix_shared", f"{MB}=64", f"train.logprob_kernel={kernel}",
                           f"dtype={dtype}"])
    s = _shape(cfg)
    classes = M.summarize(M.plan(cfg, "prefix_shared", "keep", "embedded", s), "prefix_shared")["classes"]
    tokens, v = s.mb * s.R, cfg.model.padded_vocab_size(1)  # the logits' width: the vocabulary padded as megatron does
    assert v > cfg.model.vocab_size  # the tiny model's 320 entries padded to 384: the padding is counted
    for ph in ("old_logp", "ref_logp"):
        assert classes[f"{ph}_workspace"]["gib"] * M.GIB == tokens * v * per_logit
    norm, rope = M.norm_kernel(cfg), M.rope_kernel(cfg)
    no_loss = T.training_forward_bytes(cfg.model, 1, 1, False, tokens, 0, norm, rope) - T.logits_bytes(cfg.model, 1,
                                                                                                        tokens)
    assert classes["update_activations"]["gib"] * M.GIB == no_loss + tokens * v * per_logit
    serial = M.summarize(M.plan(cfg, "serial", "keep", "embedded", s), "serial")["classes"]
    mb = M.full_sequence_responses(cfg, s)
    assert serial["update_activations"]["gib"] * M.GIB == T.training_forward_bytes(
        cfg.model, 1, 1, False, mb * (s.P + s.R), mb * s.patches, norm, rope)  # torch's 10 a logit, any kernel


def test_auto_size_takes_the_largest_that_fits_giving_up_the_decode_state_then_packs_then_the_micro_batch():
    """Candidates largest first: micro-batches of R x 2^k response tokens up to the largest mini-batch's, packs of
    P x 2^k prefix tokens down to two groups then none, the decode state kept or not. Each budget below is the peak
    of one candidate; the one chosen is the first that fits with the kept decode state given up first, then the
    packs, then the micro-batch."""
    cfg = load_run_config(BASE)
    s = _shape(cfg)
    assert (cfg.workload.micro_batch_tokens, cfg.workload.prefix_pack_tokens, cfg.rollout.keep_decode_state) == \
        (AUTO_SIZE, AUTO_SIZE, None)  # the defaults are auto
    steps, mbs, packs, keeps = A.size_candidates(cfg, s)
    assert [c["memory.optimizer_step"] for c in steps] == ["resident", "stream"]
    assert [c[MB] for c in mbs] == [2048, 1024, 512, 256, 128, 64]
    assert [c[PACK] for c in packs] == [1600, 800, 400, 0] and [c[KEEP] for c in keeps] == [True, False]
    for want, why in [((2048, 1600, True), "everything at its largest"),
                      ((2048, 1600, False), "the kept decode state gives way first"),
                      ((1024, 1600, True), "packs do not help the largest micro-batch: it halves, state kept"),
                      ((1024, 800, True), "the pack halves before the micro-batch does"),
                      ((512, 800, False), "all three given up in turn")]:
        budget = _peak(cfg, s, *want)
        sized, chosen = A.auto_size(cfg, s, budget)
        got = (chosen[MB], chosen[PACK], chosen[KEEP])
        assert got == want, why
        assert (sized.workload.micro_batch_tokens, sized.workload.prefix_pack_tokens,
                sized.rollout.keep_decode_state) == want and chosen["budget_gib"] == budget
    with pytest.raises(ValueError, match=r"at its smallest auto sizes .*to fit: more GPUs"):
        A.auto_size(cfg, s, _peak(cfg, s, 64, 0, False) * 0.9)


def test_the_optimizer_step_streams_only_where_no_resident_size_fits():
    """`memory.optimizer_step=auto`: the 3B model's optimizer phase (bf16 weights, fp32 masters, Adam's states,
    gradients, Adam's workspace: ~77 GiB resident) is over a 60 GiB budget at every size, so auto streams it and
    keeps the largest sizes; with room it stays resident. A run that sets `resident` is told the stream fits."""
    cfg = load_run_config([*BASE, "model=qwen2_5_vl_3b"])
    s = _shape(cfg)
    resident = A.with_settings(M.runtime_cfg(cfg), {MB: 64, PACK: 0, KEEP: False, "memory.optimizer_step": "resident"})
    assert A.sized_summary(resident, s)["phase_gib"]["optimizer"] > 60  # not even the smallest sizes fit
    sized, chosen = A.auto_size(cfg, s, 60.0)
    assert chosen["memory.optimizer_step"] == "stream" and sized.memory.optimizer_step == "stream"
    assert (chosen[MB], chosen[PACK], chosen[KEEP]) == (2048, 1600, True)  # the stream frees room for everything
    assert A.auto_size(cfg, s, 1e6)[1]["memory.optimizer_step"] == "resident"
    assert A.auto_size(cfg, None, None)[0].memory.optimizer_step == "resident"  # no device: resident, as before
    set_resident = load_run_config([*BASE, "model=qwen2_5_vl_3b", "memory.optimizer_step=resident", f"{MB}=512",
                                    f"{PACK}=0", "rollout.keep_decode_state=false", "memory.plan=phase"])
    assert "memory.optimizer_step=stream" in A.fit_fixes(set_resident, s, 60.0)


def test_auto_size_without_a_device_keeps_the_fixed_values_and_leaves_set_sizes_alone():
    """No budget (CPU): auto is today's 0, 0, false, so every CPU run computes what it did. A size the user set
    is neither tried nor recorded; serial sizes by count (its micro-batches carry their prompts)."""
    cfg = load_run_config(BASE)
    sized, chosen = A.auto_size(cfg, None, None)
    assert chosen == {**A.NO_DEVICE_SIZES, "budget_gib": None}
    assert sized == A.with_settings(cfg, A.NO_DEVICE_SIZES) and not sized.auto_sized
    set_keep = load_run_config([*BASE, "rollout.keep_decode_state=false", f"{PACK}=0"])
    s = _shape(set_keep)
    _, chosen = A.auto_size(set_keep, s, 1e6)
    assert chosen == {MB: 2048, "memory.optimizer_step": "resident", "budget_gib": 1e6}
    fixed = A.with_settings(set_keep, {MB: 0, "memory.optimizer_step": "resident"})
    assert A.auto_size(fixed, s, 1e6) == (fixed, {})
    serial = load_run_config([*BASE, "mode.name=serial", "workload.responses_per_micro_batch=8",
                              "rollout.keep_decode_state=false", f"{PACK}=0"])
    counts = {n: A.sized_summary(A.with_settings(M.runtime_cfg(serial), {MB: 0, "workload.responses_per_micro_batch":
                                                                         n}), s)["peak_gib"] for n in (8, 4, 2)}
    assert counts[8] > counts[4] > counts[2]
    _, chosen = A.auto_size(serial, s, counts[4])
    assert chosen == {MB: 0, "workload.responses_per_micro_batch": 4, "memory.optimizer_step": "resident",
                      "budget_gib": counts[4]}


def test_a_refusal_names_the_kept_decode_state_when_dropping_it_makes_the_run_fit():
    """The issue's refusal said "a larger parallel.tp/pp" on one GPU; now each setting that alone makes the run fit
    is named (the kept decode state, a smaller pack at its largest that fits), and a larger layout only where this
    machine has more GPUs."""
    sizes = [f"{MB}=512", f"{PACK}=800", "rollout.keep_decode_state=true"]
    cfg = load_run_config([*BASE, *sizes])
    s = _shape(cfg)
    budget = _peak(cfg, s, 512, 800, False)
    assert _peak(cfg, s, 512, 800, True) > budget >= _peak(cfg, s, 512, 400, True)
    assert _peak(cfg, s, 256, 800, True) > budget  # a smaller micro-batch alone does not fit
    with pytest.raises(ValueError) as e:
        A.auto_release(cfg, s, budget)
    msg = str(e.value)
    assert msg.endswith("to fit: rollout.keep_decode_state=false, or workload.prefix_pack_tokens=400"), msg
    with pytest.raises(ValueError, match=r"prefix_pack_tokens=400, or a larger parallel.tp/pp \(2 GPUs here\)$"):
        A.auto_release(cfg, s, budget, gpus=2)
    keep = load_run_config([*BASE, *sizes, "memory.plan=keep"])
    assert "memory.plan=auto" in A.fit_fixes(keep, s, _peak(cfg, s, 512, 800, True))


def test_window_auto_is_never_slower_than_after():
    """`after` (decode, then the items: measured, or decode alone plus the items alone) is a candidate of the
    measured table and the reference a window must beat by the margin; a CPU run keeps interleave."""
    def row(case, batch, **walls):
        return {"case": case, "batch": batch, "decode_alone": {"after_prefill_s": 1.0}, "items_alone_s": 1.0,
                "mechanisms": {k: {"after_prefill_s": v} for k, v in walls.items()}}

    table = build_policy({"rows": [row("uniform_b128", 128, interleave=2.2, stream=2.1, tail=2.3),
                                   row("longtail_b64", 64, interleave=1.9, stream=1.7, after=1.6),
                                   row("uniform_b16", 16, interleave=2.1, stream=1.5)]}, "x.json")
    assert [(r["mechanism"], r["wall_s"]["after"]) for r in table["rows"]] == [("after", 2.0), ("after", 1.6),
                                                                                 ("stream", 2.0)]
    shipped = json.loads(POLICY_PATH.read_text())
    for r in shipped["rows"]:  # the table auto reads: its choice is never slower than no window
        chosen = r["mechanism"] + (f":{r['green_sms']}" if r["green_sms"] else "")
        assert r["wall_s"][chosen] <= r["wall_s"]["after"], r["case"]
        window = DecodeWindow("auto")
        window.on_wave(r["batch"])
        assert window._resolved == r["mechanism"] == policy_mechanism(r["batch"])[0]
    cfg = load_run_config(BASE)
    assert cfg.mode.window == "auto" and DecodeWindow.from_config(cfg.mode, cfg.parallel).mechanism == "interleave"


def test_the_allocator_cap_is_checked_before_any_model(monkeypatch):
    """memory.cap_gib: negative refused by the config; on a machine without a GPU refused in one line naming it; on a
    GPU, a cap over the card refused and a cap under it set as the allocator's fraction of the card (the device
    calls stubbed here; tests/test_gpu_planner_edge.py runs a real one, with a cap that must stop a run)."""
    from rollplex_megatron.recipes import load_run_config
    from rollplex_megatron.trainer import runtime

    with pytest.raises(ValueError, match=r"memory.cap_gib must be >= 0"):
        load_run_config(["memory.cap_gib=-1"])
    runtime.cap_allocator(0)  # no cap: nothing asked of the device
    with pytest.raises(ValueError, match=r"memory.cap_gib=3 caps a GPU's allocator and this run has no GPU"):
        runtime.cap_allocator(3)
    fractions = []
    monkeypatch.setattr(runtime.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runtime.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(runtime.torch.cuda, "get_device_properties",
                        lambda d: type("P", (), {"total_memory": 80 * 2**30})())
    monkeypatch.setattr(runtime.torch.cuda, "set_per_process_memory_fraction", fractions.append)
    with pytest.raises(ValueError, match=r"memory.cap_gib=81 is more than this GPU's 80.0 GiB"):
        runtime.cap_allocator(81)
    runtime.cap_allocator(60)
    assert fractions == [0.75]


def test_a_cap_under_the_plans_peak_is_refused_by_the_planner(capsys):
    """memory.cap_gib under the plan's peak: `run_plan` (what `train` runs before any model) and `plan-memory` refuse
    it in one line naming the peak's phase and the fixes; a cap at the peak or over passes. Mutation: without the
    check the same cap plans."""
    from rollplex_megatron.cli import main
    from rollplex_megatron.data import build_source
    from rollplex_megatron.recipes import load_run_config
    from rollplex_megatron.trainer.runtime import run_plan

    cfg = load_run_config([])
    peak = run_plan(cfg, build_source(cfg))[1]["peak_gib"]
    low = load_run_config([f"memory.cap_gib={peak * 0.9:.6g}"])
    with pytest.raises(ValueError, match=r"^memory.cap_gib=\S+ is under the rollplex plan's peak of \S+ GiB \(phase "
                                         r"'\w+'\), so the run would stop out of memory there; raise the cap"):
        run_plan(low, build_source(low))
    ok = load_run_config([f"memory.cap_gib={peak * 1.01:.6g}"])
    assert run_plan(ok, build_source(ok))[1]["peak_gib"] == peak
    assert main(["plan-memory", "memory.cap_gib=0.0001"]) == 1
    err = capsys.readouterr().err
    assert "memory.cap_gib=0.0001 is under the rollplex plan's peak" in err and err.count("\n") == 1
    with pytest.MonkeyPatch.context() as mp:
        from rollplex_megatron.trainer import runtime
        mp.setattr(runtime, "check_cap", lambda *a: None)
        run_plan(low, build_source(low))
