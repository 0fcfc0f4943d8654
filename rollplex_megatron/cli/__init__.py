"""Command line: `python -m rollplex_megatron <command> ...` (also installed as `rollplex`).

Commands
  train [hydra overrides] [--modes serial,prefix_shared,rollplex]
                                      GRPO training (default: tiny preset on CPU, rollplex mode);
                                      writes metrics.jsonl and report.png; last line = run directory
  smoke [hydra overrides]             forward+backward of the model on a random image and video
  verify-hf --hf-dir DIR [--tp N] [--json]
                                      megatron model vs transformers on an HF checkpoint
  convert hf-to-mcore --hf-dir DIR --out DIR [--tp N] [--pp N]
  convert mcore-to-hf --mcore-dir DIR --out DIR
  convert train-to-hf --run DIR [--step N] --out DIR
                                      export a training run's actor (latest checkpoint or step N) to HF
  verify-equivalence [hydra overrides] [--hf-dir DIR] [--json]
                                      prefix/response execution vs full sequences (exit 0 = exact)
  plan-weights [model=...] parallel.tp=T rollout.tp=R [parallel.dp=D] [layout=megatron|sglang] [--json]
                                      rollout weights on the training storage: class and bytes per kind
  plan-memory [hydra overrides] [--json]
                                      analytic HBM per GPU and phase: serial colocation vs the Rollplex
                                      plan (model=qwen2_5_vl_32b alone: the paper's 32-GPU setting)
  bench SUITE [--modes "serial,prefix_shared,rollplex,rollplex[mode.window=after]"] [--warmup K]
        [--out JSON] [--merge JSON] [--dry-run] [hydra overrides]
                                      every mode of recipes/bench/SUITE.yaml, one process each; one JSON
                                      per suite (benchmarks/results/) and BENCHMARKS.md generated from them
  print-config [--explain] [hydra overrides]
                                      the resolved config (--explain: each setting with its help)
  docs [--check]                      write docs/reference/settings.md and cli.md (--check: exit 1 if stale)
  window-policy --from BENCH_JSON [--margin M] [--out PATH]
                                      the table mode.window=auto reads, from benchmarks/decode_window.py's JSON
  eval (--hf-dir DIR | --run DIR [--step N]) data.val_files=[FILE] [val.*] [--out JSON]
                                      a checkpoint's per-data_source scores on a validation set
  generate (--hf-dir DIR | --run DIR [--step N]) data.val_files=[FILE] [--rows K] [val.n=N]
                                      print a checkpoint's responses to the first K rows, for reading
  make-example DIR [--train-rows N] [--val-rows N] [--videos] [--family F] [--verl] [model=...]
                                      a tiny random Qwen2.5-VL (--family qwen3_vl: Qwen3-VL) checkpoint
                                      with its processor (DIR/model) and a multiple-choice dataset in
                                      verl's format (DIR/*.parquet); --verl: the variant verl's own
                                      driver takes (docs/guides/verl.md), not the one for `train`
Commands that take Hydra overrides accept e.g. `model=qwen2_5_vl_3b parallel.tp=2`.
Multi-process commands launch their own local processes when not started by torchrun.
Errors print one line (`error: ...`); `--debug` anywhere on the line shows the traceback instead.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

import torch.distributed as dist
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rollplex_megatron.bench import main as bench_main
from rollplex_megatron.checkpoint import convert
from rollplex_megatron.checkpoint.train_state import DiskFullError
from rollplex_megatron.user_code import UserCodeError, UserCodeStopped, UserCodeTimeout
from rollplex_megatron.checkpoint.files import atomic_write_text
from rollplex_megatron.models.registry import open_hf
from rollplex_megatron.cli import reference
from rollplex_megatron.cli.train import main as train_main
from rollplex_megatron.compat import quiet_known_warnings
from rollplex_megatron.config import ParallelConfig, check_model_parallel
from rollplex_megatron.data.dataset import DatasetSource
from rollplex_megatron.data.example import TINY_PRESETS, make_example
from rollplex_megatron.dist import LocalRunError, check_launch, launch_on_ranks, leave_torchrun
from rollplex_megatron.memory.budget import check_budget, check_cap
from rollplex_megatron.memory.planner import plan_memory
from rollplex_megatron.recipes import (RECIPES_DIR, check_eval_overrides, load_run_config, override_key,
                                       override_value, run_eval_config, to_yaml)
from rollplex_megatron.runtime import allocator_default, environment_record
from rollplex_megatron.trainer.validation import eval_rank, generate_rank
from rollplex_megatron.verify.equivalence import run_rank
from rollplex_megatron.verify.parity import verify_rank
from rollplex_megatron.verify.smoke import main as smoke_main
from rollplex_megatron.weights.plan import plan_weights

# What a user's input can cause: printed as one line. Anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, PermissionError, NotADirectoryError, IsADirectoryError,
               HydraException, OmegaConfBaseException, LocalRunError, DiskFullError,
               UserCodeStopped, UserCodeError, UserCodeTimeout)


def error_line(e: BaseException) -> str:
    """One line for an error: a worker's own last traceback line, else the message's lines joined."""
    if isinstance(e, LocalRunError):
        return e.summary
    text = " ".join(ln.strip() for ln in str(e).splitlines() if ln.strip())
    return text or type(e).__name__


def _user_path(text: str) -> str:
    """A path option with `~` and `~user` expanded (the shell leaves `--run=~/x` as written)."""
    return os.path.expanduser(text)


def _cmd_verify_hf(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rollplex verify-hf", description="megatron vs transformers logits")
    ap.add_argument("--hf-dir", required=True, type=_user_path, help="Hugging Face Qwen2.5-VL directory")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (local processes)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompt's pixels and text")
    ap.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    a = ap.parse_args(argv)
    ckpt = open_hf(a.hf_dir)  # bad directory or config: fail here, before any process starts
    if a.tp < 1:
        raise ValueError(f"verify-hf --tp must be >= 1, got {a.tp}")
    check_model_parallel(ckpt.model_config(), ParallelConfig(tp=a.tp), ("--tp", "parallel.pp"))
    res = launch_on_ranks(verify_rank, a.tp, a.hf_dir, a.tp, a.seed)[0]
    if dist.is_initialized() and dist.get_rank() != 0:
        return 0 if res["ok"] else 1
    print(f"max |logits - transformers| = {res['max_abs_logit_diff']:.3e} at tp={res['tp']} "
          f"(tolerance {res['tolerance']:.0e}): {'OK' if res['ok'] else 'MISMATCH'}")
    if a.json:
        print(json.dumps(res))
    return 0 if res["ok"] else 1


def _cmd_convert(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rollplex convert", description="checkpoint conversion")
    sub = ap.add_subparsers(dest="direction", required=True)
    h2m = sub.add_parser("hf-to-mcore", help="HF directory -> per-rank megatron shards")
    h2m.add_argument("--hf-dir", required=True, type=_user_path)
    h2m.add_argument("--out", required=True, type=_user_path)
    h2m.add_argument("--tp", type=int, default=1)
    h2m.add_argument("--pp", type=int, default=1)
    m2h = sub.add_parser("mcore-to-hf", help="per-rank megatron shards -> HF directory")
    m2h.add_argument("--mcore-dir", required=True, type=_user_path)
    m2h.add_argument("--out", required=True, type=_user_path)
    m2h.add_argument("--max-shard-gib", type=float, default=4.0)
    t2h = sub.add_parser("train-to-hf", help="a training run's checkpoint -> HF directory (the actor)")
    t2h.add_argument("--run", required=True, type=_user_path, help="run directory (train.out of the run)")
    t2h.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    t2h.add_argument("--out", required=True, type=_user_path, help="new HF directory")
    t2h.add_argument("--max-shard-gib", type=float, default=4.0)
    a = ap.parse_args(argv)
    shard = getattr(a, "max_shard_gib", 1.0)
    if not (math.isfinite(shard) and shard > 0):
        raise ValueError(f"--max-shard-gib must be a positive number of GiB, got {shard}")
    if a.direction == "hf-to-mcore":
        out = convert.hf_to_mcore(a.hf_dir, a.out, a.tp, a.pp)
    elif a.direction == "train-to-hf":
        out = convert.train_to_hf(a.run, a.out, a.step, int(a.max_shard_gib * (1 << 30)))
    else:
        out = convert.mcore_to_hf(a.mcore_dir, a.out, int(a.max_shard_gib * (1 << 30)))
    print(out)
    return 0


def _cmd_verify_equivalence(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rollplex verify-equivalence",
                                 description="prefix/response execution vs full sequences on a random batch")
    ap.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    ap.add_argument("--hf-dir", default=None, type=_user_path,
                    help="load weights from this HF checkpoint (default: random init)")
    a, overrides = ap.parse_known_args(argv)
    if a.hf_dir is not None:  # the model is the checkpoint's (as train.init_hf): a model= that disagrees is refused
        overrides = [*overrides, f"train.init_hf={a.hf_dir}"]
    cfg = load_run_config(overrides, hf_setting="--hf-dir")
    cfg.check_verify()
    check_launch(cfg.parallel)  # under torchrun: megatron would take dp from the launch, not from the config
    res = launch_on_ranks(run_rank, cfg.parallel.world_size, cfg, a.hf_dir)[0]
    if dist.is_initialized() and dist.get_rank() != 0:
        return 0 if res["ok"] else 1
    print(f"prefix/response vs full sequence ({cfg.dtype}, tp={res['tp']} pp={res['pp']} dp={res['dp']} "
          f"G={res['group_size']}): logp {res['max_rel_err_logp']:.2e}, loss {res['max_rel_err_loss']:.2e}, "
          f"grad {res['max_rel_err_grad']:.2e}, reference logp {res['max_rel_err_ref_logp']:.2e} "
          f"(tolerances {res['tolerance']}): {'OK' if res['ok'] else 'MISMATCH'}")
    if a.json:
        print(json.dumps(res))
    return 0 if res["ok"] else 1


def _cmd_plan_weights(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rollplex plan-weights",
                                 description="rollout weights on the training storage: class and bytes per kind")
    ap.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    a, rest = ap.parse_known_args(argv)
    own = {"layout": "megatron", "mapping": "aligned", "dtype_bytes": "2"}
    overrides = []
    for item in rest:
        key, _, value = item.partition("=")
        if key in ("train_tp", "rollout_tp"):
            raise ValueError(f"plan-weights: {key}= is not an argument; it reads the run's own settings: parallel.tp=T "
                             f"rollout.tp=R (and parallel.dp so that rollout.tp divides tp*pp*dp)")
        if key in own:
            own[key] = value
        else:
            overrides.append(item)
    if own["dtype_bytes"] not in ("1", "2", "4"):
        raise ValueError(f"plan-weights: dtype_bytes={own['dtype_bytes']} is the rollout weights' bytes per element: "
                         f"1 (fp8), 2 (bf16/fp16) or 4 (fp32)")
    cfg = load_run_config(overrides)
    s = plan_weights(cfg.model, cfg.parallel.tp, cfg.rollout.tp or cfg.parallel.tp, own["layout"],
                     int(own["dtype_bytes"]), own["mapping"]).summary()
    gib = 2**30
    print(f"model {cfg.model.name}: train TP={s['train_tp']} -> rollout TP={s['rollout_tp']} ({s['layout']} layout, "
          f"{s['gpus']} GPUs, {own['mapping']} mapping)")
    print(f"{'kind':48s} {'class':14s} {'tensors':>7s} {'rollout GiB':>11s} {'alloc GiB':>9s}")
    for kind, k in s["by_kind"].items():
        print(f"{kind:48s} {k['class']:14s} {k['count']:7d} {k['shard_bytes'] / gib:11.3f} "
              f"{k['alloc_bytes'] / gib:9.3f}")
    print(f"per GPU (worst): full second copy {s['full_copy_bytes'] / gib:.3f} GiB, this plan allocates "
          f"{s['allocated_bytes'] / gib:.3f} GiB ({s['allocated_bytes_split_gemm'] / gib:.3f} GiB, "
          f"{100 * s['allocated_bytes_split_gemm'] / max(s['full_copy_bytes'], 1):.1f}% of a copy, with split GEMMs "
          f"over views for gathered and locally permuted linears); saved {100 * s['saved_fraction']:.1f}%")
    if a.json:
        print(json.dumps(s))
    return 0


def _cmd_plan_memory(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rollplex plan-memory", description="analytic HBM plan per GPU and phase")
    ap.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    a, overrides = ap.parse_known_args(argv)
    model = next((o.split("=", 1)[1] for o in overrides if o.startswith("model=")), None)
    if model and not any(override_key(o) == "plan_preset" for o in overrides) \
            and (RECIPES_DIR / "plan_preset" / f"{model}.yaml").is_file():
        overrides = [f"+plan_preset={model}"] + overrides  # the model's reference setting; overrides win
    cfg = load_run_config(overrides)
    keys = {override_key(o): o for o in overrides if "=" in o}
    fixed = next((keys[k] for k in ("memory.plan", "mode", "mode.name") if k in keys), None)
    if fixed and not (fixed.split("=", 1)[0] != "memory.plan" and cfg.mode.name == "disaggregated"):
        raise ValueError(f"{fixed}: plan-memory plans serial (memory.plan=keep) against rollplex (memory.plan=phase) "
                         f"side by side, and mode=disaggregated's ranks; a run's own plan is its memory_plan.json "
                         f"(train), so drop the override")
    for key, limit in (("prefix_tokens", "max_prompt_len"), ("response_tokens", "max_response_len")):
        if getattr(cfg.plan, key) > getattr(cfg.rollout, limit):  # a shape the run itself would refuse
            raise ValueError(f"plan.{key}={getattr(cfg.plan, key)} is over rollout.{limit}="
                             f"{getattr(cfg.rollout, limit)}, which a run of this config would refuse; raise "
                             f"rollout.{limit} or lower plan.{key}")
    merge2, p = cfg.model.vision.spatial_merge_size ** 2, cfg.plan
    if p.vision_patches % merge2:
        raise ValueError(f"plan.vision_patches={p.vision_patches} is not a multiple of {merge2} (the merger joins "
                         f"model.vision.spatial_merge_size^2 patches into one token); give a multiple")
    if p.vision_patches // merge2 + 2 > p.prefix_tokens:
        need = p.vision_patches // merge2 + 2
        raise ValueError(f"plan.prefix_tokens={p.prefix_tokens} cannot hold the {need - 2} vision tokens of "
                         f"plan.vision_patches={p.vision_patches} and their start and end tokens; raise "
                         f"plan.prefix_tokens to at least {need} or lower plan.vision_patches")
    res = plan_memory(cfg)
    w = res["workload"]
    print(f"model {res['model']} on {res['gpus']} GPUs (TP={res['tp']} PP={res['pp']} DP={res['dp']}); per DP rank "
          f"{w['prompts']} prompts x G={w['group']}, prefix {w['P']} tokens, response {w['R']}")
    for mode in ("serial", "rollplex"):
        s = res[mode]
        print(f"{mode}: peak {s['peak_gib']:.1f} GiB per GPU in phase {s['peak_phase']}")
        for ph, classes in s["by_phase_gib"].items():
            parts = ", ".join(f"{k} {v:.1f}" for k, v in sorted(classes.items(), key=lambda kv: -kv[1]))
            print(f"  {ph:10s} {s['phase_gib'][ph]:7.1f} GiB: {parts}")
    if "disaggregated" in res:
        d = res["disaggregated"]
        print(f"disaggregated: training rank peak {d['training_rank']['peak_gib']:.1f} GiB in phase "
              f"{d['training_rank']['peak_phase']}; rollout rank {d['rollout_rank']['peak_gib']:.1f} GiB (its own "
              f"weights at rollout.tp={d['rollout_rank']['rollout_tp']}, {d['rollout_rank']['replicas']} replicas)")
    budget = cfg.memory.budget_gib
    if budget > 0:
        print(f"budget {budget:g} GiB: serial {'fits' if res['serial_peak_gib'] <= budget else 'does not fit'}, "
              f"rollplex {'fits' if res['rollplex_fits'] else 'does not fit'}")
    if a.json:
        print(json.dumps(res))
    try:
        check_budget(res["rollplex"], budget, "rollplex")
        check_cap(res["rollplex"], cfg.memory.cap_gib, "rollplex")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _overrides_only(prog: str, description: str, argv: list[str]) -> list[str]:
    """The Hydra overrides of a command that takes no options of its own (`--help` prints its usage, exit 0)."""
    ap = argparse.ArgumentParser(prog=prog, description=description, usage=f"{prog} [hydra overrides]",
                                 epilog="overrides: key=value, e.g. model=qwen2_5_vl_3b parallel.tp=2 "
                                        "(`rollplex print-config` lists every key)")
    _, overrides = ap.parse_known_args(argv)
    return overrides


def _cmd_print_config(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rollplex print-config", description="the resolved config",
                                 usage="rollplex print-config [--explain] [hydra overrides]")
    ap.add_argument("--explain", action="store_true", help="each setting with its help, as a YAML comment")
    a, overrides = ap.parse_known_args(argv)
    cfg = load_run_config(overrides)
    print(reference.explained_yaml(cfg) if a.explain else to_yaml(cfg))
    return 0


def _cmd_docs(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rollplex docs", description="write the generated reference pages "
                                 "(docs/reference/settings.md from config.py, cli.md from the commands' parsers)")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 naming the pages that are stale")
    ap.add_argument("--out", type=Path, default=reference.REFERENCE_DIR, help="folder of the pages "
                    "(default: the source checkout's docs/reference)")
    a = ap.parse_args(argv)
    texts = reference.pages(COMMANDS, __doc__, USER_ERRORS)
    if a.check:
        stale = reference.stale_pages(texts, a.out)
        for name in stale:
            print(f"{a.out / name} is stale; regenerate it with `python -m rollplex_megatron docs`", file=sys.stderr)
        return 1 if stale else 0
    for path in reference.write_pages(texts, a.out):
        print(f"wrote {path}")
    return 0


def _cmd_train(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rollplex train", description="synchronous GRPO training")
    ap.add_argument("--modes", default=None,
                    help="comma-separated modes to run one after another from the same seed, each into "
                         "<run dir>/<mode> (default: mode.name of the config)")
    a, overrides = ap.parse_known_args(argv)
    return train_main(overrides, a.modes.split(",") if a.modes else None)


def _cmd_make_example(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rollplex make-example", description=make_example.__doc__)
    ap.add_argument("out", help="new directory to write")
    ap.add_argument("--train-rows", type=int, default=512)
    ap.add_argument("--val-rows", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--videos", action="store_true", help="every third row a two-frame video")
    ap.add_argument("--family", choices=sorted(TINY_PRESETS), default=None,
                    help="model family of the checkpoint: its tiny preset (a model= override is used as given)")
    ap.add_argument("--verl", action="store_true",
                    help="the variant verl 0.9.1's driver takes as it is (its tokenizer, video processor and "
                         "ragged rows: docs/guides/verl.md); without it, the example for `train`")
    a, overrides = ap.parse_known_args(argv)
    if a.train_rows < 1 or a.val_rows < 1:
        raise ValueError(f"--train-rows and --val-rows must be >= 1, got {a.train_rows} and {a.val_rows}")
    other = [o for o in overrides if override_key(o).split(".")[0] != "model"]
    if other:  # only the model's shape shapes the example
        raise ValueError(f"{other[0]}: make-example reads model overrides only (model=PRESET, model.*); give the "
                         f"others to train")
    given = any(override_key(o) == "model" for o in overrides)
    preset = [f"model={TINY_PRESETS[a.family]}"] if a.family and not given else []
    model = load_run_config(preset + overrides).model
    if a.family and model.family != a.family:
        raise ValueError(f"--family {a.family} but the model overrides give model.family={model.family}; drop one")
    out = make_example(a.out, model, a.train_rows, a.val_rows, a.seed, a.videos, verl=a.verl)
    print(_example_command(out, a.verl))
    print(out)
    return 0


def _example_command(out: Path, verl: bool) -> str:
    """The line that runs the example `out`: verl's driver with the recipe (`--verl`), else `train`."""
    train, val = (next(out.glob(f"{name}.*")) for name in ("train", "val"))  # .parquet, or .jsonl without pyarrow
    if verl:
        pkg = "pkg://rollplex_megatron.integrations.verl.data"  # the built-in rewards, the PIL dataset class
        return (f"verl with: bash recipes/verl/run_qwen2_5_vl_rollplex.sh data.train_files={train} "
                f"data.val_files={val} actor_rollout_ref.model.path={out / 'model'} "
                f"reward.custom_reward_function.path={pkg} data.custom_cls.path={pkg} "
                f"data.custom_cls.name=RollplexRLHFDataset")
    return (f"train with: python -m rollplex_megatron train train.init_hf={out / 'model'} "
            f"data.train_files=[{train}] data.val_files=[{val}] train.val_every=50 rollout.max_response_len=4 "
            f"reward.format_reward=0.5 train.steps=800 optim.lr=5e-4")  # the docs' recipe (at lr 1e-3 it collapses)


def _checkpoint_args(prog: str, description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=description)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf-dir", type=_user_path, help="a Hugging Face Qwen2.5-VL directory with its processor files")
    src.add_argument("--run", type=_user_path, help="a training run directory (its actor is exported to HF first)")
    ap.add_argument("--step", type=int, default=None, help="with --run: this checkpoint step (default: latest)")
    return ap


def _check_checkpoint_args(a) -> None:
    """`--step` belongs to `--run`; `--hf-dir` names a Hugging Face directory (a run directory is `--run`'s)."""
    if a.hf_dir and a.step is not None:
        raise ValueError(f"--step {a.step} selects a checkpoint of a training run: use it with --run RUN, or drop it "
                         f"with --hf-dir")
    if a.hf_dir and not Path(a.hf_dir).is_dir():
        what = "is a file, not a folder" if Path(a.hf_dir).exists() else "does not exist"
        raise ValueError(f"--hf-dir {a.hf_dir} {what}; name a Hugging Face Qwen2.5-VL or Qwen3-VL model folder "
                         f"(the one holding config.json)")
    if a.hf_dir and (Path(a.hf_dir) / "checkpoints").is_dir() and not (Path(a.hf_dir) / "config.json").is_file():
        raise ValueError(f"--hf-dir {a.hf_dir} is a training run directory (it has checkpoints/); use --run {a.hf_dir}")


def _check_run_processor(a, overrides: list[str]) -> None:
    """Before an export: a run that started from no HF checkpoint (the built-in task's tiny model) exports no
    tokenizer or processor, so the rows need `data.processor` from the run or the command line."""
    run = OmegaConf.create(convert.checkpoint_config(a.run, a.step))
    given = any(override_key(o) == "data.processor" for o in overrides)
    if not given and not run.train.init_hf and not run.data.processor:
        raise ValueError(f"--run {a.run} started from no HF checkpoint (train.init_hf was empty), so its export has no "
                         f"tokenizer or processor to read the rows with: add data.processor=DIR, a model folder of "
                         f"the same family with its tokenizer and processor files (e.g. make-example's ex/model)")


def _eval_config(a, overrides: list[str], tmp: str):
    """The run config of an eval/generate command: the checkpoint as train.init_hf, the val files as rows; with
    `--run`, the run's reading, answering and scoring settings (`RUN_EVAL_SETTINGS`) where the command line does
    not name them. Also returns those taken from the run that differ from the root recipe's."""
    _check_checkpoint_args(a)
    model = [o for o in overrides if override_key(o).split(".")[0] == "model"]
    if model:  # before an export: the model is the checkpoint's
        where = f"--run {a.run}" if a.run else f"--hf-dir {a.hf_dir}"
        raise ValueError(f"{model[0]}: the model is the checkpoint's ({where}); drop the model override")
    check_eval_overrides(overrides)
    files = [o.split("=", 1)[1] for o in overrides if o.startswith("data.val_files=")]
    if not files or files[-1].strip() in ("[]", ""):
        raise ValueError("give the rows to answer: data.val_files=[FILE, ...] (parquet or jsonl, verl's format)")
    if a.run:
        _check_run_processor(a, overrides)
    val = override_value(f"data.val_files={files[-1]}")
    for f in (val if isinstance(val, list) else [val]):
        if not Path(str(f)).expanduser().is_file():  # before an export of the whole checkpoint
            raise ValueError(f"data.val_files: {f} does not exist; name parquet or jsonl files of rows")
    hf = a.hf_dir or str(convert.train_to_hf(a.run, f"{tmp}/export", a.step))
    cfg = load_run_config([*overrides, f"train.init_hf={hf}", f"data.train_files={files[-1]}"])  # rows are checked
    from_run = {}
    if a.run:  # the config of the checkpoint just exported (--step, or the latest then)
        step = json.loads((Path(hf) / convert.EXPORT_META).read_text())["step"]
        cfg, from_run = run_eval_config(cfg, overrides, convert.checkpoint_config(a.run, step))
        if from_run:
            print(f"from the run ({a.run}): {' '.join(f'{k}={v}' for k, v in sorted(from_run.items()))}",
                  file=sys.stderr)
    check_launch(cfg.parallel)
    DatasetSource(cfg, training=False)  # every row checked before a process starts
    return cfg, from_run


def _cmd_eval(argv: list[str]) -> int:
    ap = _checkpoint_args("rollplex eval", "per-data_source scores of a checkpoint on data.val_files")
    ap.add_argument("--out", default=None, help="write the JSON record here too (a new file)")
    a, overrides = ap.parse_known_args(argv)
    if a.out and Path(a.out).exists():  # checked before the work: a record is never overwritten
        raise ValueError(f"--out {a.out} exists; choose a new path or remove it")
    if a.out and not Path(a.out).resolve().parent.is_dir():
        raise ValueError(f"--out {a.out}: folder {Path(a.out).resolve().parent} does not exist; create it first")
    with tempfile.TemporaryDirectory() as tmp:
        cfg, from_run = _eval_config(a, overrides, tmp)
        # --run without --step: the step the export took (the latest)
        step = None if a.hf_dir else json.loads((Path(tmp) / "export" / convert.EXPORT_META).read_text())["step"]
        rec = launch_on_ranks(eval_rank, cfg.parallel.world_size, cfg)[0]
    rec.pop("step")
    out = {"checkpoint": a.hf_dir or a.run, "checkpoint_step": step, "val_files": list(cfg.data.val_files),
           "temperature": cfg.val.temperature, "n": cfg.val.n, "settings_from_run": from_run, **rec,
           "env": environment_record()}
    if a.out:
        atomic_write_text(Path(a.out), json.dumps(out, indent=1))
    for k, v in rec.items():
        if k.startswith("val/"):
            print(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}")
    print(json.dumps(out))
    return 0


def _cmd_generate(argv: list[str]) -> int:
    ap = _checkpoint_args("rollplex generate", "a checkpoint's responses to the first rows of data.val_files")
    ap.add_argument("--rows", type=int, default=4, help="how many rows to answer")
    a, overrides = ap.parse_known_args(argv)
    if a.rows < 1:
        raise ValueError(f"--rows must be >= 1, got {a.rows}")
    limit = next((o for o in overrides if override_key(o) == "val.max_rows"), None)
    if limit is not None:
        raise ValueError(f"{limit}: generate answers the first --rows K rows (val.max_rows is eval's limit); drop "
                         "the override")
    with tempfile.TemporaryDirectory() as tmp:
        cfg, _ = _eval_config(a, overrides, tmp)
        rows = launch_on_ranks(generate_rank, cfg.parallel.world_size, cfg, a.rows)[0]
    if len(rows) < a.rows:
        print(f"generate: --rows {a.rows}, but data.val_files hold {len(rows)} rows; all of them answered",
              file=sys.stderr)
    for r in rows:
        print(f"== {r['row']} (ground truth {r['ground_truth']!r})\n{r['prompt']}")
        for k, (text, reward) in enumerate(zip(r["responses"], r["rewards"])):
            print(f"-- response {k} (reward {reward:g}): {text}")
    return 0


def _cmd_bench(argv: list[str]) -> int:
    return bench_main(argv)


def _cmd_window_policy(argv: list[str]) -> int:
    """`window-policy --from BENCH_JSON [--margin M] [--out PATH]`: the table mode.window=auto reads."""
    from rollplex_megatron.rollout.window.policy import MARGIN, POLICY_PATH, build_policy

    ap = argparse.ArgumentParser(prog="rollplex window-policy",
                                 description="mode.window=auto's table from a decode-window benchmark JSON")
    ap.add_argument("--from", dest="src", required=True, help="benchmarks/decode_window.py's output JSON")
    ap.add_argument("--margin", type=float, default=MARGIN, help="share by which a window must beat after")
    ap.add_argument("--out", default=str(POLICY_PATH),
                    help="where to write the table (default: the table shipped with the package, which "
                         "mode.window=auto reads)")
    a = ap.parse_args(argv)
    src = Path(a.src)
    if not src.is_file():
        raise ValueError(f"window-policy: --from {src} " + ("is a folder" if src.is_dir() else "does not exist")
                         + "; pass the decode-window benchmark's JSON (benchmarks/decode_window.py's output)")
    if not 0 <= a.margin < 1:
        raise ValueError(f"window-policy: --margin is the share by which a mechanism must beat after, in [0, 1); "
                         f"got {a.margin:g}")
    try:
        bench = json.loads(src.read_text())
        table = build_policy(bench, a.src, a.margin)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"window-policy: {src} is not JSON ({e}); pass benchmarks/decode_window.py's output") from None
    except (KeyError, TypeError, AttributeError, IndexError) as e:
        raise ValueError(f"window-policy: {src} is not a decode-window benchmark JSON ({type(e).__name__}: {e}); "
                         f"pass benchmarks/decode_window.py's output") from None
    out = Path(a.out)
    if not out.parent.is_dir():
        raise ValueError(f"window-policy: --out {out}: folder {out.parent} does not exist")
    if out.is_dir():
        raise ValueError(f"window-policy: --out {out} is a folder; name the table's file (e.g. {out}/policy.json)")
    atomic_write_text(out, json.dumps(table, indent=1) + "\n")
    shipped = out.resolve() == POLICY_PATH.resolve()
    print(f"wrote {out}" + (" (the table shipped with the package: mode.window=auto reads it)" if shipped else ""))
    for r in table["rows"]:
        print(f"{r['case']}: {r['mechanism']} ({', '.join(f'{k} {v:.3f}s' for k, v in r['wall_s'].items())})")
    return 0


def _cmd_smoke(argv: list[str]) -> int:
    return smoke_main(_overrides_only("rollplex smoke", "forward+backward of the model on a random image and video",
                                      argv))


COMMANDS = {"train": _cmd_train, "smoke": _cmd_smoke, "verify-hf": _cmd_verify_hf,
            "verify-equivalence": _cmd_verify_equivalence, "convert": _cmd_convert,
            "print-config": _cmd_print_config, "make-example": _cmd_make_example, "eval": _cmd_eval,
            "generate": _cmd_generate, "plan-weights": _cmd_plan_weights,
            "plan-memory": _cmd_plan_memory, "bench": _cmd_bench, "window-policy": _cmd_window_policy,
            "docs": _cmd_docs}


def main(argv: list[str] | None = None) -> int:
    """Dispatch to a command; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    quiet_known_warnings()
    allocator_default()
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"unknown command {cmd!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        rc = COMMANDS[cmd](rest)
    except USER_ERRORS as e:
        if debug:
            raise
        print(f"error: {error_line(e)} (--debug shows the traceback)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C outside a launch that handles it itself (train's): one line, no traceback
        if debug:
            raise
        print("interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    if rc == 0:
        leave_torchrun()
    return rc


if __name__ == "__main__":
    sys.exit(main())
