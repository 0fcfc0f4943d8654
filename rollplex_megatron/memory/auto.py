"""The planner's choices under a budget: what `memory.plan=auto` releases (`auto_release`), the auto sizes of the
micro-batch, the prefix packs, the kept decode state and the optimizer step (`auto_size`), the classes
`memory.prefetch_ahead` brings back early (`ahead_phases`), and, for a run over its budget, the settings that
would make it fit (`fit_fixes`), each by trying plans of memory/planner.py.
"""
from __future__ import annotations

from dataclasses import replace

from rollplex_megatron.config import AUTO_SIZE, RunConfig
from rollplex_megatron.memory.budget import check_budget, gib_text
from rollplex_megatron.memory.classes import Shape
from rollplex_megatron.memory.planner import (full_sequence_responses, micro_batch_responses, phases, plan, releasable,
                                              released, resident_phases, runtime_cfg, streamed, summarize)
from rollplex_megatron.trainer.modes import get_mode


def auto_releasable(cfg: RunConfig) -> tuple[str, ...]:
    """What `memory.plan=auto` may release, in RELEASE_ORDER: the run's releasable classes, the reference's weights
    not under mode.window_graphs (its graphs read them where they were captured)."""
    return tuple(n for n in releasable(cfg) if n != "reference_weights" or not cfg.mode.window_graphs)


def auto_release(cfg: RunConfig, s: Shape, budget_gib: float, gpus: int = 1) -> frozenset:
    """`memory.plan=auto`: the classes to release so the run's peak fits `budget_gib` (none when
    everything fits). Releases classes in RELEASE_ORDER (the reference's weights not under mode.window_graphs, whose
    graphs read them where they were captured) until the peak fits, then keeps again, from the
    last released backwards, every class whose keeping still fits: the set is minimal (keeping any one of
    its classes goes over the budget), and of the releasable classes it prefers the cheap ones. Raises,
    naming the class and each setting that would make it fit (`fit_fixes`; `gpus`: this machine's), when even all
    released do not fit."""
    rc, mode = runtime_cfg(cfg), cfg.mode.name

    def fits(chosen) -> bool:
        return summarize(plan(rc, mode, frozenset(chosen), "embedded", s), mode)["peak_gib"] <= budget_gib

    chosen: list[str] = []
    for name in (None, *auto_releasable(cfg)):
        if name is not None:
            chosen.append(name)
        if fits(chosen):
            break
    else:
        summary = summarize(plan(rc, mode, frozenset(chosen), "embedded", s), mode)
        kept = "; the reference kept for mode.window_graphs" if cfg.mode.window_graphs else ""
        check_budget(summary, budget_gib, f"{mode} (memory.plan=auto, everything releasable released{kept})",
                     runtime=True, fit=lambda: fit_fixes(cfg, s, budget_gib, gpus))
    for name in reversed(chosen[:-1]):  # e.g. rollplex: the prefix graphs alone, the optimizer states kept
        if fits([c for c in chosen if c != name]):
            chosen.remove(name)
    return frozenset(chosen)


# Auto sizes (`workload.micro_batch_tokens`, `workload.prefix_pack_tokens` at -1, `rollout.keep_decode_state` unset,
# `memory.optimizer_step=auto`): the largest of each that fits, given up in this order: the kept decode state first
# (it spares a rollout its cache allocation and graph captures, and holds the cache in every phase), then the prefix
# packs (fewer, larger prefix forwards), then the micro-batch (the update's, the step's longest phase), and last the
# resident optimizer step (streaming adds host-to-device traffic to the step; it is taken only where no size fits
# the optimizer phase without it). Without a device budget: these values.
NO_DEVICE_SIZES = {"workload.micro_batch_tokens": 0, "workload.prefix_pack_tokens": 0,
                   "rollout.keep_decode_state": False, "memory.optimizer_step": "resident"}


def with_settings(cfg: RunConfig, values: dict) -> RunConfig:
    """`cfg` with the dotted settings `values` ({"workload.prefix_pack_tokens": 0, ...}, one section deep) set."""
    by_section: dict[str, dict] = {}
    for key, value in values.items():
        section, name = key.split(".")
        by_section.setdefault(section, {})[name] = value
    return replace(cfg, **{k: replace(getattr(cfg, k), **v) for k, v in by_section.items()})


def ladder(top: int, unit: int) -> list[int]:
    """`unit` x 2^k, largest first, from the first at or above `top` (lowered to `top`) down to `unit` (>= 1)."""
    out = [max(unit, 1)]
    while out[-1] < top:
        out.append(out[-1] * 2)
    out[-1] = max(out[0], min(out[-1], top))
    return out[::-1]


def is_auto(cfg: RunConfig, key: str) -> bool:
    """Whether the size `key` (of NO_DEVICE_SIZES) is left to the planner."""
    if key == "rollout.keep_decode_state":
        return cfg.rollout.keep_decode_state is None
    if key == "memory.optimizer_step":
        return cfg.memory.optimizer_step == "auto" and cfg.memory.plan != "keep"
    return getattr(cfg.workload, key.split(".")[1]) == AUTO_SIZE


def size_candidates(cfg: RunConfig, s: Shape) -> tuple[list[dict], list[dict], list[dict], list[dict]]:
    """The values auto sizing tries, largest first, per size ([{}]: the size is set): the optimizer step resident,
    then streamed (not under a fused Adam, which the streamed step does not reproduce); micro-batches of R x 2^k
    response tokens up to every response of the largest PPO mini-batch (full-sequence modes, whose micro-batches
    carry their prompts: counts from workload.responses_per_micro_batch halving to 1, with no token budget), packs
    of P x 2^k prefix tokens (P: the longest prefix) down to two groups, then none; the decode state kept or not
    (not where this process does not decode: SGLang, the rollout ranks of mode=disaggregated)."""
    w, groups = cfg.workload, -(-s.prompts // cfg.train.ppo_mini_batches)
    steps = mbs = packs = keeps = [{}]
    if is_auto(cfg, "memory.optimizer_step"):
        ways = ("resident",) if runtime_cfg(cfg).plan.fused_adam else ("resident", "stream")
        steps = [{"memory.optimizer_step": way} for way in ways]
    if is_auto(cfg, "workload.micro_batch_tokens"):
        if get_mode(cfg.mode.name).full_sequences:
            mbs = [{"workload.micro_batch_tokens": 0, "workload.responses_per_micro_batch": n}
                   for n in ladder(w.responses_per_micro_batch, 1)]
        else:
            mbs = [{"workload.micro_batch_tokens": b} for b in ladder(groups * s.group * s.R, max(s.R, 1))]
    if is_auto(cfg, "workload.prefix_pack_tokens"):
        sizes = ladder(groups * s.P, 2 * s.P) if groups > 1 else []
        packs = [{"workload.prefix_pack_tokens": t} for t in (*sizes, 0)]
    if is_auto(cfg, "rollout.keep_decode_state"):
        here = cfg.rollout.engine == "embedded" and not cfg.parallel.rollout_ranks
        keeps = [{"rollout.keep_decode_state": k} for k in ((True, False) if here else (False,))]
    return steps, mbs, packs, keeps


def sized_summary(rc: RunConfig, s: Shape) -> dict:
    """The plan of the runtime config `rc` (`runtime_cfg`) at `s` with the micro-batch of its own workload, under
    memory.plan (auto: everything `auto_release` may release released, its last resort)."""
    mode, res = rc.mode.name, rc.memory.plan
    residency = frozenset(auto_releasable(rc)) if res == "auto" else res
    return summarize(plan(rc, mode, residency, "embedded", replace(s, mb=micro_batch_responses(rc, s.R))), mode)


def fits_budget(rc: RunConfig, s: Shape, budget_gib: float) -> bool:
    """Whether `sized_summary`'s peak is within `budget_gib`."""
    return sized_summary(rc, s)["peak_gib"] <= budget_gib


def admissible(cfg: RunConfig) -> bool:
    """Whether the config accepts the candidate (e.g. no prefix packs with dynamic sampling in rollplex)."""
    try:
        cfg.check_training()
    except ValueError:
        return False
    return True


def auto_size(cfg: RunConfig, s: Shape | None, budget_gib: float | None, gpus: int = 1) -> tuple[RunConfig, dict]:
    """`cfg` with its auto sizes resolved, and what was chosen ({setting: value, "budget_gib": ...}; {} when no size
    is auto). Without a budget (no device) NO_DEVICE_SIZES; with one, the first of `size_candidates` (the optimizer
    step outermost, the kept decode state innermost: the order they are given up in) whose run fits under memory.plan
    (`fits_budget`). Raises, naming each setting that would make the run fit, when even the smallest does not."""
    if not cfg.auto_sized:
        return cfg, {}
    if budget_gib is None:
        chosen = {k: v for k, v in NO_DEVICE_SIZES.items() if is_auto(cfg, k)}
        return with_settings(cfg, chosen), {**chosen, "budget_gib": None}
    rc = runtime_cfg(cfg)
    steps, mbs, packs, keeps = size_candidates(cfg, s)
    for chosen in ({**step, **mb, **pack, **keep} for step in steps for mb in mbs for pack in packs for keep in keeps):
        c = with_settings(cfg, chosen)
        if admissible(c) and fits_budget(with_settings(rc, chosen), s, budget_gib):
            return c, {**chosen, "budget_gib": budget_gib}
    least = {**steps[-1], **mbs[-1], **packs[-1], **keeps[-1]}
    check_budget(sized_summary(with_settings(rc, least), s), budget_gib, f"{cfg.mode.name} at its smallest auto "
                 f"sizes ({settings_text(least)}; memory.plan={cfg.memory.plan})", runtime=True,
                 fit=lambda: fit_fixes(with_settings(cfg, least), s, budget_gib, gpus))
    raise RuntimeError(f"auto_size: no candidate fits {budget_gib:g} GiB, yet the smallest's plan does")


def auto_size_text(chosen: dict, released: list | None = None) -> str:
    """The start-up line of what `auto_size` chose (and, under memory.plan=auto, what it releases)."""
    budget = chosen["budget_gib"]
    why = "no device: the fixed values" if budget is None else f"the largest that fit {gib_text(budget)} GiB"
    rel = "" if released is None else f"; memory.plan=auto releases {', '.join(released) or 'nothing'}"
    return f"auto: {settings_text({k: v for k, v in chosen.items() if k != 'budget_gib'})} ({why}{rel})"


def settings_text(values: dict) -> str:
    """Dotted settings as overrides are written (`rollout.keep_decode_state=false workload.prefix_pack_tokens=0`)."""
    return " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in values.items())


def smaller_settings(cfg: RunConfig, s: Shape) -> list[list[dict]]:
    """Per setting of `cfg` that shrinks the plan, its smaller values, largest first: the kept decode state off, a
    smaller prefix pack, a smaller micro-batch (token budget or count; full-sequence modes: counts), memory.plan=auto
    for keep (its bytes with everything released are phase's), else the streamed optimizer step for a resident one,
    no window graphs."""
    w, out = cfg.workload, []
    if cfg.rollout.keep_decode_state:
        out.append([{"rollout.keep_decode_state": False}])
    if w.prefix_pack_tokens > 0:
        out.append([{"workload.prefix_pack_tokens": t} for t in (*ladder(w.prefix_pack_tokens // 2, 2 * s.P), 0)
                    if t < w.prefix_pack_tokens])
    if get_mode(cfg.mode.name).full_sequences or w.micro_batch_tokens <= 0:
        now = full_sequence_responses(cfg, s) if get_mode(cfg.mode.name).full_sequences else w.responses_per_micro_batch
        out.append([{"workload.micro_batch_tokens": 0, "workload.responses_per_micro_batch": n}
                    for n in ladder(max(now // 2, 1), 1) if n < now])
    else:
        out.append([{"workload.micro_batch_tokens": b} for b in ladder(w.micro_batch_tokens // 2, max(s.R, 1))
                    if b < w.micro_batch_tokens])
    if cfg.memory.plan == "keep":
        out.append([{"memory.plan": "auto"}])
    elif cfg.memory.optimizer_step == "resident" and not runtime_cfg(cfg).plan.fused_adam:
        out.append([{"memory.optimizer_step": "stream"}])
    if cfg.mode.window_graphs:
        out.append([{"mode.window_graphs": False}])
    return [o for o in out if o]


def fit_fixes(cfg: RunConfig, s: Shape, budget_gib: float, gpus: int = 1) -> str:
    """What makes the run of `cfg` fit `budget_gib`: each setting that alone does (at its largest value that does),
    else all of them together at their smallest; a larger parallel layout where this machine has more GPUs, and as
    the last resort where nothing else does."""
    rc, options = runtime_cfg(cfg), smaller_settings(cfg, s)
    fits = lambda values: fits_budget(with_settings(rc, values), s, budget_gib)  # noqa: E731
    alone = [next((v for v in values if fits(v)), None) for values in options]
    out = [settings_text(v) for v in alone if v is not None]
    least = {k: v for values in options for k, v in values[-1].items()}
    if not out and options and fits(least):
        out.append(f"together {settings_text(least)}")
    if gpus > 1:
        out.append(f"a larger parallel.tp/pp ({gpus} GPUs here)")
    elif not out:
        out.append("more GPUs (a larger parallel.tp/pp) or a smaller model")
    return ", or ".join(out)


AHEAD_CLASSES = ("optimizer_states", "main_weights", "reference_weights")  # offloaded: their prefetch is a copy


def phase_before(name: str, mode: str) -> str:
    """The phase just before the first of `name`'s own phases in `mode`'s step (the step repeats: the optimizer
    step comes before the next rollout)."""
    allp, own = phases(mode), resident_phases(name, mode)
    first = min(allp.index(p) for p in own if p in allp)
    return allp[first - 1]


def ahead_phases(cfg: RunConfig, mode: str, residency, s: Shape, budget_gib: float) -> dict:
    """`memory.prefetch_ahead`: the released offload classes that come back one phase early, {class: phase}. A
    class comes back at the entry of `phase_before` its own phases (Adam states and master weights during the
    update, a reference the rollout reads during the optimizer step) when that phase's planned bytes with it
    stay within `budget_gib`; the classes are tried in RELEASE_ORDER, each on top of those already taken. Its
    copy then runs beside that phase's work, and its own phase waits only for what is left of the copy."""
    rel = released(residency)
    chosen: dict = {}
    for name in (n for n in releasable(cfg) if n in AHEAD_CLASSES and n in rel - streamed(cfg, rel)):
        trial = {**chosen, name: phase_before(name, mode)}
        summary = summarize(plan(cfg, mode, residency, "embedded", s, trial), mode)
        if summary["phase_gib"][trial[name]] <= budget_gib:
            chosen = trial
    return chosen
