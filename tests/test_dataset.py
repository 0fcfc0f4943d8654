"""Datasets in verl's RL format: row order (seed, step, rank, resume), prefetch, the model from
`train.init_hf`, and bad input, each failing before any model is built with a message naming the row
or setting."""
import json
import re
from pathlib import Path

import pytest
import torch

from rollplex_megatron.cli import main as cli_main
from rollplex_megatron.data import build_source, source_name
from rollplex_megatron.data.dataset import DatasetSource
from rollplex_megatron.data.example import example_rows
from rollplex_megatron.recipes import load_run_config
from rollplex_megatron.report import read_metrics


def _cfg(example, *extra, rows="train.parquet"):
    return load_run_config([f"train.init_hf={example / 'model'}", f"data.train_files=[{example / rows}]",
                            "rollout.max_response_len=4", *extra])


def _ids(rows):
    return [r.meta.where for r in rows]


def test_rows_are_deterministic_disjoint_over_ranks_and_cover_epochs(example_dir):
    cfg = _cfg(example_dir)
    assert source_name(cfg) == "dataset"
    a, b = DatasetSource(cfg), DatasetSource(cfg)
    n, dp = 4, 2
    step3 = [_ids(a.rows(3, r, dp, n)) for r in range(dp)]
    assert step3 == [_ids(b.rows(3, r, dp, n)) for r in range(dp)]  # a resumed run reads the same rows
    assert not set(step3[0]) & set(step3[1])  # ranks read disjoint rows
    size = len(a.train)
    seen = [w for s in range(size // (n * dp)) for r in range(dp) for w in _ids(a.rows(s, r, dp, n))]
    assert len(seen) == len(set(seen)) == size - size % (n * dp)  # one epoch: no row twice
    first = a.rows(0, 0, 1, 2)
    assert torch.equal(first[0].prompt.input_ids, b.prompt(first[0].meta).input_ids)
    assert first[0].seed != first[1].seed
    other = DatasetSource(_cfg(example_dir, "data.seed=2"))
    assert _ids(other.rows(0, 0, 1, 8)) != _ids(a.rows(0, 0, 1, 8))  # data.seed changes the order
    plain = DatasetSource(_cfg(example_dir, "data.shuffle=false"))
    assert _ids(plain.rows(0, 0, 1, 3)) == [f"{example_dir / 'train.parquet'} row {k}" for k in range(3)]


def test_prefetch_gives_the_same_rows(example_dir):
    off = DatasetSource(_cfg(example_dir, "data.prefetch=off"))
    on = DatasetSource(_cfg(example_dir, "data.prefetch=on"))
    for step in range(3):
        a, b = off.rows(step, 0, 1, 3), on.rows(step, 0, 1, 3)
        assert _ids(a) == _ids(b)
        assert all(torch.equal(x.prompt.input_ids, y.prompt.input_ids) for x, y in zip(a, b))
    assert (2 + 1, 0, 1, 3) in on._prefetch.pending  # the next step is already being built


def test_model_comes_from_init_hf(example_dir):
    cfg = _cfg(example_dir, "model.freeze_vision=true")
    hf = json.loads((example_dir / "model" / "config.json").read_text())
    assert cfg.model.image_token_id == hf["image_token_id"] and cfg.model.freeze_vision
    with pytest.raises(ValueError, match=r"model\.vocab_size=151936 \(from model=qwen2_5_vl_3b\) disagrees"):
        _cfg(example_dir, "model=qwen2_5_vl_3b")
    with pytest.raises(ValueError, match=r"model\.num_layers=.*disagrees"):
        _cfg(example_dir, "model.num_layers=2")


def test_scores_go_through_the_tokenizer_and_the_reward(example_dir):
    src = DatasetSource(_cfg(example_dir, "reward.format_reward=0.5"))
    row = src.rows(0, 0, 1, 1)[0]
    tok = src.proc.tokenizer
    right = torch.tensor(tok.convert_tokens_to_ids([row.meta.ground_truth]))
    wrong = torch.tensor(tok.convert_tokens_to_ids(["A" if row.meta.ground_truth != "A" else "B"]))
    s = src.score(row, right)
    assert (s.reward, s.correct, s.answered) == (1.5, 1.0, 1.0)
    s = src.score(row, wrong)
    assert (s.reward, s.correct, s.answered) == (0.5, 0.0, 1.0)
    assert src.score(row, torch.tensor(tok.convert_tokens_to_ids(["red"]))).answered == 0.0
    assert src.max_new_tokens == 4 and tok.convert_tokens_to_ids("<|im_end|>") in src.stop_token_ids


def _as_files(rows, tmp):
    """Rows with their images and frames as PNG files (jsonl holds paths, not bytes)."""
    for k, r in enumerate(rows):
        for i, im in enumerate(r["images"]):
            (tmp / f"r{k}_{i}.png").write_bytes(im["bytes"])
            r["images"][i] = str(tmp / f"r{k}_{i}.png")
        for v, frames in enumerate(r["videos"]):
            for i, fr in enumerate(frames):
                (tmp / f"r{k}_v{v}_{i}.png").write_bytes(fr["bytes"])
            r["videos"][v] = [str(tmp / f"r{k}_v{v}_{i}.png") for i in range(len(frames))]
    return rows


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _bad(tmp_path, example_dir, edit, *extra):
    rows = _as_files(example_rows(6, seed=5, videos=True), tmp_path)
    edit(rows, tmp_path)
    _write_jsonl(tmp_path / "bad.jsonl", rows)
    cfg = load_run_config([f"train.init_hf={example_dir / 'model'}", f"data.train_files=[{tmp_path / 'bad.jsonl'}]",
                           *extra])
    return lambda: build_source(cfg)


def _missing_image(rows, tmp):
    rows[3]["images"] = [str(tmp / "nowhere.png")]


def _bad_video(rows, tmp):
    (tmp / "broken.mp4").write_bytes(b"not a video at all" * 10)
    rows[2]["videos"] = [{"video": str(tmp / "broken.mp4")}]


def _two_placeholders(rows, tmp):
    rows[1]["prompt"] = [{"role": "user", "content": "<image> <image> which colour ?"}]


def _no_reward(rows, tmp):
    rows[4]["data_source"] = "my_lab/colours"


def _bad_choice(rows, tmp):  # a ground truth multiple_choice cannot read (it used to fail when first drawn)
    rows[5]["reward_model"]["ground_truth"] = "blue"


def _no_truth(rows, tmp):
    rows[4]["reward_model"]["ground_truth"] = None


def _url_image(rows, tmp):
    rows[0]["images"] = ["https://example.org/a.png"]


def _string_images(rows, tmp):  # a path where a list of them belongs (it was read character by character)
    rows[2]["images"] = rows[2]["images"][0] if rows[2]["images"] else "a.png"


def _json_reward_model(rows, tmp):  # a dict column exported as a JSON string
    rows[1]["reward_model"] = json.dumps(rows[1]["reward_model"])


def _string_messages(rows, tmp):
    rows[3]["prompt"] = ["which colour?"]


def _typo_role(rows, tmp):
    rows[2]["prompt"] = [{"role": "usr", "content": "<image> which colour?"}]


def _no_role(rows, tmp):
    rows[1]["prompt"] = [{"content": "<image> which colour?"}]


def _empty_prompt(rows, tmp):
    rows[0]["prompt"] = [{"role": "system", "content": ""}, {"role": "user", "content": []}]
    rows[0]["images"] = []


def _null_content(rows, tmp):
    rows[5]["prompt"] = [{"role": "user", "content": None}]


def _folder_image(rows, tmp):  # it used to read as "does not exist"
    rows[3]["images"] = [str(tmp)]


def _folder_video(rows, tmp):
    rows[2]["videos"] = [{"video": str(tmp)}]


@pytest.mark.parametrize("edit,match", [
    (_missing_image, r"bad\.jsonl line 4: .*nowhere\.png"),
    (_bad_video, r"bad\.jsonl line 3: .*broken\.mp4"),
    (_two_placeholders, r"bad\.jsonl line 2: .*2.*1"),
    (_no_reward, r"my_lab/colours.*reward\.fns"),
    (_bad_choice, r"bad\.jsonl line 6: .*'blue' does not start with a letter A-J, for the built-in reward "
                  r"multiple_choice .*reward\.fns"),
    (_no_truth, r"bad\.jsonl line 5: ground_truth None is not a string or number"),
    (_url_image, r"bad\.jsonl line 1: media 'https://example\.org/a\.png' is a URL"),
    (_string_images, r"bad\.jsonl line 3: column 'images' is a str, want a list such as \['img\.png'\]"),
    (_json_reward_model, r"bad\.jsonl line 2: column 'reward_model' is a str, want a dict"),
    (_string_messages, r"bad\.jsonl line 4: 'prompt' must hold chat messages"),
    (_typo_role, r"^\S*bad\.jsonl line 3: 'prompt' message 0 has role 'usr'; the roles are \('system', 'user', "
                 r"'assistant', 'tool'\)$"),
    (_no_role, r"bad\.jsonl line 2: 'prompt' message 0 has role None"),
    (_empty_prompt, r"bad\.jsonl line 1: every message of 'prompt' is empty; a prompt needs text, an image or a video"),
    (_null_content, r"bad\.jsonl line 6: 'prompt' message 0's content must be a string or a list, got NoneType"),
    (_folder_image, r"^\S*bad\.jsonl line 4: images\[0\]: image \S+ is a folder, not a file; name an image file"),
    (_folder_video, r"^\S*bad\.jsonl line 3: videos\[0\]: video \S+ is a folder, not a file; name a video file"),
])
def test_bad_rows_fail_naming_the_row(tmp_path, example_dir, edit, match):
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        _bad(tmp_path, example_dir, edit)()


def test_jsonl_rows_named_by_the_line_an_editor_shows(tmp_path, example_dir):
    rows = _as_files(example_rows(4, seed=5), tmp_path)
    rows[2]["images"] = [str(tmp_path / "nowhere.png")]
    lines = [json.dumps(r) for r in rows]
    (tmp_path / "gaps.jsonl").write_text("\n".join(lines[:2] + ["", "  "] + lines[2:]) + "\n")
    cfg = load_run_config([f"train.init_hf={example_dir / 'model'}", f"data.train_files=[{tmp_path / 'gaps.jsonl'}]"])
    with pytest.raises(FileNotFoundError, match=r"gaps\.jsonl line 5: .*nowhere\.png"):  # row 2, after 2 blank lines
        build_source(cfg)


def test_json_array_file_reads_as_its_rows(tmp_path, example_dir):
    """A .json file may hold one JSON array of rows (as `datasets` reads it) or JSON lines; its rows are named
    "row K"; a row that is not an object is an error naming it, in either form."""
    rows = _as_files(example_rows(4, seed=9), tmp_path)
    _write_jsonl(tmp_path / "lines.json", rows)
    (tmp_path / "array.json").write_text(json.dumps(rows, indent=1))
    a, b = (build_source(load_run_config([f"train.init_hf={example_dir / 'model'}",
                                          f"data.train_files=[{tmp_path / f}]", "data.shuffle=false"]))
            for f in ("lines.json", "array.json"))
    ra, rb = a.rows(0, 0, 1, 4), b.rows(0, 0, 1, 4)
    assert [r.meta.where.rsplit(" ", 2)[1:] for r in rb] == [["row", str(k)] for k in range(4)]
    assert all(torch.equal(x.prompt.input_ids, y.prompt.input_ids) for x, y in zip(ra, rb))
    assert all(torch.equal(x.prompt.pixel_values, y.prompt.pixel_values) for x, y in zip(ra, rb))
    (tmp_path / "bad.json").write_text(json.dumps([rows[0], ["not", "a", "row"]]))
    (tmp_path / "bad.jsonl").write_text(json.dumps(rows[0]) + "\n" + json.dumps([1, 2]) + "\n")
    for name, where in (("bad.json", "row 1"), ("bad.jsonl", "line 2")):
        cfg = load_run_config([f"train.init_hf={example_dir / 'model'}", f"data.train_files=[{tmp_path / name}]"])
        with pytest.raises(ValueError, match=rf"{name} {where}: a row is a JSON object .*got list"):
            build_source(cfg)


def test_file_urls_read_as_paths(tmp_path, example_dir):
    rows = _as_files(example_rows(4, seed=9), tmp_path)
    plain = [dict(r, images=list(r["images"])) for r in rows]
    for r in rows:
        r["images"] = [f"file://{p}" for p in r["images"]]
    _write_jsonl(tmp_path / "urls.jsonl", rows)
    _write_jsonl(tmp_path / "plain.jsonl", plain)
    a, b = (build_source(load_run_config([f"train.init_hf={example_dir / 'model'}",
                                          f"data.train_files=[{tmp_path / f}]", "data.shuffle=false"]))
            for f in ("urls.jsonl", "plain.jsonl"))
    for x, y in zip(a.rows(0, 0, 1, 4), b.rows(0, 0, 1, 4)):
        assert torch.equal(x.prompt.input_ids, y.prompt.input_ids)
        assert (x.prompt.pixel_values is None) == (y.prompt.pixel_values is None)
        assert x.prompt.pixel_values is None or torch.equal(x.prompt.pixel_values, y.prompt.pixel_values)


def test_parquet_struct_columns_keep_only_each_rows_keys(tmp_path):
    """pyarrow gives every row of a struct column every key of the file, None where the row has none: a row's
    extra_info (and reward_model) holds only its own keys, so `extra_info.get(k, default)` sees the default."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rollplex_megatron.data.dataset import load_records

    rows = [{"prompt": [{"role": "user", "content": "q"}], "data_source": "bbox_iou", "images": [],
             "reward_model": {"ground_truth": [0, 0, 2, 2], "style": "rule"}, "extra_info": {"iou_threshold": 0.3}},
            {"prompt": [{"role": "user", "content": "q"}], "data_source": "bbox_iou", "images": [],
             "reward_model": {"ground_truth": [0, 0, 1, 1]}, "extra_info": {"index": 1}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "boxes.parquet")
    assert pq.read_table(tmp_path / "boxes.parquet").to_pylist()[1]["extra_info"] == {"iou_threshold": None,
                                                                                        "index": 1}  # pyarrow's fill
    got = load_records([str(tmp_path / "boxes.parquet")], ("prompt", "images", "videos"), "data.train_files")
    assert [r.extra_info for r in got] == [{"iou_threshold": 0.3}, {"index": 1}]
    assert got[0].ground_truth == [0, 0, 2, 2]


def test_generation_config_stop_tokens_end_a_response(tmp_path, example_dir):
    """The checkpoint's generation_config.json eos ids end a response as they end transformers' generate (the
    Qwen2.5-VL-Instruct config lists <|im_end|> and <|endoftext|>); a malformed one is an error naming it."""
    import shutil

    from rollplex_megatron.data.processor import VLProcessor

    model = tmp_path / "model"
    shutil.copytree(example_dir / "model", model)
    cfg = _cfg(example_dir)
    (model / "generation_config.json").unlink(missing_ok=True)
    before = VLProcessor(str(model), cfg.model).stop_token_ids
    extra = max(before) + 7
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [before[0], extra]}))
    after = VLProcessor(str(model), cfg.model).stop_token_ids
    assert set(after) == set(before) | {extra}
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": "<|endoftext|>"}))
    with pytest.raises(ValueError, match=r"generation_config\.json: eos_token_id '<\|endoftext\|>' is not a token"):
        VLProcessor(str(model), cfg.model)


def test_prompt_length_and_truncation(tmp_path, example_dir):
    src = DatasetSource(_cfg(example_dir))
    longest = max(src.lengths.values())
    row0 = src.lengths[f"{example_dir / 'train.parquet'} row 0"]
    with pytest.raises(ValueError, match=rf"row 0: the prompt is {row0} tokens, over rollout.max_prompt_len=20"):
        DatasetSource(_cfg(example_dir, "rollout.max_prompt_len=20"))
    # left truncation keeps the image: the cut lies in the system prompt's text
    cut = DatasetSource(_cfg(example_dir, f"rollout.max_prompt_len={longest - 3}", "data.truncation=left"))
    row = cut.rows(0, 0, 1, 1)[0]
    full = src.prompt(row.meta)
    assert row.prompt.input_ids.numel() <= longest - 3
    assert torch.equal(row.prompt.input_ids, full.input_ids[full.input_ids.numel() - row.prompt.input_ids.numel():])
    with pytest.raises(ValueError, match="would cut an image or video"):
        DatasetSource(_cfg(example_dir, "rollout.max_prompt_len=12", "data.truncation=left"))


def test_kv_budget_names_the_longest_row_and_the_largest_group(example_dir):
    """memory.kv_cache_gib's start-up check reads the dataset's longest prompt (after truncation) and the
    larger of the training group and val.n, and names the row, the settings and the fix."""
    from rollplex_megatron.rollout.embedded import check_kv_budget, kv_group_bytes

    src = DatasetSource(_cfg(example_dir))
    tokens, what = src.longest_prompt
    row = max(src.lengths, key=src.lengths.get)
    assert tokens == src.lengths[row] and what == f"the longest prompt, {row}"
    cut = DatasetSource(_cfg(example_dir, f"rollout.max_prompt_len={tokens - 3}", "data.truncation=left"))
    assert cut.longest_prompt[0] == tokens - 3  # the engine sees the truncated prompt
    cfg = _cfg(example_dir, "rollout.group_size=2", "val.n=6", f"data.val_files=[{example_dir / 'val.parquet'}]",
               "train.val_every=1")
    need = kv_group_bytes(cfg, src, 6, False)
    assert need > kv_group_bytes(cfg, src, 2, False) > 0
    cfg.memory.kv_cache_gib = need / 2**30
    check_kv_budget(cfg, src, {"rollout.group_size": 2, "val.n": 6}, False)  # exactly enough
    cfg.memory.kv_cache_gib = (need - 1) / 2**30
    check_kv_budget(cfg, src, {"rollout.group_size": 2}, False)  # the training group alone fits
    with pytest.raises(ValueError, match=rf"^memory\.kv_cache_gib=\S+ is too small: one group of the longest "
                                         rf"prompt, {re.escape(row)} \({tokens} tokens\) with val\.n=6 responses of "
                                         rf"up to rollout\.max_response_len=4 tokens .*lower val\.n / "
                                         rf"rollout\.max_response_len$"):
        check_kv_budget(cfg, src, {"rollout.group_size": 2, "val.n": 6}, False)
    cfg.rollout.engine = "sglang"  # SGLang sizes its own pool
    check_kv_budget(cfg, src, {"rollout.group_size": 2, "val.n": 6}, False)


def test_rendered_task_settings_with_data_files_are_refused(example_dir):
    with pytest.raises(ValueError, match=r"^task\.frames: a setting of the rendered task, which a run on "
                                         r"data\.train_files does not read \(its rows are the prompts\); drop"):
        _cfg(example_dir, "task.frames=4")
    with pytest.raises(ValueError, match=r"^task: a setting of the rendered task"):
        _cfg(example_dir, "task=motion")
    load_run_config(["task.frames=4"])  # the rendered task reads it


def test_empty_dataset_and_missing_settings(tmp_path, example_dir):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"data.train_files: .*empty\.jsonl hold no rows"):
        build_source(load_run_config([f"train.init_hf={example_dir / 'model'}",
                                      f"data.train_files=[{tmp_path / 'empty.jsonl'}]"]))
    for name, data in (("empty.parquet", b""), ("text.parquet", b"prompt,answer\n")):  # not parquet inside
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=rf"^data file .*{name} is not a readable parquet file \(.*\); write it "
                                             rf"again, or give the rows as jsonl$"):
            build_source(load_run_config([f"train.init_hf={example_dir / 'model'}",
                                          f"data.train_files=[{tmp_path / name}]"]))
    with pytest.raises(ValueError, match=r"^data\.image_key=imgs: no row of .*train\.parquet has a 'imgs' column "
                                         r"\(its columns: .*images.*\); set data\.image_key to the column"):
        build_source(_cfg(example_dir, "data.image_key=imgs"))  # a typo would read as rows without images
    with pytest.raises(ValueError, match="needs the model's processor"):
        build_source(load_run_config([f"data.train_files=[{example_dir / 'train.parquet'}]"]))
    with pytest.raises(ValueError, match=r"reward\.fn.*no_such_module"):
        build_source(_cfg(example_dir, "reward.fn=no_such_module:score"))
    with pytest.raises(ValueError, match="train.val_every > 0 needs data.val_files"):
        _cfg(example_dir, "train.val_every=2").check_training()
    # the wrong kind of path is named as such, not as missing
    (tmp_path / "noproc").mkdir()
    model = example_dir / "model"
    for over, match in [(f"data.train_files=[{example_dir}]", r"^data file .* is a folder; name the parquet / jsonl"),
                        (f"data.processor={model / 'tokenizer.json'}", r"^processor directory .*tokenizer\.json is a "
                                                                       r"file; name the folder that holds it"),
                        (f"data.processor={tmp_path / 'noproc'}", r"^processor directory .*noproc has no tokenizer")]:
        with pytest.raises(ValueError, match=match):
            build_source(load_run_config([f"train.init_hf={model}",
                                          f"data.train_files=[{example_dir / 'train.parquet'}]", over]))
    with pytest.raises(ValueError, match=r"^min_pixels \d+ \(from .*preprocessor_config\.json\) is above "
                                         r"data\.max_pixels=1: no image size fits"):
        build_source(_cfg(example_dir, "data.max_pixels=1"))  # the setting is named, not only the file
    with pytest.raises(ValueError, match=r"^train\.init_hf=.*config\.json is a file; name the Hugging Face"):
        load_run_config([f"train.init_hf={model / 'config.json'}"])


def test_jsonl_rows_with_image_paths(tmp_path, example_dir):
    _write_jsonl(tmp_path / "rows.jsonl", _as_files(example_rows(4, seed=9), tmp_path))
    src = build_source(load_run_config([f"train.init_hf={example_dir / 'model'}",
                                        f"data.train_files=[{tmp_path / 'rows.jsonl'}]", "data.shuffle=false"]))
    got = src.rows(0, 0, 1, 4)
    assert [r.meta.where.rsplit(" ", 2)[1:] for r in got] == [["line", str(n)] for n in (1, 2, 3, 4)]
    assert all(r.prompt.pixel_values is not None and r.prompt.image_grid_thw.shape == (1, 3) for r in got)


def test_the_readme_example_file_loads(example_dir):
    """examples/colour_squares/train.jsonl (the 10 lines the docs show): relative image paths are read from
    the file's folder, images and two-frame videos both build."""
    path = Path(__file__).resolve().parent.parent / "examples" / "colour_squares" / "train.jsonl"
    src = build_source(load_run_config([f"train.init_hf={example_dir / 'model'}", f"data.train_files=[{path}]",
                                        "data.shuffle=false"]))
    rows = src.rows(0, 0, 1, 10)
    assert len(src.train) == 10 and len(path.read_text().splitlines()) == 10
    assert sum(r.prompt.pixel_values_videos is not None for r in rows) == 3
    assert all(r.meta.images[0].startswith(str(path.parent)) for r in rows if r.meta.images)


def test_train_on_a_dataset_with_validation_runs(tmp_path, example_dir, capsys):
    """`train` on dataset rows: validation before training, every 2 steps and after the last, per
    data_source; the step records carry the data share, no KL (kl_coef 0: no reference) and the reward's extra
    metrics (the format reward's `format`, which is `answered` per response); the report has them."""
    run = tmp_path / "run"
    rc = cli_main(["train", f"train.init_hf={example_dir / 'model'}",
                   f"data.train_files=[{example_dir / 'train.parquet'}]",
                   f"data.val_files=[{example_dir / 'val.parquet'}]", "train.val_every=2", "train.steps=3",
                   "rollout.max_response_len=4", "workload.rollout_batch=16", "rollout.group_size=4",
                   "workload.responses_per_micro_batch=8", f"train.out={run}", "train.progress=false",
                   "val.temperature=1.0", "val.n=4", "reward.format_reward=0.5"])
    assert rc == 0
    steps, vals = read_metrics(run / "metrics.jsonl"), read_metrics(run / "metrics.jsonl", kind="val")
    assert [r["step"] for r in steps] == [1, 2, 3] and [v["step"] for v in vals] == [0, 2, 3]
    assert all(v["val/responses"] == 32 and 0 <= v["val/multiple_choice/reward_mean"] <= 1.5 for v in vals)
    assert vals[-1]["val/reward_mean"] > 0  # sampled at temperature 1: some answers (eval below is not 0 == 0)
    assert all(0 <= r["data_share"] < 1 and "kl_k1" not in r and r["rollout_logp_diff"] < 1e-5 for r in steps)
    assert all(r["reward_extra"] == {"format": pytest.approx(r["answered"])} for r in steps)
    assert any(0 < r["answered"] < 1 for r in steps)  # a mean over responses, not one response's value
    summary = json.loads((run / "summary.json").read_text())["modes"]["rollplex"]
    assert summary["val"]["last"]["step"] == 3 and (run / "report.png").stat().st_size > 0
    # `eval` on the run's final checkpoint (exported to HF) answers the validation rows as training did: it takes
    # the run's response length, validation sampling and reward (named in the record), none of them repeated here
    out = tmp_path / "eval.json"
    assert cli_main(["eval", "--run", str(run), f"data.val_files=[{example_dir / 'val.parquet'}]",
                     f"--out={out}"]) == 0
    got = json.loads(out.read_text())
    assert got["checkpoint_step"] == 3  # the latest, which --run without --step took
    assert {k: got[k] for k in vals[-1] if k.startswith("val/")} == {k: v for k, v in vals[-1].items()
                                                                     if k.startswith("val/")}
    assert got["settings_from_run"] == {"rollout.max_response_len": 4, "val.temperature": 1.0, "val.n": 4,
                                        "reward.format_reward": 0.5}
    # what the command line names wins over the run's
    assert cli_main(["generate", "--run", str(run), f"data.val_files=[{example_dir / 'val.parquet'}]",
                     "--rows=2", "val.n=2"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("-- response") == 4 and "<|vision_start|>" in printed
    import pyarrow.parquet as pq  # --rows above the rows there: all of them, and said so
    pq.write_table(pq.read_table(example_dir / "val.parquet").slice(0, 2), tmp_path / "two.parquet")
    assert cli_main(["generate", "--run", str(run), f"data.val_files=[{tmp_path / 'two.parquet'}]", "--rows=5",
                     "val.n=1"]) == 0
    out = capsys.readouterr()
    assert out.out.count("-- response") == 2 and "--rows 5, but data.val_files hold 2 rows" in out.err


def test_per_source_reward_functions_from_the_command_line(tmp_path, example_dir, monkeypatch):
    """The docs' form `+reward.fns={SOURCE: 'package.module:function'}` reaches the registry; a key that names
    no row's data_source (a typo, whose rows the built-in would score without a word) is refused at load."""
    (tmp_path / "cli_form_rewards.py").write_text("def first_letter(response, ground_truth, extra_info):\n"
                                            "    return float(response.strip()[:1] == ground_truth)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"^reward\.fns names data_source 'multiple_choise', which no row of .*"
                                         r"train\.parquet has \(they have multiple_choice\); did you mean "
                                         r"'multiple_choice'\? fix the key or drop it"):
        build_source(_cfg(example_dir, "+reward.fns={multiple_choise: 'cli_form_rewards:first_letter'}"))
    src = build_source(_cfg(example_dir, "+reward.fns={multiple_choice: 'cli_form_rewards:first_letter'}"))
    row = src.rows(0, 0, 1, 1)[0]
    tok = src.proc.tokenizer
    assert src.score(row, torch.tensor(tok.convert_tokens_to_ids([row.meta.ground_truth, "red"]))).reward == 1.0
    assert src.score(row, torch.tensor(tok.convert_tokens_to_ids(["red", row.meta.ground_truth]))).reward == 0.0


def test_make_example_failing_midway_leaves_nothing(tmp_path, monkeypatch):
    """make-example builds under a temporary name and renames when complete: a failure after the model was written
    leaves neither DIR nor the temporary folder, so the same command can run again."""
    import rollplex_megatron.data.example as ex

    def broken(path, rows):
        raise OSError("disk full")

    monkeypatch.setattr(ex, "write_rows", broken)
    with pytest.raises(OSError, match="disk full"):
        ex.make_example(tmp_path / "ex", load_run_config([]).model, train_rows=2, val_rows=2)
    assert list(tmp_path.iterdir()) == []
