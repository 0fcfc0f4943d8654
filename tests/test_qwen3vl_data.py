"""Dataset rows with videos for Qwen3-VL (data/frame_runs.py), `make-example` for a Qwen3-VL directory, and the
config refusals of Qwen3-VL settings.

The project's prompts are compared with transformers' own processors on the same rows and frames:
Qwen3VLProcessor (one `<t seconds>` run per temporal patch) and Qwen2_5_VLProcessor. transformers' video
processors run on torchvision, absent here, so three of its kernels are stood in by the same operations in
torch / PIL (`torchvision_stand_ins`): the bicubic resize (PIL, as the project resizes), torchvision's
`normalize` ((x - mean) / std) and its grey-to-RGB (frames are RGB already). Everything else (frame sampling,
the clip's pixel budget, fused rescale, patch order, timestamps, the text expansion and tokenising) is
transformers' code.
"""
import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLProcessor, Qwen3VLForConditionalGeneration
from transformers import processing_utils
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.video_processing_utils import BaseVideoProcessor, VideoProcessorMixin
from transformers.video_utils import VideoMetadata

from rollplex_megatron import cli
from rollplex_megatron.checkpoint import convert
from rollplex_megatron.checkpoint.convert import hf_config_from_model
from rollplex_megatron.data import frame_runs
from rollplex_megatron.data.dataset import DatasetSource
from rollplex_megatron.data.example import make_example
from rollplex_megatron.data.example_files import write_tiny_processor, write_video
from rollplex_megatron.data.processor import VLProcessor, to_content
from rollplex_megatron.dist import init_parallel, run_local
from rollplex_megatron.integrations.verl.video import RollplexQwen2VLVideoProcessor
from rollplex_megatron.models import registry
from rollplex_megatron.recipes import load_run_config
from tests.in_turn import case, in_turn
from tests.test_qwen3vl import sample_inputs


def _pil_resize(self, image, size, resample=None, **kwargs):
    """torchvision's resize of uint8 frames [..., 3, H, W], as PIL bicubic (the project's resize)."""
    flat = image.reshape(-1, *image.shape[-3:])
    out = [torch.from_numpy(np.asarray(Image.fromarray(f.permute(1, 2, 0).contiguous().numpy()).resize(
        (size.width, size.height), resample=Image.Resampling.BICUBIC)).copy()).permute(2, 0, 1) for f in flat]
    return torch.stack(out).reshape(*image.shape[:-2], size.height, size.width)


def _normalize(self, image, mean, std, inplace=False, **kwargs):
    """torchvision.transforms.v2.functional.normalize: (x - mean) / std per channel."""
    return (image - torch.as_tensor(mean).view(-1, 1, 1)) / torch.as_tensor(std).view(-1, 1, 1)


@pytest.fixture
def torchvision_stand_ins(monkeypatch):
    """transformers' torchvision video kernels in torch / PIL, and the class check ProcessorMixin does of a video
    processor (its namespace lacks VideoProcessorMixin without torchvision)."""
    monkeypatch.setattr(BaseVideoProcessor, "resize", _pil_resize)
    monkeypatch.setattr(BaseVideoProcessor, "normalize", _normalize)
    monkeypatch.setattr(processing_utils.transformers_module, "VideoProcessorMixin", VideoProcessorMixin,
                        raising=False)


@pytest.fixture(scope="module")
def q3_example(tmp_path_factory):
    """`make-example` for the tiny Qwen3-VL preset: ragged image rows and two-frame video rows."""
    return make_example(tmp_path_factory.mktemp("ex3") / "ex", load_run_config(["model=qwen3_vl_tiny"]).model,
                        train_rows=6, val_rows=2, videos=True, ragged=True)


def hf_qwen3_processor(path) -> Qwen3VLProcessor:
    """transformers' Qwen3VLProcessor from a checkpoint's processor files (each part by its own class, since
    AutoProcessor needs torchvision for the video processor)."""
    tok = AutoTokenizer.from_pretrained(path)
    return Qwen3VLProcessor(image_processor=Qwen2VLImageProcessorPil.from_pretrained(path), tokenizer=tok,
                            video_processor=Qwen3VLVideoProcessor.from_pretrained(path),
                            chat_template=tok.chat_template)


def hf_prompt(hf, proc: VLProcessor, messages, images, videos: list[tuple[torch.Tensor, float]], **kw) -> dict:
    """transformers' processor on the row: its text from the same chat template, its frames with their fps."""
    text = hf.apply_chat_template(to_content(messages)[0], tokenize=False, add_generation_prompt=True)
    video_kw = {"videos": [f for f, _ in videos], "do_convert_rgb": False,
                "video_metadata": [VideoMetadata(total_num_frames=f.shape[0], fps=fps) for f, fps in videos]} \
        if videos else {}
    return hf(text=[text], images=[proc.load_image(i) for i in images] or None, return_tensors="pt",
              **video_kw, **kw)


def _same(prompt, ref, videos: bool, images: bool, exact: bool = True) -> None:
    assert prompt.input_ids.tolist() == ref["input_ids"][0].tolist()
    close = torch.equal if exact else (lambda a, b: torch.allclose(a, b, atol=1e-5, rtol=0))
    if videos:
        assert prompt.video_grid_thw.tolist() == ref["video_grid_thw"].tolist()
        assert close(prompt.pixel_values_videos, ref["pixel_values_videos"])
    if images:
        assert prompt.image_grid_thw.tolist() == ref["image_grid_thw"].tolist()
        assert torch.equal(prompt.pixel_values, ref["pixel_values"])


def _frames(t, h, w, seed):
    return torch.randint(0, 256, (t, 3, h, w), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_dataset_rows_equal_transformers_qwen3vl_processor(q3_example, torchvision_stand_ins):
    """Every row of make-example's Qwen3-VL dataset (images, and two-frame videos as frame lists, read at
    data.video_fps) through the dataset path: ids, grids and pixels equal Qwen3VLProcessor's."""
    cfg = load_run_config([f"train.init_hf={q3_example / 'model'}",
                           f"data.train_files=[{q3_example / 'train.parquet'}]"])
    src = DatasetSource(cfg)
    hf = hf_qwen3_processor(q3_example / "model")
    seen = 0
    for rec in src.train:
        p = src.prompt(rec)
        videos = [src.proc.load_video(v) for v in rec.videos]
        _same(p, hf_prompt(hf, src.proc, rec.messages, rec.images, videos), bool(rec.videos), bool(rec.images))
        assert src.lengths[rec.where] == p.input_ids.numel()  # the start-up check's length, without pixel work
        seen += bool(rec.videos)
    assert seen >= 2


@pytest.mark.parametrize("frames,fps,hw", [(9, 4.0, (40, 56)), (30, 10.0, (64, 96)), (7, 3.0, (20, 36))])
def test_video_file_equals_transformers_qwen3vl_processor(q3_example, tmp_path, torchvision_stand_ins, frames,
                                                          fps, hw):
    """A video file (decoded with PyAV, sampled at 2 fps, an odd sampled count, frames resized up and down by the
    clip's budget) with an image in the same prompt: ids and pixels equal Qwen3VLProcessor's."""
    proc_dir = q3_example / "model"
    cfg = load_run_config([f"train.init_hf={proc_dir}"])
    proc = VLProcessor(str(proc_dir), cfg.model)
    path = write_video(str(tmp_path / "clip.mp4"), _frames(frames, *hw, seed=frames), fps=int(fps))
    img = Image.fromarray(_frames(1, 30, 20, seed=1)[0].permute(1, 2, 0).numpy())
    msgs = [{"role": "user", "content": "look at the <video> video . <image> which colour ?"}]
    p = proc.build(msgs, [img], [path])
    ref = hf_prompt(hf_qwen3_processor(proc_dir), proc, msgs, [img], [proc.load_video(path)])
    _same(p, ref, True, True)
    assert int((p.input_ids == cfg.model.vision_start_token_id).sum()) == 2 + p.video_grid_thw[0, 0]
    assert proc.prompt_length(msgs, [(30, 20)], [proc.video_shape(path)]) == p.input_ids.numel()


def test_timestamps_off_by_one_run_are_detected(q3_example, tmp_path, torchvision_stand_ins, monkeypatch):
    """Mutation: each run stamped with the next run's time; the ids no longer equal transformers'."""
    proc_dir = q3_example / "model"
    proc = VLProcessor(str(proc_dir), load_run_config([f"train.init_hf={proc_dir}"]).model)
    path = write_video(str(tmp_path / "clip.mp4"), _frames(9, 40, 56, seed=2), fps=4)
    msgs = [{"role": "user", "content": "<video> which colour ?"}]
    ref = hf_prompt(hf_qwen3_processor(proc_dir), proc, msgs, [], [proc.load_video(path)])
    _same(proc.build(msgs, [], [path]), ref, True, False)

    class Shifted(Qwen3VLProcessor):
        def _calculate_timestamps(self, indices, video_fps, merge_size=2):
            stamps = Qwen3VLProcessor._calculate_timestamps(self, indices, video_fps, merge_size)
            return [*stamps[1:], 2 * stamps[-1] - stamps[-2]]

    monkeypatch.setattr(frame_runs, "Qwen3VLProcessor", Shifted)
    with pytest.raises(AssertionError):
        _same(proc.build(msgs, [], [path]), ref, True, False)


def test_qwen25vl_video_rows_equal_transformers_processor(tmp_path, torchvision_stand_ins):
    """Qwen2.5-VL, unchanged: a frame-list video and a video file with an image, ids equal Qwen2_5_VLProcessor's
    (video pixels through the verl plugin's processor, the project's own video code: equal to 1e-5)."""
    model = load_run_config([]).model
    words = ["look", "at", "the", "video", ".", "which", "colour", "?"]
    path = write_tiny_processor(str(tmp_path / "p"), words, model, video_max_pixels=28 * 28 * 16)
    Qwen2_5_VLConfig.from_dict(hf_config_from_model(model)).save_pretrained(path)
    proc = VLProcessor(path, model)
    hf = Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessorPil.from_pretrained(path),
                             tokenizer=AutoTokenizer.from_pretrained(path), chat_template=proc.chat_template,
                             video_processor=RollplexQwen2VLVideoProcessor.from_dict(
                                 json.load(open(f"{path}/video_preprocessor_config.json"))))
    clip = write_video(str(tmp_path / "clip.mp4"), _frames(10, 40, 56, seed=3), fps=4)
    frame_list = [Image.fromarray(f.permute(1, 2, 0).numpy()) for f in _frames(4, 28, 56, seed=4)]
    img = Image.fromarray(_frames(1, 30, 20, seed=5)[0].permute(1, 2, 0).numpy())
    msgs = [{"role": "user", "content": "<video> look at the video . <image> <video> which colour ?"}]
    p = proc.build(msgs, [img], [clip, frame_list])
    videos = [proc.load_video(clip), proc.load_video(frame_list)]
    ref = hf_prompt(hf, proc, msgs, [img], videos, do_sample_frames=True, fps=proc.video_fps)
    _same(p, ref, True, True, exact=False)
    assert int((p.input_ids == model.vision_start_token_id).sum()) == 3  # one run per video


def test_make_example_qwen3vl_trains_two_steps_and_exports(tmp_path, torchvision_stand_ins, capsys):
    """`make-example --family qwen3_vl` writes a checkpoint transformers loads; `train` (the main job, its own
    process) on it runs 2 steps on CPU with the line make-example prints (validation at step 2, its third row a
    video), and the run's actor exported to HF loads in transformers with every tensor named as it reads them."""
    ex = tmp_path / "ex"
    assert cli.main(["make-example", str(ex), "--family", "qwen3_vl", "--videos", "--train-rows", "6",
                     "--val-rows", "3"]) == 0
    assert json.loads((ex / "model" / "config.json").read_text())["model_type"] == "qwen3_vl"
    hint = capsys.readouterr().out.splitlines()[0].split()
    assert hint[:6] == ["train", "with:", "python", "-m", "rollplex_megatron", "train"]
    overrides = [o for o in hint[6:] if not o.startswith(("train.steps=", "train.val_every="))]
    assert f"train.init_hf={ex / 'model'}" in overrides
    trained = subprocess.run([sys.executable, "-m", "rollplex_megatron", "train", *overrides, "train.steps=2",
                              "train.val_every=2", "workload.rollout_batch=4", "rollout.group_size=2",
                              "train.progress=false", f"train.out={tmp_path / 'run'}"],
                             capture_output=True, text=True, timeout=300)
    assert trained.returncode == 0, trained.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r][-1] == 2
    out = convert.train_to_hf(tmp_path / "run", tmp_path / "hf")
    model, info = Qwen3VLForConditionalGeneration.from_pretrained(str(out), output_loading_info=True)
    assert not any(info.values()), info  # every tensor by the names transformers reads, none left over
    assert model.config.vision_config.deepstack_visual_indexes == [0, 2]
    hf_qwen3_processor(ex / "model")  # transformers' own classes load the processor files


def test_qwen3_only_model_fields_on_qwen25vl_are_refused():
    """DeepStack indexes or a learned position table on a Qwen2.5-VL model would be ignored: refused at load,
    naming the setting and the family that reads it; the Qwen3-VL preset that sets them loads."""
    for override, shown in (("model.vision.deepstack_visual_indexes=[1,2]", "deepstack_visual_indexes=[1, 2]"),
                            ("model.vision.num_position_embeddings=16", "num_position_embeddings=16")):
        with pytest.raises(ValueError, match=rf"model\.vision\.{re.escape(shown)} is read only by "
                                             r"model\.family=qwen3_vl, and model\.family=qwen2_5_vl ignores it"):
            load_run_config([override])
    cfg = load_run_config(["model=qwen3_vl_tiny"]).model
    assert cfg.vision.deepstack_visual_indexes == [0, 2] and cfg.vision.num_position_embeddings == 16


RECOMPUTE = {"off": {}, "uniform1": {"recompute_granularity": "full", "recompute_method": "uniform",
                                     "recompute_num_layers": 1},
             "uniform3": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 3},
             "block2": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2}}


def recompute_grads(name: str, mutate: bool = False) -> dict:
    """One forward and backward of the tiny Qwen3-VL (random weights of seed 0; an image and a two-step video, so
    both DeepStack levels add features) with `megatron:` recompute settings RECOMPUTE[name]: the loss, every
    gradient and how many times the LLM layers ran. `mutate`: the recomputation runs layer 1 with its output
    nudged (a recompute that does not reproduce the forward)."""
    init_parallel(1, 1)
    cfg = load_run_config(["model=qwen3_vl_tiny"]).model
    torch.manual_seed(0)
    model = registry.model_spec(cfg).build(cfg, "float32", RECOMPUTE[name]).train()
    calls = [0]
    for i, layer in enumerate(model.language_model.decoder.layers):
        def hook(mod, args, out, i=i):
            calls[0] += 1
            if mutate and i == 1 and torch.is_grad_enabled():
                return (out[0] * 1.001, *out[1:])
            return None
        layer.register_forward_hook(hook)
    x = sample_inputs(cfg, "both", seed=3, batch=1)
    pos, _ = registry.model_spec(cfg).positions.sequence(cfg, x["input_ids"], x["image_grid_thw"],
                                                          x["video_grid_thw"])
    logits = model(input_ids=x["input_ids"], position_ids=pos, **{k: v for k, v in x.items() if k != "input_ids"})
    logits = logits[..., :cfg.vocab_size]  # the padded columns hold the dtype's lowest value
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(5))
    loss = (logits * weights).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.item(), "grads": grads, "layer_calls": calls[0]}


@pytest.fixture(scope="module")
def recompute_runs():
    """Every recompute setting, and the mutant, in one spawned process."""
    calls = {name: (recompute_grads, (name,)) for name in RECOMPUTE}
    calls["mutant"] = (recompute_grads, ("uniform1", True))
    return run_local(in_turn, 1, calls)[0]


@pytest.mark.parametrize("name", ["uniform1", "uniform3", "block2"])
def test_full_recompute_gives_the_same_gradients(recompute_runs, name):
    """`megatron.recompute_granularity=full` is honoured by the Qwen3-VL layer loop (the layers run again in the
    backward: 4 + the recomputed ones) and every gradient, DeepStack mergers included, equals the run without."""
    ref, run = case(recompute_runs, "off"), case(recompute_runs, name)
    recomputed = {"uniform1": 4, "uniform3": 4, "block2": 2}[name]
    assert ref["layer_calls"] == 4 and run["layer_calls"] == 4 + recomputed
    assert run["loss"] == ref["loss"]
    assert set(run["grads"]) == set(ref["grads"]) and any("deepstack" in n for n in ref["grads"])
    for n, g in ref["grads"].items():
        assert torch.equal(run["grads"][n], g), n


def test_recompute_that_changes_the_forward_is_detected(recompute_runs):
    ref, bad = case(recompute_runs, "off"), case(recompute_runs, "mutant")
    assert bad["loss"] == ref["loss"]  # the forward itself is untouched: only the recomputation differs
    assert any(not torch.equal(bad["grads"][n], g) for n, g in ref["grads"].items())


def test_make_example_family_that_the_model_overrides_contradict_is_refused(tmp_path, capsys):
    assert cli.main(["make-example", str(tmp_path / "ex"), "--family", "qwen3_vl", "model=tiny"]) != 0
    assert "--family qwen3_vl but the model overrides give model.family=qwen2_5_vl; drop one" in capsys.readouterr().err
    assert not (tmp_path / "ex").exists()
