"""Datasets on disk in verl's RL format as a DataSource (`data.train_files`, `data.val_files`).

A row (parquet or jsonl) holds `prompt` (chat messages whose text has `<image>` / `<video>`
placeholders), `images` (paths, bytes or `{"image": ...}`), `videos` (frame lists or files; relative
paths are read from the data file's folder),
`reward_model` (`{"ground_truth": ..., "style": "rule"}`), `data_source` and `extra_info`. Every row
is checked when the source is built, before any model exists: its images and videos open, its
placeholders match them, its prompt fits `rollout.max_prompt_len`, and its data_source has a reward
function. The order is a pure function of (data.seed, epoch, step, rank), so a resumed run reads
the rows it would have read, and data-parallel ranks read disjoint slices of each step.
"""
from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from rollplex_megatron.config import DataConfig, RunConfig
from rollplex_megatron.data.processor import VLProcessor
from rollplex_megatron.data.rewards import RewardRegistry
from rollplex_megatron.data.source import Row, Score
from rollplex_megatron.prefix.batch import Prompt

try:  # parquet files only (pinned in constraints.txt); jsonl rows and the package itself need no pyarrow
    import pyarrow as pa
    import pyarrow.parquet as pq
except ImportError:
    pa = pq = None

FORMATS = (".parquet", ".jsonl", ".json")
STRUCT_COLUMNS = ("reward_model", "extra_info")  # dict columns whose keys vary by row
URL_SCHEMES = ("http://", "https://", "s3://", "gs://", "hf://")  # not read: rows name local files


ROLES = ("system", "user", "assistant", "tool")  # the roles of the Qwen2.5-VL chat template


def _without_none(value):
    """A parquet struct value without the keys its row does not have (pyarrow fills them with None)."""
    return {k: v for k, v in value.items() if v is not None} if isinstance(value, dict) else value


@dataclass
class Record:
    """One dataset row and where it came from (error messages name `where`)."""

    where: str  # "FILE row K"
    messages: list
    images: list
    videos: list
    ground_truth: object
    data_source: str
    extra_info: dict = field(default_factory=dict)


def read_rows(path: str) -> list[tuple[str, dict]]:
    """The rows of one parquet / jsonl / json file as dicts, each with the name errors give it: "row K" (0-based)
    in a parquet file or a .json file holding one JSON array, "line N" (1-based, blank lines counted, as an editor
    shows it) in JSON lines (.jsonl, or .json with one object per line). A missing file or format is an error
    naming it."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"data file {path} is a folder; name the parquet / jsonl files in it, e.g. "
                         f"[{p / 'train.parquet'}]")
    if not p.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    if p.suffix == ".parquet":
        if pq is None:
            raise ValueError(f"reading {path} needs pyarrow: pip install pyarrow (or convert the rows to jsonl)")
        try:
            table = pq.read_table(p)
        except (pa.ArrowException, OSError) as e:  # empty, truncated, or another format under a .parquet name
            raise ValueError(f"data file {path} is not a readable parquet file ({' '.join(str(e).split())}); "
                             f"write it again, or give the rows as jsonl") from None
        # a struct column gives every row every key of the file: the keys a row does not have come back as None
        return [(f"row {k}", {c: _without_none(v) if c in STRUCT_COLUMNS else v for c, v in row.items()})
                for k, row in enumerate(table.to_pylist())]
    if p.suffix in (".jsonl", ".json"):
        text = p.read_text(encoding="utf-8")
        if p.suffix == ".json" and text.lstrip().startswith("["):  # one JSON array of rows, as `datasets` reads it
            try:
                rows = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {e.lineno}: malformed JSON ({e.msg})") from None
            return _objects(path, [(f"row {k}", r) for k, r in enumerate(rows)])
        rows = []
        for k, line in enumerate(text.splitlines()):
            if line.strip():
                try:
                    rows.append((f"line {k + 1}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path} line {k + 1}: malformed JSON ({e.msg})") from None
        return _objects(path, rows)
    raise ValueError(f"data file {path}: unknown format {p.suffix!r}; use one of {FORMATS}")


def _objects(path: str, rows: list[tuple[str, object]]) -> list[tuple[str, dict]]:
    """`rows` when each is a JSON object; else an error naming the first that is not."""
    for label, r in rows:
        if not isinstance(r, dict):
            raise ValueError(f"{path} {label}: a row is a JSON object ({{\"prompt\": ..., ...}}), got "
                             f"{type(r).__name__}")
    return rows


def _resolve(item, base: Path, where: str):
    """Relative media paths (plain, in frame lists, under "image"/"video"/"path") against the data file's folder;
    `file://` paths as paths; a URL is an error naming the row (`where`)."""
    if isinstance(item, str):
        if item.startswith(URL_SCHEMES):
            raise ValueError(f"{where}: media {item!r} is a URL; rows name local files (download it and give its "
                             f"path, absolute or relative to the data file)")
        item = item.removeprefix("file://")
        return item if Path(item).is_absolute() else str(base / item)
    if isinstance(item, list):
        return [_resolve(x, base, where) for x in item]
    if isinstance(item, dict):
        return {k: _resolve(v, base, where) if k in ("image", "video", "path") else v for k, v in item.items()}
    return item


def _column(row: dict, key: str, want: type, where: str, example: str):
    """`row[key]` (a missing or null column: empty) when it is a `want`; else an error naming the row, the column
    and the form it needs."""
    value = row.get(key)
    if value is None:
        return want()
    if not isinstance(value, want):
        raise ValueError(f"{where}: column {key!r} is a {type(value).__name__}, want a {want.__name__} such as "
                         f"{example}")
    return value


def _record(row: dict, where: str, keys: tuple[str, str, str], base: Path) -> Record:
    prompt_key, image_key, video_key = keys
    if not isinstance(row, dict) or prompt_key not in row:
        raise ValueError(f"{where}: no {prompt_key!r} column (set data.prompt_key to the column of chat messages)")
    messages = row[prompt_key]
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: {prompt_key!r} must be a non-empty list of chat messages")
    if not all(isinstance(m, dict) and "content" in m for m in messages):
        raise ValueError(f"{where}: {prompt_key!r} must hold chat messages {{'role': ..., 'content': ...}}")
    for k, m in enumerate(messages):  # the chat template renders any role: a typo would become a turn of its own
        if m.get("role") not in ROLES:
            raise ValueError(f"{where}: {prompt_key!r} message {k} has role {m.get('role')!r}; the roles are {ROLES}")
        if not isinstance(m["content"], (str, list)):
            raise ValueError(f"{where}: {prompt_key!r} message {k}'s content must be a string or a list, got "
                             f"{type(m['content']).__name__}")
    if not any(m["content"] for m in messages):
        raise ValueError(f"{where}: every message of {prompt_key!r} is empty; a prompt needs text, an image or a video")
    rm = _column(row, "reward_model", dict, where, "{'ground_truth': ..., 'style': 'rule'}")
    if "ground_truth" not in rm:
        raise ValueError(f"{where}: no reward_model.ground_truth")
    extra = _column(row, "extra_info", dict, where, "{'index': 0}")
    images = [_resolve(x, base, where) for x in _column(row, image_key, list, where, "['img.png']")]
    videos = [_resolve(x, base, where) for x in _column(row, video_key, list, where, "[['f0.png', 'f1.png']]")]
    source = row.get("data_source")
    source = "" if source is None or (isinstance(source, float) and source != source) else str(source)  # None, NaN
    return Record(where, messages, images, videos, rm["ground_truth"], source, dict(extra))


def load_records(files: list[str], keys: tuple[str, str, str], setting: str) -> list[Record]:
    """Every row of `files` (an empty list or an empty dataset is an error naming `setting`)."""
    if not files:
        raise ValueError(f"{setting} is empty: give parquet or jsonl files, e.g. {setting}=[train.parquet]")
    out = []
    for f in files:
        rows = read_rows(f)
        for setting_name, key, default in (("data.image_key", keys[1], DataConfig.image_key),
                                           ("data.video_key", keys[2], DataConfig.video_key)):
            if rows and key != default and not any(key in r for _, r in rows):  # a typo would read as "no media"
                columns = sorted({c for _, r in rows for c in r})
                raise ValueError(f"{setting_name}={key}: no row of {f} has a {key!r} column (its columns: "
                                 f"{', '.join(columns)}); set {setting_name} to the column of the rows' media lists")
        out += [_record(r, f"{f} {label}", keys, Path(f).parent) for label, r in rows]
    if not out:
        raise ValueError(f"{setting}: {', '.join(files)} hold no rows")
    return out


class Prefetcher:
    """Builds the next step's rows in one background thread while the current step runs."""

    def __init__(self, build):
        self.build, self.pool, self.pending = build, ThreadPoolExecutor(1, thread_name_prefix="data"), {}

    def get(self, key: tuple) -> list:
        """The rows of `key` (waiting for the prefetched ones), then start on the next step's."""
        fut: Future | None = self.pending.pop(key, None)
        rows = fut.result() if fut is not None else self.build(*key)
        nxt = (key[0] + 1, *key[1:])
        self.pending = {nxt: self.pool.submit(self.build, *nxt)}
        return rows


class DatasetSource:
    """Rows of `data.train_files` through the checkpoint's processor, scored by the reward registry."""

    name = "dataset"

    def __init__(self, cfg: RunConfig, training: bool = True):
        """`training`: the rows are a run's (train + val files), so every `reward.fns` key must name one of their
        data_sources; an evaluation (`eval`, `generate`) answers a subset and takes the run's functions as they are."""
        d = cfg.data
        path = d.processor or cfg.train.init_hf
        if not path:
            raise ValueError("data.train_files needs the model's processor: set train.init_hf=DIR (a Qwen2.5-VL "
                             "checkpoint with its tokenizer and processor configs) or data.processor=DIR")
        self.proc = VLProcessor(path, cfg.model, min_pixels=d.min_pixels or None, max_pixels=d.max_pixels or None,
                                video_fps=d.video_fps, max_frames=d.max_frames, min_frames=d.min_frames)
        self.rewards = RewardRegistry(cfg.reward.fn, dict(cfg.reward.fns), cfg.reward.format_reward,
                                      cfg.reward.timeout_s)
        self.max_prompt_len, self.truncation = cfg.rollout.max_prompt_len, d.truncation
        self.keys = keys = (d.prompt_key, d.image_key, d.video_key)
        self.lengths: dict[str, int] = {}  # prompt tokens per row (`where`), from the check
        self.train = self._checked(load_records(d.train_files, keys, "data.train_files"))
        self.val = self._checked(load_records(d.val_files, keys, "data.val_files")) if d.val_files else []
        if training:
            self.rewards.check_fns_used({r.data_source for r in self.train + self.val},
                                        ", ".join(map(str, [*d.train_files, *d.val_files])))
        where = max(self.lengths, key=self.lengths.get)  # memory.kv_cache_gib's start-up check
        self.longest_prompt = (self.lengths[where], f"the longest prompt, {where}")
        self.seed, self.shuffle, self.data_seed = cfg.seed, d.shuffle, d.seed
        self.stop_token_ids = self.proc.stop_token_ids
        self.max_new_tokens = cfg.rollout.max_response_len
        self.chance_reward = self.chance_accuracy = None
        prefetch = d.prefetch == "on" or (d.prefetch == "auto" and torch.cuda.is_available())
        self._prefetch = Prefetcher(self._build_rows) if prefetch else None

    def _checked(self, records: list[Record]) -> list[Record]:
        """Each row's media, placeholders, prompt length and reward function, before any model work."""
        for r in records:
            self.rewards.check([r.data_source], r.where)  # the error names the first row without a function
            self.rewards.check_ground_truth(r.ground_truth, r.extra_info, r.data_source, r.where)
            n = self._length(r)
            if n > self.max_prompt_len and self.truncation == "error":
                raise ValueError(f"{r.where}: the prompt is {n} tokens, over rollout.max_prompt_len="
                                 f"{self.max_prompt_len}; raise it, lower data.max_pixels / data.max_frames, or set "
                                 f"data.truncation=left")
            if n > self.max_prompt_len:
                self._truncate(self.proc.build(r.messages, r.images, r.videos), r)  # fails now, not mid-run
            self.lengths[r.where] = min(n, self.max_prompt_len)
        return records

    def _length(self, r: Record) -> int:
        sizes = [im.size[::-1] for im in self._media(r, self.keys[1], r.images, self.proc.load_image)]
        shapes = self._media(r, self.keys[2], r.videos, self.proc.video_shape)  # a file is decoded, no frame kept
        try:
            return self.proc.prompt_length(r.messages, sizes, shapes)
        except (ValueError, FileNotFoundError, OSError) as e:
            raise type(e)(f"{r.where}: {e}") from None

    @staticmethod
    def _media(r: Record, key: str, items: list, load) -> list:
        """`load` of each of a row's images or videos; an error names the row and the item (`key[k]`)."""
        out = []
        for k, item in enumerate(items):
            try:
                out.append(load(item))
            except (ValueError, FileNotFoundError, OSError) as e:
                raise type(e)(f"{r.where}: {key}[{k}]: {e}") from None
        return out

    def _truncate(self, prompt: Prompt, r: Record) -> Prompt:
        """data.truncation=left: drop the oldest tokens, never part of an image or video."""
        cut = prompt.input_ids.numel() - self.max_prompt_len
        if cut <= 0:
            return prompt
        m = self.proc.model
        special = {m.image_token_id, m.video_token_id, m.vision_start_token_id, m.vision_end_token_id}
        if any(int(t) in special for t in prompt.input_ids[:cut]):
            raise ValueError(f"{r.where}: the prompt is {prompt.input_ids.numel()} tokens, over rollout.max_prompt_len="
                             f"{self.max_prompt_len}, and left truncation would cut an image or video; raise "
                             f"rollout.max_prompt_len or lower data.max_pixels")
        return Prompt(prompt.input_ids[cut:], prompt.pixel_values, prompt.image_grid_thw, prompt.pixel_values_videos,
                      prompt.video_grid_thw, prompt.second_per_grid_ts)

    def order(self, epoch: int) -> np.ndarray:
        """The row order of `epoch` (a fresh permutation per epoch when data.shuffle)."""
        n = len(self.train)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.data_seed, epoch]).permutation(n)

    def positions(self, step: int, dp_rank: int, dp_size: int, n: int) -> list[int]:
        """Global stream positions of this rank's `n` rows of `step` (epochs follow each other)."""
        start = step * n * dp_size + dp_rank * n
        return list(range(start, start + n))

    def _build_rows(self, step: int, dp_rank: int, dp_size: int, n: int) -> list[Row]:
        rows, size, orders = [], len(self.train), {}
        for pos in self.positions(step, dp_rank, dp_size, n):
            epoch = pos // size
            if epoch not in orders:
                orders[epoch] = self.order(epoch)
            rec = self.train[int(orders[epoch][pos % size])]
            rows.append(Row(self.prompt(rec), seed=self.seed * 1_000_003 + pos, meta=rec))
        return rows

    def prompt(self, rec: Record) -> Prompt:
        """The processor's prompt of one record (truncated on the left when allowed)."""
        try:
            prompt = self.proc.build(rec.messages, rec.images, rec.videos)
        except (ValueError, FileNotFoundError, OSError) as e:
            raise type(e)(f"{rec.where}: {e}") from None
        return self._truncate(prompt, rec)

    def rows(self, step: int, dp_rank: int, dp_size: int, n: int) -> list[Row]:  # noqa: D102
        if self._prefetch is None:
            return self._build_rows(step, dp_rank, dp_size, n)
        return self._prefetch.get((step, dp_rank, dp_size, n))

    def _val(self, max_rows: int) -> list[Record]:
        return self.val[:max_rows] if max_rows else self.val

    def val_rows(self, dp_rank: int, dp_size: int, max_rows: int) -> list[Row]:
        """This rank's slice of the validation rows (at most `max_rows` in all; 0: every row)."""
        return [Row(self.prompt(r), seed=self.seed * 7_919 + k, meta=r) for k, r in enumerate(self._val(max_rows))
                if k % dp_size == dp_rank]

    def val_sources(self, max_rows: int) -> list[str]:
        """The data_sources of the validation rows (the same list on every rank)."""
        return sorted({r.data_source for r in self._val(max_rows)})

    def score(self, row: Row, tokens: torch.Tensor) -> Score:  # noqa: D102
        rec: Record = row.meta
        res = self.rewards.score(self.proc.decode(tokens), rec.ground_truth, rec.extra_info, rec.data_source,
                                 rec.where)
        return Score(res.score, res.acc, res.answered, dict(res.extra))

    def shape_prompts(self, k: int) -> list[Prompt]:  # noqa: D102
        longest = sorted(self.train, key=lambda r: -self.lengths[r.where])[:k]
        return [self.prompt(r) for r in longest]
