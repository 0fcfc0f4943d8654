"""Atomic training checkpoints: one file per global rank, published by one directory rename.

Layout under `<run_dir>/checkpoints/`:
  step_<NNNNNN>/rank<RRRRR>.pt  this rank's actor and reference shard, optimizer state, RNG states,
                                its (tp, pp, dp) ranks
  step_<NNNNNN>/meta.json       step, world size, tp/pp/dp, the resolved config (YAML) and the data
                                files' fingerprint
  latest                        name of the newest published step directory
Rank files hold tensors and plain values only (what is not a tensor is JSON: `extra_json`) and are read
through torch's weights-only unpickler, so a checkpoint cannot name code to run when it is opened; format 1
files (numpy's RNG state as an ndarray, `extra` as a dict) are read through the same loader with numpy's
array types allowed.
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

from contextlib import nullcontext

import errno
import json
import os
import random
import shutil
import uuid
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from rollplex_megatron.checkpoint.files import CheckpointError, load_torch_file, read_json
from rollplex_megatron.dist import train_world
from rollplex_megatron.runtime import device

CHECKPOINTS = "checkpoints"
LATEST = "latest"
META = "meta.json"
FORMAT = 2
FORMATS = (1, 2)
# meta.json's keys and their types; `data` (the data files' fingerprint) is absent before format 2.
META_KEYS = {"format": int, "step": int, "world_size": int, "tp": int, "pp": int, "dp": int, "config": str}
RANK_KEYS = ("model", "optimizer", "step", "rng")  # `reference` and `ranks` are absent from older files
# Format 1 saved numpy's RNG state as an ndarray: these rebuild an array and nothing else.
NUMPY_ARRAY_GLOBALS = (np._core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32)))
# Room left beyond a rank file's tensor bytes before a save starts (pickled structure, zip records).
SAVE_HEADROOM = 1.05
SAVE_HEADROOM_BYTES = 16 << 20


class DiskFullError(OSError):
    """A save ran out of space (or would): names the filesystem, the file and the last complete checkpoint."""

    def __str__(self) -> str:
        return self.strerror  # the message alone, without "[Errno 28]": it is a user's one-line error


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
    """Python, numpy, torch CPU, CUDA (if present) and megatron tracker RNG states of this process, as
    tensors and plain values (numpy's key array as an int64 tensor)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": random.getstate(),
            "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)},
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()}}


def _numpy_state(saved) -> tuple:
    """numpy's state tuple from `rng_states`' dict (format 2) or the tuple format 1 stored."""
    if isinstance(saved, dict):
        keys = saved["keys"].numpy().astype(np.uint32)
        return saved["kind"], keys, saved["pos"], saved["has_gauss"], saved["cached_gaussian"]
    return tuple(saved)


def set_rng_states(states: dict) -> None:
    """Restore what `rng_states` returned."""
    random.setstate(states["python"])
    np.random.set_state(_numpy_state(states["numpy"]))
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
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed write (a full disk) leaves no partial file behind
        raise


def _mount_point(path: Path) -> Path:
    """The mount point of the filesystem that holds `path`."""
    p = Path(os.path.abspath(path))
    while not os.path.ismount(p):
        p = p.parent
    return p


def _tensor_bytes(obj) -> int:
    """Bytes of every tensor inside nested dicts, lists and tuples."""
    if torch.is_tensor(obj):
        return obj.untyped_storage().nbytes() if obj.device.type != "meta" else 0
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _last_complete(root: Path) -> str:
    pointer = root / LATEST
    return pointer.read_text().strip() if pointer.is_file() else "no checkpoint yet"


def _disk_full(path: Path, need: int, free: int) -> DiskFullError:
    root = path.parent.parent
    return DiskFullError(errno.ENOSPC, f"no space left on {_mount_point(path.parent)} while writing {path} "
                         f"({free / 2**30:.2f} GiB free, about {need / 2**30:.2f} GiB needed for this rank); the "
                         f"partial save is removed and the last complete checkpoint stays {_last_complete(root)}; free "
                         f"space there or set train.out to a run directory on another filesystem")


def _save_rank_file(path: Path, state: dict) -> None:
    """torch.save `state` to `path` atomically; refused before writing when the filesystem has clearly too little
    room, and a write that runs out of space becomes a DiskFullError naming the filesystem and the file."""
    need = int(_tensor_bytes(state) * SAVE_HEADROOM) + SAVE_HEADROOM_BYTES
    free = shutil.disk_usage(path.parent).free
    if free < need:
        raise _disk_full(path, need, free)
    try:
        _write_atomic(path, lambda f: torch.save(state, f))
    except (OSError, RuntimeError) as e:
        # torch's zip writer reports ENOSPC as "RuntimeError: [enforce fail at inline_container.cc] unexpected pos"
        full = isinstance(e, OSError) and e.errno == errno.ENOSPC
        free = shutil.disk_usage(path.parent).free  # the partial file is gone (_write_atomic): this is the room left
        if full or free < need:
            raise _disk_full(path, need, free) from None
        raise


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
                    config_yaml: str = "", data: dict | None = None, host=None) -> Path:
    """Collective: write this rank's state and publish `step_<N>` atomically; returns its path. `host` (the memory
    manager's `host_reader()`): each tensor of the model, reference and optimizer states is written from what it
    returns, so classes the memory plan released are read from their host copies and never come back to the
    device for the save."""
    root = Path(run_dir) / CHECKPOINTS
    extra_json = _extra_json(extra)  # before any file: a value JSON cannot hold is a bug of the caller
    tmp = _shared_tmp_dir(root, step)
    rank = dist.get_rank()

    def write_rank():
        tensors = (lambda tree: _map_tensors(host, tree)) if host is not None else (lambda tree: tree)
        state = {"format": FORMAT, "model": tensors(_module(model).state_dict()),
                 "reference": None if reference is None else tensors(_module(reference).state_dict()),
                 "optimizer": tensors(optimizer.state_dict()), "step": int(step), "rng": rng_states(),
                 "ranks": _ranks(), "extra_json": extra_json}
        _save_rank_file(tmp / rank_file_name(rank), state)

    meta = {"format": FORMAT, "step": int(step), **_layout(), "config": config_yaml, "data": dict(data or {})}
    try:
        _collective(write_rank, f"writing checkpoint step {step}")
        final = _collective(lambda: _publish(root, tmp, step, meta), f"publishing checkpoint step {step}",
                            ranks_run=rank == 0)
    except BaseException:
        # Every rank has left the agreement, so none writes into `tmp` any more: rank 0 removes the partial save.
        if rank == 0 and tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final if final is not None else root / step_dir_name(step)


def _map_tensors(fn, tree):
    """`tree` (dicts, lists, tuples) with every tensor replaced by fn(tensor)."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return type(tree)((k, _map_tensors(fn, v)) for k, v in tree.items())
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a named tuple
        return type(tree)(*(_map_tensors(fn, v) for v in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_tensors(fn, v) for v in tree)
    return tree


def _extra_json(extra: dict | None) -> str:
    """`extra` as JSON text (the rank files hold no pickled Python objects)."""
    try:
        return json.dumps(dict(extra or {}), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"checkpoint extra state must be JSON (numbers, strings, lists, dicts): {e}") from None


def latest_checkpoint(run_dir) -> Path | None:
    """The step directory `latest` points at, or None when the run has no checkpoint yet."""
    root = Path(run_dir) / CHECKPOINTS
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_bytes().decode("utf-8", "replace").strip()
    if not (name.startswith("step_") and name[5:].isascii() and name[5:].isdigit()):  # nor a path out of root
        raise FileNotFoundError(f"{pointer} holds {name[:40]!r}, not a checkpoint's directory name (step_NNNNNN); "
                                f"the run directory was modified outside training")
    path = root / name
    if not (path / META).is_file():
        raise FileNotFoundError(f"{pointer} points at {path.name}, which has no {META}; the run directory "
                                f"was modified outside training")
    return path


def read_meta(path) -> dict:
    """meta.json of a published checkpoint directory, its keys and their types checked (CheckpointError
    naming the file and the key)."""
    file = Path(path) / META
    meta = read_json(file)
    if not isinstance(meta, dict):
        raise CheckpointError(f"{file}: holds a JSON {type(meta).__name__}, not the checkpoint's object of "
                              f"{', '.join(META_KEYS)}; the file was altered: restore it from a copy")
    for key, kind in META_KEYS.items():
        if key not in meta:
            raise CheckpointError(f"{file}: missing key {key!r} (a checkpoint's meta.json holds "
                                  f"{', '.join(META_KEYS)}); the file was altered: restore it from a copy, or use "
                                  f"another step's checkpoint")
        if not isinstance(meta[key], kind) or isinstance(meta[key], bool):
            raise CheckpointError(f"{file}: key {key!r} is {meta[key]!r}, not a{'n' if kind is int else ''} "
                                  f"{kind.__name__}; the file was altered: restore it from a copy")
    if meta["format"] not in FORMATS:
        raise CheckpointError(f"{file}: checkpoint format {meta['format']} is not one this version reads "
                              f"({', '.join(map(str, FORMATS))}); use the version of rollplex-megatron that wrote it")
    if not isinstance(meta.get("data", {}), dict):
        raise CheckpointError(f"{file}: key 'data' is not an object; the file was altered: restore it from a copy")
    return meta


def read_rank_state(file, **kwargs) -> dict:
    """One rank file, through the weights-only loader, with its keys checked; `extra` parsed from JSON
    (format 2) or taken as stored (format 1, plain values only under that loader)."""
    state = load_torch_file(file, allowed_globals=NUMPY_ARRAY_GLOBALS, map_location="cpu", **kwargs)
    if not isinstance(state, dict):
        raise CheckpointError(f"{file}: holds a {type(state).__name__}, not a rank's state; the file was altered "
                              f"or is not a training checkpoint")
    has_extra = "extra_json" in state or "extra" in state  # format 2 / format 1
    missing = [k for k in RANK_KEYS if k not in state] + ([] if has_extra else ["extra_json"])
    if missing:
        raise CheckpointError(f"{file}: missing key {missing[0]!r} of a rank's state; the file was altered or is "
                              f"not a training checkpoint: restore it from a copy, or use another step's checkpoint")
    if "extra_json" in state:
        try:
            state["extra"] = json.loads(state.pop("extra_json"))
        except (TypeError, ValueError):
            raise CheckpointError(f"{file}: its extra state is not valid JSON; the file was altered: restore it "
                                  f"from a copy") from None
    if not isinstance(state["extra"], dict):
        raise CheckpointError(f"{file}: its extra state is a {type(state['extra']).__name__}, not an object; the "
                              f"file was altered: restore it from a copy")
    return state


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


def load_checkpoint(path, model, reference, optimizer, holding=None) -> tuple[int, dict]:
    """Restore this rank's model, reference, optimizer and RNG states; returns (step, extra). `holding` (the memory
    manager's `holding`): the reference, then the masters with Adam's states, are on the device only while their
    own state is loaded."""
    holding = holding or (lambda names: nullcontext())
    path = Path(path)
    meta = read_meta(path)
    check_layout(meta, path)
    state = read_rank_state(path / rank_file_name(dist.get_rank()))
    if state.get("ranks", _ranks()) != _ranks():  # same sizes, another rank order: shards of one shape would swap
        raise ValueError(f"{path / rank_file_name(dist.get_rank())} holds the shard of (tp, pp, dp) ranks "
                         f"{state['ranks']}, but this process is {_ranks()}: the launch orders ranks differently "
                         f"from the run that saved it; launch it as that run was launched")
    _module(model).load_state_dict(state["model"])
    with holding(("reference_weights",)):
        _load_reference(reference, state.get("reference"), path)
    with holding(("main_weights", "optimizer_states")):
        optimizer.load_state_dict(state["optimizer"])
    set_rng_states(state["rng"])
    return state["step"], state["extra"]
