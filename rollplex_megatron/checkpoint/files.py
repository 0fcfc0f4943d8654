"""Checkpoint file primitives, the same for every model: atomic writes, JSON and torch-file reads whose errors
name the file, and size-capped safetensors shards with an index.
"""
from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import torch
from safetensors.torch import save_file

INDEX = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint does not match the model: names the tensor and the numbers."""


def check_model_type(hf: dict, where: str, supported: dict[str, str]) -> None:
    """config.json's `model_type` must be one of `supported` (model_type -> transformers class), checked before any
    field is read; the refusal names what was found and lists what is supported."""
    mt = hf.get("model_type") if isinstance(hf, dict) else None
    if mt not in supported:
        found = f"model_type {mt!r}" + (f" ({', '.join(hf['architectures'])})" if hf.get("architectures") else "")
        raise CheckpointError(f"{where}: {found} is not supported; supported: "
                              + ", ".join(f"{k} ({v})" for k, v in supported.items()))


def read_json(path: Path):
    """A checkpoint's JSON file; a truncated or malformed one is a CheckpointError naming it."""
    try:
        return json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e}); the file is truncated or damaged: copy it again from "
                              f"its source") from None


def load_torch_file(path: Path, allowed_globals: tuple = (), **kwargs):
    """A checkpoint's `torch.save` file through torch's weights-only unpickler: tensors and plain values only,
    plus `allowed_globals`. A file that names any other Python object is refused without running it (a shared
    run directory must not be a way to run code on whoever opens it); a truncated or damaged file is a
    CheckpointError naming it too."""
    try:
        with torch.serialization.safe_globals(list(allowed_globals)):
            return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as e:
        found = [ln.strip() for ln in str(e).splitlines() if "GLOBAL" in ln]
        if not found:
            raise CheckpointError(f"{path}: not a readable checkpoint file ({_first_line(e)}); the file is truncated "
                                  f"or damaged: restore it from a copy, or use another step's checkpoint") from None
        raise CheckpointError(f"{path}: refused, it names Python code to run while loading "
                              f"({found[0].rstrip('.')}); this project's checkpoints hold only tensors and plain "
                              f"values, so the file was altered or written by something else; it was not loaded: "
                              f"use a checkpoint from a source you trust") from None
    except (RuntimeError, EOFError) as e:
        raise CheckpointError(f"{path}: not a readable checkpoint file ({_first_line(e)}); the file is truncated or "
                              f"damaged: restore it from a copy, or use another step's checkpoint") from None


def _first_line(e: BaseException) -> str:
    return next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)


def write_safetensors(tensors, out_dir: str | os.PathLike, max_shard_bytes: int = 4 << 30) -> list[str]:
    """Write (name, tensor) pairs as size-capped shards plus an index, each file atomically.

    A shard is written as soon as it is full, so at most one shard is held in memory; shards get
    their final `-of-N` names once N is known.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[tuple[str, list[str]]] = []
    cur: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal cur, size
        tmp = f".shard-{len(written):05d}.safetensors"
        atomic_save(lambda p, s=cur: save_file(s, p, metadata={"format": "pt"}), out / tmp)
        written.append((tmp, list(cur)))
        cur, size = {}, 0

    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if cur and size + nbytes > max_shard_bytes:
            flush()
        cur[name] = t
        size += nbytes
    if cur or not written:
        flush()
    n = len(written)
    files, wmap = [], {}
    for i, (tmp, names) in enumerate(written):
        fname = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(out / tmp, out / fname)
        files.append(fname)
        wmap.update({k: fname for k in names})
    if n > 1:
        atomic_write_text(out / INDEX, json.dumps({"metadata": {}, "weight_map": wmap}, indent=2))
    return files


def atomic_save(write_fn, path: Path) -> None:
    """Write through a temporary file in the same folder, fsync, then rename over `path`."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write_fn(str(tmp))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    """Text file written atomically."""
    def _w(p):
        with open(p, "w") as f:
            f.write(text)
    atomic_save(_w, path)
