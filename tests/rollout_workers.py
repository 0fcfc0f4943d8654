"""Worker functions for the rollout tests (importable for spawn): engine vs a plain recompute loop."""
from __future__ import annotations

import torch


def _setup(cfg, hf_dir, dtype: str = "float32"):
    from megatron.core import parallel_state as ps

    from rollplex_megatron.models.qwen25vl.hf import HFCheckpoint, load_hf_into_model
    from rollplex_megatron.dist import init_parallel
    from rollplex_megatron.models.qwen25vl import build_model

    ck = HFCheckpoint(hf_dir)
    cfg.model = ck.model_config()
    init_parallel(cfg.parallel.tp, cfg.parallel.pp, cfg.seed)
    model = build_model(cfg.model, dtype)
    load_hf_into_model(model, ck, cfg.model, ps.get_tensor_model_parallel_rank(), cfg.parallel.tp,
                       ps.get_pipeline_model_parallel_rank(), cfg.parallel.pp)
    return model


def requests(cfg, n_req: int = 3, seed: int = 5):
    """Requests with image and video prompts of different lengths, G and limits; stop tokens included."""
    from rollplex_megatron.verify.equivalence import random_groups
    from rollplex_megatron.rollout.engine import RolloutRequest

    cfg.verify.groups_per_rank = n_req
    cfg.verify.seed = seed
    groups = random_groups(cfg, 0)
    stops = tuple(range(20, 60))  # about an eighth of the tiny vocabulary: some samples stop early
    return [RolloutRequest(g.prompt, n=2 + i, max_new_tokens=3 + 2 * i, stop_token_ids=stops, seed=100 + i)
            for i, g in enumerate(groups)]


def recompute_generate(model, cfg, reqs, params):
    """The plain loop of any family: every step re-runs each sample's whole sequence (vision, and DeepStack where
    the family has it, included), no cache; positions and the logits' gather come from the family's spec, the
    logits compared in fp32."""
    from rollplex_megatron.models import registry
    from rollplex_megatron.rollout.sampling import request_uniforms, sample_tokens

    m, spec, out = cfg.model, registry.model_spec(cfg.model), []
    for r in reqs:
        p, step = r.prompt, 0
        toks, lps, fin = [[] for _ in range(r.n)], [[] for _ in range(r.n)], [None] * r.n
        while any(f is None for f in fin):
            u = request_uniforms(r.seed, r.n, step, m.vocab_size)
            step += 1
            active = [j for j in range(r.n) if fin[j] is None]
            rows = []
            for j in active:
                seq = torch.cat([p.input_ids, torch.tensor(toks[j], dtype=torch.long)])[None]
                pos, _ = spec.positions.sequence(m, seq, p.image_grid_thw, p.video_grid_thw, p.second_per_grid_ts)
                with torch.no_grad():
                    logits = model(input_ids=seq, position_ids=pos, pixel_values=p.pixel_values,
                                   image_grid_thw=p.image_grid_thw, pixel_values_videos=p.pixel_values_videos,
                                   video_grid_thw=p.video_grid_thw)
                rows.append(spec.decode.gather_logits(logits[:, -1:], m.vocab_size)[:, 0])
            full = torch.cat(rows).float()
            full[:, list(m.vision_token_ids)] = float("-inf")
            tok, lp = sample_tokens(full, params, u[active])
            for b, j in enumerate(active):
                toks[j].append(int(tok[b]))
                lps[j].append(float(lp[b]))
                fin[j] = ("stop" if int(tok[b]) in r.stop_token_ids else
                          "length" if len(toks[j]) >= r.max_new_tokens else None)
        out.append((toks, lps, fin))
    return out


def _as_lists(results):
    return [([t.tolist() for t in r.tokens], [lp.tolist() for lp in r.logprobs], r.finish_reasons)
            for r in results]


def engine_vs_recompute(cfg, hf_dir, params, kv_cache_gib: float):
    """Engine results and the recompute loop's, on the same weights and requests."""
    from rollplex_megatron.rollout.embedded import EmbeddedEngine

    model = _setup(cfg, hf_dir)
    reqs = requests(cfg)
    engine = EmbeddedEngine(model, cfg.model, 4096, 64, kv_cache_gib)
    with torch.no_grad():
        out = engine.generate(reqs, params)
    return {"engine": _as_lists(out.results), "reference": recompute_generate(model, cfg, reqs, params),
            "waves": out.stats["waves"]}


def engine_graphs_vs_eager(cfg, hf_dir, params, dtype: str):
    """GPU: the same requests decoded with CUDA graphs and eagerly (results, and how each ran)."""
    from rollplex_megatron.rollout.embedded import EmbeddedEngine

    model = _setup(cfg, hf_dir, dtype)
    out = {}
    for graphs in (True, False):
        eng = EmbeddedEngine(model, cfg.model, 4096, 64, 1.0, cuda_graphs=graphs)
        with torch.no_grad():
            res = eng.generate(requests(cfg), params)
        out[graphs] = {"results": _as_lists(res.results), "replays": res.stats["graph_replays"],
                       "graph_error": eng.graph_error, "attention": eng.attention,
                       "sampling": res.stats["sampling"]}
    return out


def kept_state_rollouts(cfg) -> list[list]:
    """Five request sets for an engine that keeps its decode state, with what each should find: the first
    allocates; the second has the first's prompts and shapes with other sample seeds (reuses); the third
    asks longer responses (grows: a new state); the fourth is the first again (reuses the grown state, whose
    prefix and response sizes exceed the wave's); the fifth has two requests (another shape: a new state)."""
    from dataclasses import replace

    base = requests(cfg)
    return [base, [replace(r, seed=r.seed + 50) for r in base],
            [replace(r, max_new_tokens=r.max_new_tokens + 4) for r in base], base, requests(cfg, n_req=2, seed=9)]


def engine_kept_state(cfg, hf_dir, params, dtype: str = "float32", mutate: str = ""):
    """Each set of `kept_state_rollouts` decoded by one engine that keeps its state and by a fresh engine:
    both results, whether the kept state was reused and the graphs the kept engine captured, per set.
    `mutate="length"`: a kept state's sample lengths are not reset between waves (must fail the test)."""
    from rollplex_megatron.rollout import embedded as E

    model, reset = _setup(cfg, hf_dir, dtype), E._RESET
    kept = E.EmbeddedEngine(model, cfg.model, 4096, 64, 1.0, keep_decode_state=True)
    out = []
    try:
        E._RESET = tuple(k for k in reset if k != mutate)  # the job may run other cases after this one
        for reqs in kept_state_rollouts(cfg):
            with torch.no_grad():
                a = kept.generate(reqs, params)
                b = E.EmbeddedEngine(model, cfg.model, 4096, 64, 1.0).generate(reqs, params)
            out.append({"kept": _as_lists(a.results), "fresh": _as_lists(b.results),
                        "reused": a.stats["states_reused"], "captured": a.stats["graphs_captured"],
                        "replays": a.stats["graph_replays"], "fresh_captured": b.stats["graphs_captured"],
                        "graph_error": kept.graph_error})
        out.append(_kept_after_failure(E, kept, model, cfg, params, mutate))
    finally:
        E._RESET = reset
    return out


def _kept_after_failure(E, kept, model, cfg, params, mutate: str) -> dict:
    """A rollout of the first set that fails at its second decode step, then the first set again: the kept
    state in use when it failed is not reused, and the results are a fresh engine's. `mutate="failed"`: the
    failed rollout's state is put back (must fail the test)."""
    from rollplex_megatron.rollout.engine import DecodeHooks

    class Fails(DecodeHooks):
        def on_decode_step(self, step, active):
            if step == 2:
                self.state = kept._state
                raise RuntimeError("decode step 2 failed")

    reqs, hooks = kept_state_rollouts(cfg)[0], Fails()
    try:
        with torch.no_grad():
            kept.generate(reqs, params, hooks)
    except RuntimeError as e:
        assert str(e) == "decode step 2 failed", e
    else:
        raise AssertionError("the failing hook did not stop the rollout")
    dropped = kept._state is None
    if mutate == "failed":
        kept._state = hooks.state
    with torch.no_grad():
        a = kept.generate(reqs, params)
        b = E.EmbeddedEngine(model, cfg.model, 4096, 64, 1.0).generate(reqs, params)
    return {"kept": _as_lists(a.results), "fresh": _as_lists(b.results), "reused": a.stats["states_reused"],
            "failed_state_dropped": dropped, "captured": a.stats["graphs_captured"],
            "replays": a.stats["graph_replays"], "fresh_captured": b.stats["graphs_captured"],
            "graph_error": kept.graph_error}


def engine_kernel_paths(cfg, hf_dir, params, dtype: str, paths):
    """Engine tokens and log-probs for each (decode_attention, sampling_kernel) in `paths`, same requests."""
    from rollplex_megatron.rollout.embedded import EmbeddedEngine

    model = _setup(cfg, hf_dir, dtype)
    out = {}
    for attention, sampling in paths:
        eng = EmbeddedEngine(model, cfg.model, 4096, 64, 1.0, decode_attention=attention, sampling_kernel=sampling)
        with torch.no_grad():
            res = eng.generate(requests(cfg, n_req=2), params)
        assert eng.attention == attention and res.stats["sampling"] == sampling, (attention, res.stats["sampling"])
        out[(attention, sampling)] = ([[t.tolist() for t in r.tokens] for r in res.results],
                                      [[lp.tolist() for lp in r.logprobs] for r in res.results])
    return out


def engine_only(cfg, hf_dir, params):
    """Engine results at this TP degree (for TP=2 vs TP=1)."""
    from rollplex_megatron.rollout.embedded import EmbeddedEngine

    model = _setup(cfg, hf_dir)
    out = EmbeddedEngine(model, cfg.model, 4096, 64, 1.0).generate(requests(cfg), params)
    return _as_lists(out.results)


def window_items_match(cfg, hf_dir, params, mechanism: str = "interleave"):
    """Reference prefix K/V computed as decode-window items equal the same work run directly."""
    import threading

    from rollplex_megatron.attention.kv_store import KVStore
    from rollplex_megatron.rollout.embedded import EmbeddedEngine
    from rollplex_megatron.rollout.window import DecodeWindow
    from rollplex_megatron.trainer.modes.rollplex import reference_prefix_item as _reference_prefix

    model = _setup(cfg, hf_dir)
    ref = _setup_reference(cfg, hf_dir)
    reqs = requests(cfg)
    in_window, direct = KVStore(), KVStore()
    window = DecodeWindow(mechanism, 1, tail_fraction=0.5)
    actives = []
    orig = window.on_decode_step
    window.on_decode_step = lambda step, active: (actives.append((active, len(window.finished))), orig(step, active))
    threads = []
    for i, r in enumerate(reqs):
        window.submit(f"ref[{i}]", lambda r=r, i=i: (threads.append(threading.current_thread() is not main),
                                                     _reference_prefix(ref, [r.prompt], in_window, [i])))
    main = threading.current_thread()
    EmbeddedEngine(model, cfg.model, 4096, 64, 1.0).generate(reqs, params, hooks=window)
    for i, r in enumerate(reqs):
        _reference_prefix(ref, [r.prompt], direct, [i])
    diffs = [float((in_window.leaves[k][j] - direct.leaves[k][j]).abs().max()) for k in direct.leaves for j in (0, 1)]
    return {"stats": window.stats(), "max_abs_diff": max(diffs),
            "same_keys": set(in_window.leaves) == set(direct.leaves),
            "actives": actives, "wave_start": window._wave_start, "issuer_items": sum(threads)}


def _setup_reference(cfg, hf_dir):
    """A second model (the reference) with the same weights, built under the same parallel state."""
    from megatron.core import parallel_state as ps

    from rollplex_megatron.models.qwen25vl.hf import HFCheckpoint, load_hf_into_model
    from rollplex_megatron.models.qwen25vl import build_model

    ref = build_model(cfg.model)
    load_hf_into_model(ref, HFCheckpoint(hf_dir), cfg.model, ps.get_tensor_model_parallel_rank(), cfg.parallel.tp,
                       ps.get_pipeline_model_parallel_rank(), cfg.parallel.pp)
    return ref


def engine_bad_inputs(cfg, hf_dir, whats: list[str]) -> dict:
    """`engine_bad_input` for each kind in `whats` on one model in one process: per kind, the error it raised
    as its traceback (the text `run_local` would report), or None if it raised nothing."""
    import traceback

    model = _setup(cfg, hf_dir)
    out = {}
    for what in whats:
        try:
            engine_bad_input(cfg, hf_dir, what, model)
            out[what] = None
        except Exception:  # noqa: BLE001 - the test matches the message
            out[what] = traceback.format_exc()
    return out


def engine_bad_input(cfg, hf_dir, what: str, model=None):
    """Each kind of bad request must fail before decoding, naming the setting."""
    import dataclasses

    from rollplex_megatron.rollout.embedded import EmbeddedEngine
    from rollplex_megatron.rollout.sampling import SamplingParams

    model = _setup(cfg, hf_dir) if model is None else model
    reqs = requests(cfg)
    max_prompt, budget = 4096, 1.0
    if what == "prompt":
        max_prompt = reqs[0].prompt.input_ids.numel() - 1
    elif what == "budget":
        budget = 1e-9
    elif what == "length":
        reqs[1] = dataclasses.replace(reqs[1], max_new_tokens=65)
    elif what in ("placeholder", "prefix_placeholder"):  # one vision placeholder token too few
        k = next(i for i, r in enumerate(reqs) if r.prompt.pixel_values_videos is not None)
        ids = reqs[k].prompt.input_ids
        drop = int((ids == cfg.model.video_token_id).nonzero()[0])
        bad = dataclasses.replace(reqs[k].prompt, input_ids=torch.cat([ids[:drop], ids[drop + 1:]]))
        if what == "prefix_placeholder":  # the prefix stage's own check, without the engine's
            from rollplex_megatron.attention.kv_store import KVStore
            from rollplex_megatron.prefix.batch import Group
            from rollplex_megatron.prefix.execution import prefix_forward

            with torch.no_grad():
                prefix_forward(model, [Group(bad, [], torch.zeros(0))], KVStore(), keep_graph=False)
            return
        reqs[k] = dataclasses.replace(reqs[k], prompt=bad)
    EmbeddedEngine(model, cfg.model, max_prompt, 64, budget).generate(reqs, SamplingParams())


def kv_budget_edge(cfg, hf_dir) -> dict:
    """The start-up check (`check_kv_budget`) against the engine's own refusal (`_waves`) at the bound it
    computes and one byte under it, for one group of the rendered task's prompt: per budget, whether each
    accepted, and the check's message."""
    import dataclasses

    from rollplex_megatron.data import build_source
    from rollplex_megatron.rollout.embedded import EmbeddedEngine, check_kv_budget, kv_group_bytes
    from rollplex_megatron.rollout.engine import RolloutRequest

    model = _setup(cfg, hf_dir)
    source = build_source(cfg)
    g = cfg.rollout.group_size
    need = kv_group_bytes(cfg, source, g, whole_layers=False)
    row = source.rows(0, 0, 1, 1)[0]
    assert row.prompt.input_ids.numel() == source.longest_prompt[0]
    req = RolloutRequest(row.prompt, g, source.max_new_tokens, source.stop_token_ids, seed=row.seed)
    out = {"need": need}
    for name, nbytes in (("at", need), ("under", need - 1)):
        c = dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, kv_cache_gib=nbytes / 2**30))
        got = {}
        try:
            EmbeddedEngine.for_run(model, c)._waves([req])
            got["engine"] = None
        except ValueError as e:
            got["engine"] = str(e)
        try:
            check_kv_budget(c, source, {"rollout.group_size": g}, whole_layers=False)
            got["check"] = None
        except ValueError as e:
            got["check"] = str(e)
        out[name] = got
    return out
