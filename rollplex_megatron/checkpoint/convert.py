"""`rollplex convert`: Hugging Face <-> megatron per-rank checkpoints, and training runs -> HF.

Megatron format (a directory): `rollplex_mcore.json` (format, tp, pp, HF naming, model config and
the source config.json) and one `tp{TT}_pp{PPP}.pt` per rank holding that rank's stage state dict
(local parameter names, TP shards). The directory is built under a temporary name and renamed into
place, so an interrupted conversion leaves nothing that looks complete.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch
from omegaconf import OmegaConf
from transformers import GenerationConfig

from rollplex_megatron.checkpoint import files as H
from rollplex_megatron.checkpoint import train_state as T
from rollplex_megatron.checkpoint.run_dir import published_checkpoint
from rollplex_megatron.config import ModelConfig, ParallelConfig, RunConfig, VisionConfig, check_model_parallel
from rollplex_megatron.data import build_source
from rollplex_megatron.models.registry import hf_family, model_spec, open_hf

META = "rollplex_mcore.json"
FORMAT = "rollplex-mcore-v1"


def rank_file(tp_rank: int, pp_rank: int) -> str:
    """File name of one rank's shard."""
    return f"tp{tp_rank:02d}_pp{pp_rank:03d}.pt"


def build_atomically(out: Path, fill) -> Path:
    """`out`, a new directory, written by `fill(tmp)` under a temporary name beside it and renamed when complete: a
    failure leaves nothing (an existing `out` is never touched)."""
    if out.exists():
        raise FileExistsError(f"{out} already exists; choose another output directory or remove it")
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        fill(tmp)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def hf_to_mcore(hf_dir: str, out_dir: str, tp: int, pp: int) -> Path:
    """Convert an HF directory into per-rank megatron shards for (tp, pp)."""
    for flag, n in (("--tp", tp), ("--pp", pp)):
        if n < 1:
            raise ValueError(f"convert hf-to-mcore {flag} must be >= 1, got {n}")
    ckpt = open_hf(hf_dir)
    cfg = ckpt.model_config()
    check_model_parallel(cfg, ParallelConfig(tp=tp, pp=pp), ("--tp", "--pp"))
    hf = model_spec(cfg).hf
    hf.validate(ckpt, cfg)

    def fill(tmp: Path) -> None:
        for p in range(pp):
            for t in range(tp):
                state = hf.shard(ckpt, cfg, t, tp, p, pp)
                H.atomic_save(lambda f, s=state: torch.save(s, f), tmp / rank_file(t, p))
        meta = {"format": FORMAT, "tp": tp, "pp": pp, "naming": dataclasses.asdict(ckpt.naming),
                "model": dataclasses.asdict(cfg), "hf_config": ckpt.raw_config}
        H.atomic_write_text(tmp / META, json.dumps(meta, indent=2))

    return build_atomically(Path(out_dir), fill)


def read_meta(mcore_dir: str | os.PathLike) -> dict:
    """The metadata of a megatron checkpoint directory, checked."""
    path = Path(mcore_dir) / META
    if not Path(mcore_dir).is_dir():
        raise H.CheckpointError(f"{mcore_dir}: no such folder (a megatron checkpoint is the folder `convert "
                                f"hf-to-mcore --out` wrote)")
    if not path.is_file():
        raise H.CheckpointError(f"{mcore_dir}: no {META}; not a rollplex megatron checkpoint")
    meta = H.read_json(path)
    if meta.get("format") != FORMAT:
        raise H.CheckpointError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def model_config_from_meta(meta: dict) -> ModelConfig:
    """ModelConfig stored in the metadata."""
    m = dict(meta["model"])
    return ModelConfig(**{**m, "vision": VisionConfig(**m["vision"])})


def mcore_to_hf(mcore_dir: str, out_dir: str, max_shard_bytes: int = 4 << 30) -> Path:
    """Convert per-rank megatron shards back to an HF directory (config.json + safetensors)."""
    meta = read_meta(mcore_dir)
    cfg, tp, pp = model_config_from_meta(meta), meta["tp"], meta["pp"]
    hf = model_spec(cfg).hf
    naming = hf.naming(**meta["naming"])
    for p in range(pp):
        for t in range(tp):
            if not (Path(mcore_dir) / rank_file(t, p)).is_file():
                raise H.CheckpointError(f"{mcore_dir}: missing {rank_file(t, p)} for tp={tp}, pp={pp}")
    # mmap: each rank file is paged in tensor by tensor while exporting, never loaded whole.
    states = [[H.load_torch_file(Path(mcore_dir) / rank_file(t, p), mmap=True)
               for t in range(tp)] for p in range(pp)]

    def fill(tmp: Path) -> None:
        H.write_safetensors(hf.export(states, cfg, tp, pp, naming), tmp, max_shard_bytes)
        H.atomic_write_text(tmp / "config.json", json.dumps(meta["hf_config"], indent=2))

    return build_atomically(Path(out_dir), fill)


# What transformers' processors and tokenizers save next to the weights.
PROCESSOR_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.json", "chat_template.jinja", "preprocessor_config.json",
                   "video_preprocessor_config.json", "processor_config.json")
EXPORT_META = "rollplex_export.json"


def hf_config_from_model(cfg: ModelConfig) -> dict:
    """A config.json for `cfg`, written by its family's HF layout (transformers' own config class)."""
    return model_spec(cfg).hf.config_to_hf(cfg)


def _same_model(a: ModelConfig, b: ModelConfig) -> bool:
    return dataclasses.replace(a, name="", freeze_vision=False) == dataclasses.replace(b, name="", freeze_vision=False)


def _train_checkpoint(run: Path, step: int | None) -> Path:
    if not run.is_dir():
        raise H.CheckpointError(f"{run}: no such run directory; name a training run's train.out directory")
    modes = [] if (run / T.CHECKPOINTS).is_dir() else sorted(p.name for p in run.iterdir()
                                                              if (p / T.CHECKPOINTS).is_dir())
    if modes:  # a folder of runs (a --modes comparison has one per mode)
        raise H.CheckpointError(f"{run} is not a run but holds runs; name one of them: "
                                + ", ".join(f"--run {run / m}" for m in modes))
    if step is None:
        # a missing or damaged `latest` next to a complete step names that step and how to publish it
        ck = published_checkpoint(run) if (run / T.CHECKPOINTS).is_dir() else None
        if ck is None:
            raise H.CheckpointError(f"{run}: no training checkpoint (no {T.CHECKPOINTS}/{T.LATEST}); train with "
                                    f"train.save_final=true or train.save_every=k")
        return ck
    ck = run / T.CHECKPOINTS / T.step_dir_name(step)
    if not (ck / T.META).is_file():
        have = sorted(p.name for p in (run / T.CHECKPOINTS).glob("step_*") if (p / T.META).is_file())
        raise H.CheckpointError(f"{run}: no checkpoint at step {step}; published: {', '.join(have) or 'none'}")
    return ck


def checkpoint_config(run_dir: str | os.PathLike, step: int | None = None) -> str:
    """The config (YAML) a run's checkpoint (latest, or `step`) was trained under."""
    return T.read_meta(_train_checkpoint(Path(run_dir), step))["config"]


def _actor_states(ck: Path, meta: dict) -> list[list[dict]]:
    """The actor's state per [pp_rank][tp_rank], from the data-parallel rank 0 files (mmap)."""
    tp, pp, dp = meta["tp"], meta["pp"], meta["dp"]
    states: list[list[dict | None]] = [[None] * tp for _ in range(pp)]
    for rank in range(meta["world_size"]):
        f = ck / T.rank_file_name(rank)
        if not f.is_file():
            raise H.CheckpointError(f"{ck}: missing {f.name} of world size {meta['world_size']}")
        state = T.read_rank_state(f, mmap=True)
        # megatron's default rank order tp-cp-ep-dp-pp (cp = ep = 1), for files that predate "ranks"
        r = state.get("ranks") or {"tp": rank % tp, "dp": rank // tp % dp, "pp": rank // (tp * dp)}
        if r["dp"] == 0:
            states[r["pp"]][r["tp"]] = state["model"]
    return states


def train_to_hf(run_dir: str | os.PathLike, out_dir: str | os.PathLike, step: int | None = None,
                max_shard_bytes: int = 4 << 30) -> Path:
    """Export the trained actor of a run's checkpoint (latest, or `step`) as an HF directory:
    config.json, safetensors, generation_config.json, and the processor files of `train.init_hf`."""
    run = Path(run_dir)
    ck = _train_checkpoint(run, step)
    meta = T.read_meta(ck)
    cfg: RunConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig),
                                                         OmegaConf.create(meta["config"])))
    init = Path(cfg.train.init_hf) if cfg.train.init_hf else None
    if init is not None and not (init / "config.json").is_file():  # moved or deleted since the run started
        raise H.CheckpointError(f"the run started from train.init_hf={init}, which has no config.json now; the "
                                f"export takes that checkpoint's config and processor files: put it back at that path")
    if init is not None:
        hf_config = H.read_json(init / "config.json")
        if not _same_model(hf_family(hf_config).hf.config_from_hf(hf_config), cfg.model):
            raise H.CheckpointError(f"{init}/config.json no longer describes the run's model; it was changed "
                                    f"after training")
    else:
        hf_config = hf_config_from_model(cfg.model)
    states = _actor_states(ck, meta)
    r = cfg.rollout

    def fill(tmp: Path) -> None:
        hf = model_spec(cfg.model).hf
        tensors = hf.export(states, cfg.model, meta["tp"], meta["pp"], hf.naming())
        H.write_safetensors(tensors, tmp, max_shard_bytes)
        H.atomic_write_text(tmp / "config.json", json.dumps(hf_config, indent=2))
        copied = [f for f in PROCESSOR_FILES if init is not None and (init / f).is_file()]
        for f in copied:
            shutil.copy2(init / f, tmp / f)
        if init is not None and (init / "generation_config.json").is_file():
            shutil.copy2(init / "generation_config.json", tmp / "generation_config.json")
        else:  # the run's own sampling settings and the task's stop tokens
            source = build_source(cfg)
            stop = source.stop_token_ids
            GenerationConfig(do_sample=True, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                             max_new_tokens=source.max_new_tokens, eos_token_id=list(stop)).save_pretrained(tmp)
        H.atomic_write_text(tmp / EXPORT_META, json.dumps(
            {"run": str(run.resolve()), "checkpoint": ck.name, "step": meta["step"], "source": "actor",
             "train_layout": {k: meta[k] for k in ("tp", "pp", "dp")}, "processor_files": copied}, indent=2))

    return build_atomically(Path(out_dir), fill)
