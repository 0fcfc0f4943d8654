"""`make-example --verl` (data/example.py): the variant verl 0.9.1 takes as it is, checked with verl's own code on CPU
(its processor loader, its Qwen token builder, its agent loop's decode-and-re-expand of a prompt); the plain example
stays the one for this project's `train` (the option is opt-in). The whole verl run on it: test_verl_e2e_step.py."""
import io
import json

import pyarrow.parquet as pq
import pytest
from PIL import Image
from transformers import AutoTokenizer
from verl.utils import hf_processor
from verl.utils.tokenizer import build_multimodal_processor_inputs, get_processor_token_id
from verl.utils.tokenizer.continuous_token import QwenContinuousTokenBuilder

from rollplex_megatron import cli
from rollplex_megatron.data.example_files import QWEN2_VIDEO_PROCESSOR, vision_tokens
from rollplex_megatron.data.processor import to_content
from rollplex_megatron.integrations.verl.video import NAME, RollplexQwen2VLVideoProcessor
from rollplex_megatron.recipes import load_run_config

# what verl's hf_processor / hf_tokenizer read from actor_rollout_ref.model.path, besides the weights
PROCESSOR_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "preprocessor_config.json", "video_preprocessor_config.json")


@pytest.fixture(scope="module")
def examples(tmp_path_factory):
    """{"verl": `make-example --verl DIR` through the CLI, with the line it prints; "plain": `make-example DIR`}."""
    root = tmp_path_factory.mktemp("examples")
    out = {}
    for name, flag in (("verl", ["--verl"]), ("plain", [])):
        assert cli.main(["make-example", str(root / name), "--train-rows", "6", "--val-rows", "1", *flag]) == 0
        out[name] = root / name
    return out


def _read(path) -> list[dict]:
    """A parquet file's rows (what verl's dataset reads)."""
    return pq.read_table(str(path)).to_pylist()


def agent_loop_round_trip(proc, row: dict) -> tuple[list[int], list[int]]:
    """(the prompt's ids, the ids verl's agent loop gets back): it collapses each placeholder run, decodes dropping
    special tokens, and has the processor expand the text again with the images (agent_loop.py,
    `_compute_multi_modal_inputs`)."""
    images = [Image.open(io.BytesIO(im["bytes"])).convert("RGB") for im in row["images"]]
    text = proc.apply_chat_template(to_content(row["prompt"])[0], add_generation_prompt=True, tokenize=False)
    ids = proc(text=[text], images=images, return_tensors="pt")["input_ids"][0].tolist()
    pads = {get_processor_token_id(proc, k) for k in ("image", "video")} - {None}
    collapsed = [t for i, t in enumerate(ids) if not (t in pads and i and ids[i - 1] == t)]
    again = build_multimodal_processor_inputs(proc, text=[proc.tokenizer.decode(collapsed, skip_special_tokens=True)],
                                              images=images)
    return ids, again["input_ids"][0].tolist()


def test_verl_example_is_what_verls_own_code_takes(examples):
    ex = examples["verl"] / "model"
    assert all((ex / f).is_file() for f in PROCESSOR_FILES), sorted(p.name for p in ex.iterdir())
    assert json.loads((ex / "video_preprocessor_config.json").read_text())["video_processor_type"] == NAME
    proc = hf_processor(str(ex))  # AutoProcessor through verl: builds only with the torchvision-free video processor
    assert isinstance(proc.video_processor, RollplexQwen2VLVideoProcessor)
    QwenContinuousTokenBuilder(proc.tokenizer)  # verl's check: "\n" is one token
    assert len(proc.tokenizer.encode("\n", add_special_tokens=False)) == 1
    model = load_run_config([]).model
    pad = vision_tokens(model)["<|image_pad|>"]
    for row in _read(examples["verl"] / "train.parquet"):
        ids, again = agent_loop_round_trip(proc, row)
        # the placeholders survive the decode, so the processor expands the image to as many again
        assert [t for t in again if t == pad] == [t for t in ids if t == pad] and pad in ids
    lens = {len(agent_loop_round_trip(proc, r)[0]) for r in _read(examples["verl"] / "train.parquet")[:3]}
    assert len(lens) == 3, lens  # ragged: a verl batch whose samples all have one length fails


def test_verl_example_prints_the_verl_command(tmp_path, capsys):
    assert cli.main(["make-example", str(tmp_path / "ex"), "--verl", "--train-rows", "1", "--val-rows", "1"]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith("verl with: bash recipes/verl/run_qwen2_5_vl_rollplex.sh "), line
    for setting in (f"data.train_files={tmp_path / 'ex' / 'train.parquet'}",
                    f"actor_rollout_ref.model.path={tmp_path / 'ex' / 'model'}",
                    "data.custom_cls.name=RollplexRLHFDataset"):
        assert setting in line.split(), (setting, line)


def test_plain_example_is_unchanged_by_the_option(examples):
    """Without --verl: Qwen's video processor class, vision placeholders special, no newline token, one image size,
    as `train` has always read it; verl's own code refuses it (the option is what it needs)."""
    ex = examples["plain"] / "model"
    assert json.loads((ex / "video_preprocessor_config.json").read_text())["video_processor_type"] == \
        QWEN2_VIDEO_PROCESSOR
    tok = json.loads((ex / "tokenizer.json").read_text())
    specials = {t["content"] for t in tok["added_tokens"] if t["special"]}
    assert set(vision_tokens(load_run_config([]).model)) <= specials
    assert "\n" not in tok["model"]["vocab"] and all(t["content"] != "\n" for t in tok["added_tokens"])
    sizes = {Image.open(io.BytesIO(r["images"][0]["bytes"])).size for r in _read(examples["plain"] / "train.parquet")}
    assert sizes == {(28, 28)}
    with pytest.raises(ValueError, match="newline to tokenize to one token"):
        QwenContinuousTokenBuilder(AutoTokenizer.from_pretrained(str(ex)))


@pytest.mark.parametrize("args, message", [
    (["--family", "qwen3_vl"], "make-example --verl: model.family=qwen3_vl has not run through verl's driver here"),
    (["--videos"], "make-example --verl --videos: the verl path here reads image rows only"),
])
def test_verl_example_of_what_verl_has_not_run_is_refused(tmp_path, capsys, args, message):
    assert cli.main(["make-example", str(tmp_path / "ex"), "--verl", *args]) != 0
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "ex").exists()
