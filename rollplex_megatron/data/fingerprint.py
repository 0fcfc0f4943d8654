"""Fingerprints of a run's data files, so that a resumed run notices when its rows changed under it.

A checkpoint's meta.json records, per file of `data.train_files`, its size, its row count and a SHA-256 of
its bytes (which hold the rows); `train.resume=true` compares them with the files as they are now, before any
process starts, and refuses a change unless `data.accept_changed_files=true` says it is meant.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

try:
    import pyarrow.parquet as pq
except ImportError:  # dataset.py says how to install it when a parquet file is read
    pq = None

ACCEPT = "data.accept_changed_files"


def _rows(path: Path) -> int:
    """Rows of one data file, read as cheaply as its format allows (parquet: from its footer)."""
    if path.suffix == ".parquet" and pq is not None:
        return int(pq.ParquetFile(path).metadata.num_rows)
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            return len(json.loads(text))
        except ValueError:
            return -1
    return sum(1 for line in text.splitlines() if line.strip())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def fingerprint(files: list[str]) -> dict:
    """{absolute path: {"bytes", "rows", "sha256"}} of every existing file in `files` (a missing one is the data
    loader's error to report, not this record's)."""
    out = {}
    for name in files:
        p = Path(name).expanduser().absolute()
        if p.is_file():
            out[str(p)] = {"bytes": p.stat().st_size, "rows": _rows(p), "sha256": _sha256(p)}
    return out


def changes(saved: dict, files: list[str]) -> list[str]:
    """One phrase per file of `saved` that is missing or differs now ("" list: unchanged)."""
    now = fingerprint(files)
    found = []
    for path, old in saved.items():
        new = now.get(path)
        if new is None:
            found.append(f"{path} is gone")
        elif new != old:
            what = (f"rows {old['rows']} -> {new['rows']}" if new["rows"] != old["rows"]
                    else f"{old['bytes']} -> {new['bytes']} bytes" if new["bytes"] != old["bytes"]
                    else "same size, other content")
            found.append(f"{path} changed ({what})")
    return found


def check_unchanged(saved: dict, files: list[str], accept: bool, checkpoint: str) -> None:
    """ValueError naming the changed file when the data differs from what `checkpoint` trained on."""
    found = [] if accept else changes(saved, files)
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise ValueError(f"train.resume=true: data file {found[0]}{more} since {checkpoint} was saved; resume with "
                         f"the files the run trained on, or set {ACCEPT}=true to go on with the changed rows")
