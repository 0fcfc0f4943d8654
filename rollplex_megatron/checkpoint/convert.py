"""`rollplex convert`: Hugging Face <-> megatron per-rank checkpoints.

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

from rollplex_megatron.checkpoint import hf as H
from rollplex_megatron.checkpoint import layout as L
from rollplex_megatron.config import ModelConfig, ParallelConfig, VisionConfig, check_model_parallel

META = "rollplex_mcore.json"
FORMAT = "rollplex-mcore-v1"


def rank_file(tp_rank: int, pp_rank: int) -> str:
    """File name of one rank's shard."""
    return f"tp{tp_rank:02d}_pp{pp_rank:03d}.pt"


def _build_atomically(out: Path, fill) -> Path:
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
    ckpt = H.HFCheckpoint(hf_dir)
    cfg = ckpt.model_config()
    check_model_parallel(cfg, ParallelConfig(tp=tp, pp=pp))
    H.validate_checkpoint(ckpt, cfg)

    def fill(tmp: Path) -> None:
        for p in range(pp):
            for t in range(tp):
                state = H.shard_checkpoint(ckpt, cfg, t, tp, p, pp)
                H.atomic_save(lambda f, s=state: torch.save(s, f), tmp / rank_file(t, p))
        meta = {"format": FORMAT, "tp": tp, "pp": pp, "naming": dataclasses.asdict(ckpt.naming),
                "model": dataclasses.asdict(cfg), "hf_config": ckpt.raw_config}
        H.atomic_write_text(tmp / META, json.dumps(meta, indent=2))

    return _build_atomically(Path(out_dir), fill)


def read_meta(mcore_dir: str | os.PathLike) -> dict:
    """The metadata of a megatron checkpoint directory, checked."""
    path = Path(mcore_dir) / META
    if not path.is_file():
        raise H.CheckpointError(f"{mcore_dir}: no {META}; not a rollplex megatron checkpoint")
    meta = json.loads(path.read_text())
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
    naming = L.HFNaming(**meta["naming"])
    for p in range(pp):
        for t in range(tp):
            if not (Path(mcore_dir) / rank_file(t, p)).is_file():
                raise H.CheckpointError(f"{mcore_dir}: missing {rank_file(t, p)} for tp={tp}, pp={pp}")
    # mmap: each rank file is paged in tensor by tensor while exporting, never loaded whole.
    states = [[torch.load(Path(mcore_dir) / rank_file(t, p), mmap=True, weights_only=True)
               for t in range(tp)] for p in range(pp)]

    def fill(tmp: Path) -> None:
        H.write_safetensors(H.export_hf_tensors(states, cfg, tp, pp, naming), tmp, max_shard_bytes)
        H.atomic_write_text(tmp / "config.json", json.dumps(meta["hf_config"], indent=2))

    return _build_atomically(Path(out_dir), fill)
