"""Atomic training checkpoints: one file per global rank, published by one directory rename.

Layout under `<run_dir>/checkpoints/`:
  step_<NNNNNN>/rank<RRRRR>.pt  this rank's actor and reference shard, optimizer state, RNG states,
                                its (tp, pp, dp) ranks
  step_<NNNNNN>/meta.json       step, world size, tp/pp/dp and the resolved config (YAML)
  latest                        name of the newest published step directory
Every rank writes into `step_<N>.tmp-<uuid>/` (name chosen by rank 0 and broadcast), each file
through a temporary file and `os.replace`. Only when every rank reports success does rank 0 rename
the directory to `step_<N>` and then rewrite `latest`, both atomically. A crash at any earlier point
leaves the previous checkpoint and `latest` untouched; leftover `*.tmp-*` directories are ignored
(the launcher removes them at the next start, holding the run directory's lock: run_dir.py). A
crash between the two renames leaves a complete `step_<N>` that `latest` does not name; `latest`
still names the previous one, and saving step N again sets the orphan aside.
Checkpoints are per layout: loading needs the same tp, pp and dp (no resharding).
"""
from __future__ import annotations

import json
import os
import random
import uuid
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from rollplex_megatron.models.qwen25vl.hf import load_torch_file, read_json
from rollplex_megatron.dist import train_world
from rollplex_megatron.runtime import device

CHECKPOINTS = "checkpoints"
LATEST = "latest"
META = "meta.json"
FORMAT = 1


def step_dir_name(step: int) -> str:
    """Directory name of the checkpoint after `step` optimizer steps."""
    return f"step_{step:06d}"


def rank_file_name(rank: int) -> str:
    """File name of one global rank's state."""
    return f"rank{rank:05d}.pt"


def _module(model):
    # Callers pass megatron's DistributedDataParallel; its state_dict keys carry a `module.` prefix.
    return getattr(model, "module", model)


def _layout() -> dict:
    return {"world_size": dist.get_world_size(train_world()), "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(), "dp": ps.get_data_parallel_world_size()}


def _ranks() -> dict:
    return {"tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
            "dp": ps.get_data_parallel_rank()}


def rng_states() -> dict:
    """Python, numpy, torch CPU, CUDA (if present) and megatron tracker RNG states of this process."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()}}


def set_rng_states(states: dict) -> None:
    """Restore what `rng_states` returned."""
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    get_cuda_rng_tracker().set_states(states["tracker"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _agree(ok: bool, what: str) -> None:
    """Every rank learns whether all ranks succeeded; a rank that did not re-raises its own error."""
    dev = device()
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=dev)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=train_world())
    if ok and not int(flag):
        raise RuntimeError(f"{what} failed on another rank; nothing was published")


def _collective(fn, what: str, ranks_run: bool = True):
    """Run `fn` (on this rank if `ranks_run`), then agree across ranks on success."""
    try:
        out = fn() if ranks_run else None
    except BaseException:
        _agree(False, what)
        raise
    _agree(True, what)
    return out


def _set_aside_orphan(root: Path, final: Path) -> None:
    """Rank 0: a `step_<N>` that `latest` does not name (a crash came between the two renames) is
    renamed to a temporary name so that step N can be written again; the one `latest` names is kept."""
    if not final.exists():
        return
    pointer = root / LATEST
    if pointer.is_file() and pointer.read_text().strip() == final.name:
        raise FileExistsError(f"checkpoint {final} is the latest one; refusing to overwrite it")
    os.replace(final, root / f"{final.name}.tmp-orphan-{uuid.uuid4().hex}")


def _shared_tmp_dir(root: Path, step: int) -> Path:
    """Rank 0 creates `step_<N>.tmp-<uuid>` and broadcasts its name (or its error) to all ranks."""
    msg = [None]
    if dist.get_rank() == 0:
        final = root / step_dir_name(step)
        tmp = root / f"{final.name}.tmp-{uuid.uuid4().hex}"
        try:
            _set_aside_orphan(root, final)
            tmp.mkdir(parents=True)
            msg[0] = ("ok", tmp.name)
        except OSError as e:  # every rank must leave the broadcast, then all raise
            msg[0] = ("error", f"{type(e).__name__}: {e}")
    dist.broadcast_object_list(msg, src=0, group=train_world())
    kind, value = msg[0]
    if kind == "error":
        raise OSError(f"cannot start checkpoint step {step}: {value}")
    return root / value


def _publish(root: Path, tmp: Path, step: int, meta: dict) -> Path:
    """Rank 0: meta.json, fsync, rename the directory into place, then point `latest` at it."""
    _write_atomic(tmp / META, lambda f: f.write(json.dumps(meta, indent=1).encode()))
    _fsync_dir(tmp)
    final = root / step_dir_name(step)
    os.replace(tmp, final)
    _fsync_dir(root)
    _write_atomic(root / LATEST, lambda f: f.write(f"{final.name}\n".encode()))
    _fsync_dir(root)
    return final


def save_checkpoint(run_dir, step: int, model, reference, optimizer, extra: dict | None = None,
                    config_yaml: str = "") -> Path:
    """Collective: write this rank's state and publish `step_<N>` atomically; returns its path."""
    root = Path(run_dir) / CHECKPOINTS
    tmp = _shared_tmp_dir(root, step)
    rank = dist.get_rank()

    def write_rank():
        state = {"model": _module(model).state_dict(),
                 "reference": None if reference is None else _module(reference).state_dict(),
                 "optimizer": optimizer.state_dict(), "step": int(step), "rng": rng_states(), "ranks": _ranks(),
                 "extra": dict(extra or {})}
        _write_atomic(tmp / rank_file_name(rank), lambda f: torch.save(state, f))

    _collective(write_rank, f"writing checkpoint step {step}")
    meta = {"format": FORMAT, "step": int(step), **_layout(), "config": config_yaml}
    final = _collective(lambda: _publish(root, tmp, step, meta), f"publishing checkpoint step {step}",
                        ranks_run=rank == 0)
    return final if final is not None else root / step_dir_name(step)


def latest_checkpoint(run_dir) -> Path | None:
    """The step directory `latest` points at, or None when the run has no checkpoint yet."""
    root = Path(run_dir) / CHECKPOINTS
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    if not (path / META).is_file():
        raise FileNotFoundError(f"{pointer} points at {path.name}, which has no {META}; the run directory "
                                f"was modified outside training")
    return path


def read_meta(path) -> dict:
    """meta.json of a published checkpoint directory."""
    return read_json(Path(path) / META)


def check_layout(meta: dict, path) -> None:
    """Fail, naming the setting, when this run's parallel layout differs from the checkpoint's."""
    here = _layout()
    for key, setting in (("tp", "parallel.tp"), ("pp", "parallel.pp"), ("dp", "parallel.dp"),
                         ("world_size", "world size")):
        if meta[key] != here[key]:
            raise ValueError(f"checkpoint {path} was written with {setting}={meta[key]} but this run has "
                             f"{setting}={here[key]}; resume with the checkpoint's layout (tp={meta['tp']}, "
                             f"pp={meta['pp']}, dp={meta['dp']}); training checkpoints are not resharded")


def _load_reference(reference, saved, path) -> None:
    """The reference's state into `reference`. A saved reference the run does not build is left unread: the loss
    does not read it (`train.reference=auto` at kl_coef 0; checkpoints from before that setting saved one always).
    A reference the run needs and the checkpoint lacks cannot be made up (it is the run's initial policy)."""
    if reference is not None and saved is None:
        raise ValueError(f"checkpoint {path} has no reference model state, but this run scores a reference "
                         f"(train.reference / train.kl_coef > 0); resume with the settings of the run that saved it")
    if reference is not None:
        _module(reference).load_state_dict(saved)


def load_checkpoint(path, model, reference, optimizer) -> tuple[int, dict]:
    """Restore this rank's model, reference, optimizer and RNG states; returns (step, extra)."""
    path = Path(path)
    meta = read_meta(path)
    check_layout(meta, path)
    state = load_torch_file(path / rank_file_name(dist.get_rank()), map_location="cpu", weights_only=False)
    if state.get("ranks", _ranks()) != _ranks():  # same sizes, another rank order: shards of one shape would swap
        raise ValueError(f"{path / rank_file_name(dist.get_rank())} holds the shard of (tp, pp, dp) ranks "
                         f"{state['ranks']}, but this process is {_ranks()}: the launch orders ranks differently "
                         f"from the run that saved it; launch it as that run was launched")
    _module(model).load_state_dict(state["model"])
    _load_reference(reference, state["reference"], path)
    optimizer.load_state_dict(state["optimizer"])
    set_rng_states(state["rng"])
    return state["step"], state["extra"]
