"""Workers for the verl plugin tests (importable for spawn): the registered engine driven with verl batches.

The batch is verl's engine layout built by verl's own `list_of_dict_to_tensordict` from per-sample dicts, as
verl's v1 agent loop stores them (prompts, responses, input_ids, masks, multi_modal_inputs, uid), plus the loss
inputs verl's trainer adds (old_log_probs, ref_log_prob, advantages) and its meta keys. The loss is verl's own
`ppo_loss` under an `McoreActorConfig`.
"""
from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import torch

from tests.numerics import rel_err


def verl_batch(model_cfg, seed: int, groups: int = 3, g: int = 3, mismatched_uid: bool = False, temperature=0.7,
               rows_out: list | None = None, keep=None):
    """A verl engine batch: `groups` prompts (image + video) x `g` responses of random lengths. With
    `mismatched_uid`, the last uid's rows carry different prompts (verl's uid would be wrong). `rows_out`
    receives the per-sample dicts; `keep(i)` selects samples (a DP rank's share)."""
    from verl.utils import tensordict_utils as tu

    from rollplex_megatron.verify.parity import synthetic_inputs

    gen = torch.Generator().manual_seed(seed)
    text_hi = min(model_cfg.vocab_size, model_cfg.image_token_id, model_cfg.video_token_id,
                  model_cfg.vision_start_token_id, model_cfg.vision_end_token_id)
    rows = []
    for gi in range(groups):
        x = synthetic_inputs(model_cfg, seed * 100 + gi, 1, (1, 4, 4), (2, 4, 4), 5 + gi)
        for ri in range(g):
            if mismatched_uid and gi == groups - 1 and ri > 0:  # same uid, another prompt
                x = synthetic_inputs(model_cfg, seed * 100 + 50 + ri, 1, (1, 4, 4), (2, 4, 4), 5 + gi)
            prompt = x["input_ids"][0]
            n = int(torch.randint(2, 9, (1,), generator=gen))
            resp = torch.randint(0, text_hi, (n,), generator=gen)
            adv = float(torch.randn(1, generator=gen))
            rows.append({
                "prompts": prompt, "responses": resp, "input_ids": torch.cat([prompt, resp]),
                "attention_mask": torch.ones(prompt.numel() + n, dtype=torch.int64),
                "response_mask": torch.ones(n, dtype=torch.int64), "loss_mask": torch.ones(n, dtype=torch.int64),
                "old_log_probs": -3.0 + 0.5 * torch.randn(n, generator=gen),
                "ref_log_prob": -3.0 + 0.5 * torch.randn(n, generator=gen),
                "advantages": torch.full((n,), adv),
                "multi_modal_inputs": {**{k: x[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos",
                                                            "video_grid_thw", "second_per_grid_ts")},
                                       "images_seqlens": x["image_grid_thw"].prod(-1)},  # verl's agent loop adds it
                "uid": f"prompt-{gi}",
            })
    if keep is not None:
        rows = [r for i, r in enumerate(rows) if keep(i)]
    if rows_out is not None:
        rows_out.extend(rows)
    data = tu.list_of_dict_to_tensordict(rows)
    tu.assign_non_tensor(data, temperature=temperature, global_batch_size=len(rows), micro_batch_size_per_gpu=4,
                         calculate_entropy=True)
    return data


def actor_config():
    from verl.workers.config import McoreActorConfig

    return McoreActorConfig(strategy="megatron", ppo_mini_batch_size=9, ppo_micro_batch_size_per_gpu=4, rollout_n=3,
                            use_dynamic_bsz=False, loss_agg_mode="token-mean", entropy_coeff=0.01, use_kl_loss=True,
                            kl_loss_coef=0.1, kl_loss_type="low_var_kl")


def new_engine(hf_dir: str, tp: int, share_prefix: bool, forward_only: bool = False, attention: str | None = None):
    """The engine verl's worker would build: `EngineRegistry.new` with verl's own config classes."""
    from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig
    from verl.workers.engine.base import EngineRegistry

    engine = EngineRegistry.new(
        model_type="language_model", backend="megatron",
        model_config=HFModelConfig(path=hf_dir, load_tokenizer=False),
        engine_config=McoreEngineConfig(strategy="megatron", tensor_model_parallel_size=tp,
                                        forward_only=forward_only, use_distributed_optimizer=False,
                                        sequence_parallel=False),
        optimizer_config=McoreOptimizerConfig(lr=1e-2, weight_decay=0.0, clip_grad=1e6, total_training_steps=2),
        checkpoint_config=None, share_prefix=share_prefix, dtype="float32", attention=attention)
    engine.initialize()
    return engine


def _grads(engine) -> dict:
    return {n: p.main_grad.detach().clone() for n, p in engine.ddp.module.named_parameters() if p.requires_grad}


def shared_vs_full(hf_dir: str, tp: int, mutation: str = "", mismatched_uid: bool = False,
                   attention: str | None = None) -> dict:
    """The same verl batch through the engine with the prefix shared and with full sequences (this project's
    serial path): log-probs and entropy (infer_batch), loss, gradients and megatron's gradient norm (the
    optimizer step's global norm), as relative errors. `mutation="trust_uid"`: the engine groups by uid without
    checking that the rows share the prompt, on a batch whose last uid is wrong."""
    os.environ["VERL_ENGINE_VENDOR"] = "rollplex"
    import verl  # noqa: F401  (loads the plugin through its entry point)
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    from rollplex_megatron.integrations.verl import batch as B
    from rollplex_megatron.models.registry import open_hf

    if mutation == "trust_uid":
        B.same_prompt = lambda a, b: True
    cfg = open_hf(hf_dir).model_config()  # the checkpoint's family (tests/verl_qwen3vl_workers.py: Qwen3-VL)
    engines = {k: new_engine(hf_dir, tp, share_prefix=(k == "shared"), attention=attention if k == "shared" else None)
               for k in ("shared", "full")}  # `attention`: the shared engine's (the full one keeps the default)
    out = {"engine": type(engines["shared"]).__name__, "rel": {}}
    infer, loss, grads, params, infer_resp, whole_loss = {}, {}, {}, {}, {}, {}
    loss_fn = partial(ppo_loss, config=actor_config())
    for k, e in engines.items():
        with e.eval_mode():
            o = e.infer_batch(verl_batch(cfg, 7, mismatched_uid=mismatched_uid))
        infer[k] = {n: t.values() for n, t in o["model_output"].items()}
        batch = verl_batch(cfg, 7, mismatched_uid=mismatched_uid)  # verl's own slicing of the outputs
        resp = no_padding_2_padding(o["model_output"]["log_probs"], batch)
        infer_resp[k] = [resp[i, :n] for i, n in enumerate(batch["responses"].offsets().diff().tolist())]
        if k == "full":  # the same weights, before this engine's optimizer step
            direct = _direct_logp(e, cfg, mismatched_uid)
        with e.train_mode():
            e.optimizer_zero_grad()
            o = e.forward_backward_batch(verl_batch(cfg, 7, mismatched_uid=mismatched_uid), loss_fn)
            loss[k] = torch.tensor(o["loss"]).sum()
            whole = verl_batch(cfg, 7, mismatched_uid=mismatched_uid)  # verl's loss over the whole batch at once
            tu.assign_non_tensor(whole, dp_size=1, batch_num_tokens=int(whole["loss_mask"].values().sum()))
            with torch.no_grad():
                whole_loss[k] = loss_fn(model_output=dict(o["model_output"]), data=whole)[0].detach()
            grads[k] = _grads(e)
            out["metrics_" + k] = sorted(o["metrics"])
            params[k] = torch.tensor(e.optimizer_step())  # megatron's grad norm (the clip is far above it)
            out["lens_" + k] = [int(t.numel()) for t in o["model_output"]["log_probs"].unbind()]
    out["rel"]["log_probs_vs_direct"] = rel_err(torch.cat(infer_resp["shared"]), torch.cat(direct))
    out["rel"]["loss_vs_whole_batch_ppo_loss"] = rel_err(loss["shared"], whole_loss["shared"])
    s, f = "shared", "full"
    out["rel"]["log_probs"] = rel_err(infer[s]["log_probs"], infer[f]["log_probs"])
    out["rel"]["entropy"] = rel_err(infer[s]["entropy"], infer[f]["entropy"])
    out["rel"]["loss"] = rel_err(loss[s], loss[f])
    errs = {n: rel_err(grads[s][n], grads[f][n]) for n in grads[f]}
    out["rel"]["grad"] = max(errs.values())
    out["worst_grad_param"] = max(errs, key=errs.get)
    out["rel"]["optimizer_grad_norm"] = rel_err(params[s], params[f])
    out["grad_norm"] = float(torch.stack([g.norm() for g in grads[f].values()]).norm())
    out["full_groups"] = len(B.verl_groups(verl_batch(cfg, 7, mismatched_uid=mismatched_uid)).full)
    return out


def exported_weights(hf_dir: str, tp: int) -> dict:
    """`get_per_tensor_param` (verl's weight sync) at TP `tp` equals the HF checkpoint it was loaded from."""
    os.environ["VERL_ENGINE_VENDOR"] = "rollplex"
    import verl  # noqa: F401

    from rollplex_megatron.models.qwen25vl.hf import HFCheckpoint

    ckpt = HFCheckpoint(hf_dir)
    e = new_engine(hf_dir, tp, share_prefix=True, forward_only=True)
    gen, peft = e.get_per_tensor_param()
    names, worst = set(), 0.0
    for name, t in gen:
        names.add(name)
        worst = max(worst, float((t.float() - ckpt.get(name).float()).abs().max()))
    return {"names": len(names), "missing": sorted(ckpt.keys() - names)[:5], "max_abs": worst, "peft": peft}


def _direct_logp(engine, cfg, mismatched_uid: bool) -> list:
    """Per-response log-probs by this project's serial path, outside the engine: each sample its own group,
    full-sequence micro-batches through `full_sequence_step`, the scoring loss at the batch's temperature with the
    vision placeholders out of the softmax (the trainer's `score_loss`: the sampled policy's log-probs)."""
    from megatron.core import parallel_state as ps

    from rollplex_megatron.prefix import execution as X
    from rollplex_megatron.prefix.batch import Group, Prompt, full_micro_batches

    rows: list = []
    verl_batch(cfg, 7, mismatched_uid=mismatched_uid, rows_out=rows)
    groups = [Group(Prompt(r["prompts"], **{k: v for k, v in r["multi_modal_inputs"].items()
                                           if k != "images_seqlens"}), [r["responses"]], torch.zeros(1))
              for r in rows]
    mbs = full_micro_batches(cfg, groups, 1, 1)
    score = partial(X.logprob_loss, temperature=0.7, banned=cfg.vision_token_ids,
                    tp_rank=ps.get_tensor_model_parallel_rank(), tp_group=ps.get_tensor_model_parallel_group())
    with torch.no_grad():
        res = X.full_sequence_step(engine.module, mbs, forward_only=True, loss_fn=score)
    per = X.per_response(res, mbs, groups)
    return [per[(i, 0)] for i in range(len(groups))]


def dp_grads(hf_dir: str) -> dict:
    """Gradients of one update at DP = world size (TP 1): each DP rank takes its share of the uids, as verl's
    dispatch gives it; megatron's DDP reduces them (the engine's loss / dp_size under a summing DDP)."""
    os.environ["VERL_ENGINE_VENDOR"] = "rollplex"
    import verl  # noqa: F401
    import torch.distributed as dist
    from verl.workers.utils.losses import ppo_loss

    from rollplex_megatron.models.qwen25vl.hf import HFCheckpoint

    cfg = HFCheckpoint(hf_dir).model_config()
    e = new_engine(hf_dir, 1, share_prefix=True)
    world, rank = dist.get_world_size(), dist.get_rank()
    data = verl_batch(cfg, 11, groups=4, keep=lambda i: (i // 3) % world == rank)  # whole groups per rank
    with e.train_mode(zero_grad_on_exit=False):
        e.optimizer_zero_grad()
        e.forward_backward_batch(data, partial(ppo_loss, config=actor_config()))
    return {"world": world, "grads": {n: g.cpu() for n, g in _grads(e).items()}}


def checkpoint_round_trip(hf_dir: str, root: str) -> dict:
    """Two optimizer steps straight through, against: one step, `save_checkpoint`, a fresh engine that
    `load_checkpoint`s it, then the second step. Mutations: the second step on a fresh engine given only the
    checkpoint's weights (no Adam moments, no schedule), and on a fresh engine from the HF weights. Also:
    saving a step that exists is refused, and `max_ckpt_to_keep` removes the older step's tree."""
    os.environ["VERL_ENGINE_VENDOR"] = "rollplex"
    import verl  # noqa: F401
    from verl.workers.utils.losses import ppo_loss

    from rollplex_megatron.checkpoint import train_state
    from rollplex_megatron.models.qwen25vl.hf import HFCheckpoint

    cfg = HFCheckpoint(hf_dir).model_config()
    loss_fn = partial(ppo_loss, config=actor_config())

    def step(e, seed):
        with e.train_mode():
            e.optimizer_zero_grad()
            e.forward_backward_batch(verl_batch(cfg, seed), loss_fn)
            e.optimizer_step()
        return e.lr_scheduler_step()

    def params(e):
        return {n: p.detach().clone() for n, p in e.module.module.named_parameters()}

    first = f"{root}/global_step_1/actor"
    a = new_engine(hf_dir, 1, True)
    step(a, 7)
    saved = a.save_checkpoint(first, global_step=1, max_ckpt_to_keep=1)
    out = {"saved": str(saved)}
    try:
        a.save_checkpoint(first, global_step=1)
        out["overwrite"] = "no error"
    except Exception as e:  # noqa: BLE001 - the test reads the message
        out["overwrite"] = f"{type(e).__name__}: {e}"
    lr_a = step(a, 8)
    b = new_engine(hf_dir, 1, True)
    out["loaded"] = str(b.load_checkpoint(first))
    lr_b = step(b, 8)
    weights_only = new_engine(hf_dir, 1, True)
    state = torch.load(f"{saved}/{train_state.rank_file_name(0)}", map_location="cpu", weights_only=False)
    weights_only.module.module.load_state_dict(state["model"])
    step(weights_only, 8)
    fresh = new_engine(hf_dir, 1, True)
    step(fresh, 8)
    pa = params(a)
    rel = lambda e: max(rel_err(params(e)[n], pa[n]) for n in pa)  # noqa: E731
    out.update(rel_loaded=rel(b), rel_weights_only=rel(weights_only), rel_fresh=rel(fresh), lr=[lr_a, lr_b])
    a.save_checkpoint(f"{root}/global_step_2/actor", global_step=2, max_ckpt_to_keep=1)
    out["kept"] = sorted(str(p.relative_to(root)) for p in Path(root).rglob("step_*"))
    return out


def dynamic_vs_count(hf_dir: str, budget: int = 7) -> dict:
    """One engine, the same batch twice: packed by count (micro_batch_size_per_gpu=4) and under verl's dynamic
    batch size (max_token_len_per_gpu=`budget` response tokens per response-stage micro-batch): log-probs, the
    per-micro-batch losses' sum and every gradient as relative errors, and both packings."""
    os.environ["VERL_ENGINE_VENDOR"] = "rollplex"
    import verl  # noqa: F401
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    from rollplex_megatron.models.qwen25vl.hf import HFCheckpoint

    cfg = HFCheckpoint(hf_dir).model_config()
    e = new_engine(hf_dir, 1, share_prefix=True)
    loss_fn = partial(ppo_loss, config=actor_config())
    from rollplex_megatron.prefix import batch as PB
    from tests.trainer_workers import _twice_overflow

    got, packer = {}, PB.pack_responses
    for kind in ("count", "dynamic", "twice_overflow"):  # the last: a packer that packs a response twice
        batch = verl_batch(cfg, 7)  # shared_vs_full's batch (its gradient is not zero: asserted below)
        if kind != "count":
            tu.assign_non_tensor(batch, use_dynamic_bsz=True, max_token_len_per_gpu=budget)
        PB.pack_responses = packer if kind != "twice_overflow" else (  # under the budget only
            lambda lens, per, mt=0: _twice_overflow(lens, per, mt) if mt > 0 else packer(lens, per, mt))
        try:
            with e.train_mode():  # the gradients are read inside it (leaving it zeroes them)
                e.optimizer_zero_grad()
                o = e.forward_backward_batch(batch, loss_fn)
                grads = _grads(e)
        finally:
            PB.pack_responses = packer
        got[kind] = {"logp": o["model_output"]["log_probs"].values().detach().clone(),
                     "loss": torch.tensor(o["loss"]).sum(), "grads": grads, "packing": dict(e.last_packing),
                     "lens": [int(n) for n in batch["responses"].offsets().diff().tolist()]}
    c, d, m = got["count"], got["dynamic"], got["twice_overflow"]
    return {"logp": rel_err(d["logp"], c["logp"]), "loss": rel_err(d["loss"], c["loss"]),
            "grad": max(rel_err(d["grads"][n], c["grads"][n]) for n in c["grads"]),
            "mutant_grad": max(rel_err(m["grads"][n], c["grads"][n]) for n in c["grads"]),
            "grad_norm": float(torch.stack([t.norm() for t in c["grads"].values()]).norm()),
            "count_packing": c["packing"], "dynamic_packing": d["packing"], "lens": c["lens"], "budget": budget}


def tp1_cases(hf_dir: str) -> dict:
    """The TP 1 runs of the tests in one process, one after another (each builds its own engines from the
    checkpoint): `shared_vs_full` on a well-formed batch, on a batch with a wrong uid, then (last: it patches
    the prefix grouping) with the engine trusting that uid; and `dp_grads` on one rank."""
    from rollplex_megatron.integrations.verl import batch as B

    out = {"plain": shared_vs_full(hf_dir, 1), "wrong_uid": shared_vs_full(hf_dir, 1, "", True),
           "split": shared_vs_full(hf_dir, 1, attention="split"),
           "dp_one": dp_grads(hf_dir), "dynamic": dynamic_vs_count(hf_dir)}
    same_prompt = B.same_prompt
    try:
        out["trust_uid"] = shared_vs_full(hf_dir, 1, "trust_uid", True)
    finally:
        B.same_prompt = same_prompt
    return out


def tp2_cases(hf_dir: str) -> dict:
    """The TP 2 runs of the tests in one 2-rank job: `shared_vs_full` and `exported_weights`."""
    return {"shared_vs_full": shared_vs_full(hf_dir, 2), "exported": exported_weights(hf_dir, 2)}


def window_cases(hf_dir: str, root: str) -> dict:
    """The decode window under verl, against a stand-in SGLang scheduler (`tests/sglang_workers.py`) that finds
    this rank through a rendezvous directory: the reference engine's log-probs with each group's prefix K/V from
    the window equal those it computes itself; a job whose prompt is not the batch's (same uid and shapes, other
    ids and pixels) is caught by the prompt check (its prefix runs again) and, with the check disabled
    (mutation), gives other log-probs."""
    import multiprocessing as mp

    os.environ["VERL_ENGINE_VENDOR"] = "rollplex"
    import verl  # noqa: F401  (loads the plugin through its entry point)
    from verl.utils import tensordict_utils as tu

    from rollplex_megatron.integrations.verl import window as Wn
    from rollplex_megatron.integrations.verl.worker import open_window, prompts_of
    from rollplex_megatron.models.qwen25vl.hf import HFCheckpoint
    from rollplex_megatron.rollout.sglang import protocol as P
    from tests.sglang_workers import scheduler_main, scheduler_outcome

    cfg = HFCheckpoint(hf_dir).model_config()
    env = {P.ENV_ADDRESS: f"{P.RENDEZVOUS}{root}"}
    engine = new_engine(hf_dir, 1, share_prefix=True, forward_only=True)
    window = open_window(engine, Path(root))
    ctx = mp.get_context("spawn")
    report = ctx.Queue()
    proc = ctx.Process(target=scheduler_main, args=(env, 4, 0.01, "", report), daemon=True)
    proc.start()
    rows: list = []
    verl_batch(cfg, 7, rows_out=rows)
    firsts = {}
    for r in rows:  # one stored sample per uid, as the trainer hands them out (the first finished)
        firsts.setdefault(r["uid"], r)
    uids = list(firsts)
    stored = prompts_of(tu.list_of_dict_to_tensordict(list(firsts.values())), uids)

    def logp(mutate: bool = False):
        same = Wn.same_prompt
        if mutate:
            Wn.same_prompt = lambda a, b: True
        try:
            with engine.eval_mode():
                o = engine.infer_batch(verl_batch(cfg, 7))
        finally:
            Wn.same_prompt = same
        return o["model_output"]["log_probs"].values(), dict(engine.last_window)

    out = {}
    try:
        # the reference phase comes after a whole rollout, by when SGLang's scheduler has connected
        out["connected"] = window.connected.wait(120)
        window.submit({u: stored[u] for u in uids[:2]})  # two bridge steps, as prompts finish over the rollout
        window.submit({u: stored[u] for u in uids[2:]})
        got, out["window"] = logp()
        engine.window = None
        want, _ = logp()
        engine.window = window
        out["rel"] = rel_err(got, want)
        others: list = []  # the same uids and shapes, other token ids and pixels (another seed's prompts)
        verl_batch(cfg, 8, rows_out=others)
        other = prompts_of(tu.list_of_dict_to_tensordict([others[0]]), [uids[0]])[uids[0]]
        assert other.input_ids.shape == stored[uids[0]].input_ids.shape
        wrong = {uids[0]: other, uids[1]: stored[uids[1]], uids[2]: stored[uids[2]]}
        window.submit(wrong)
        got, out["wrong_window"] = logp()
        out["rel_wrong"] = rel_err(got, want)
        window.submit(wrong)
        got, out["trusted_window"] = logp(mutate=True)
        out["rel_trusted"] = rel_err(got, want)
        window.submit({"never-scored": stored[uids[0]]})  # e.g. a group dynamic sampling drops
        out["unclaimed"] = (window.take(set()), window.dropped, len(window.received))
        out["steps"] = window.steps
        out["published"] = sorted(p.name for p in Path(root).iterdir())
        out["slot"] = window.slot
        os.environ[Wn.ENV_MECHANISM] = "sideways"
        try:
            Wn.RefWindow(window.model, cfg, "float32", {}, Path(root) / "bad")
        except ValueError as e:
            out["bad_mechanism"] = str(e)
        os.environ[Wn.ENV_MECHANISM] = "after"  # every job once SGLang idles: the control without a window
        lonely = Wn.RefWindow(window.model, cfg, "float32", {}, Path(root) / "nobody")
        out["lonely_mechanism"] = lonely.mechanism["mechanism"]
        del os.environ[Wn.ENV_MECHANISM]
        lonely.submit({uids[0]: stored[uids[0]]})  # no scheduler ever connects
        try:
            lonely.take({uids[0]})
        except RuntimeError as e:
            out["lonely_error"] = str(e)
        lonely.close()
        out["lonely_file_left"] = lonely.path.exists()
    finally:
        window.close()
    out.update(scheduler_outcome(proc, report, 60))
    return out
