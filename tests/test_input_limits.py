"""Inputs past what a run can hold: images wider than 8 bits (scaled by their depth, not clipped white),
transparent images, media paths that are folders, and a batch the machine's memory cannot hold (refused
before any model is built, naming the settings and the bytes)."""
import dataclasses
import re

import numpy as np
import pytest
from PIL import Image

from rollplex_megatron.cli import main as cli_main
from rollplex_megatron.data import build_source, processor
from rollplex_megatron.data.example_files import write_tiny_processor
from rollplex_megatron.data.processor import VLProcessor
from rollplex_megatron.memory import machine
from rollplex_megatron.memory.machine import check_run_fits
from rollplex_megatron.memory.budget import machine_need_gib
from rollplex_megatron.recipes import load_run_config
from rollplex_megatron.trainer.runtime import memory_plan

WORDS = ["which", "colour", "?"]


@pytest.fixture(scope="module")
def proc(tmp_path_factory):
    """The tiny model's processor."""
    model = load_run_config([]).model
    return VLProcessor(write_tiny_processor(str(tmp_path_factory.mktemp("proc")), WORDS, model), model)


def _ramp(high: int, dtype) -> np.ndarray:
    """A 16 x 16 ramp from 0 to `high` (every value distinct in 8 bits after scaling)."""
    return (np.linspace(0, high, 256).reshape(16, 16)).astype(dtype)


@pytest.mark.parametrize("mode,fmt", [("I;16", "PNG"), ("I;16B", "TIFF"), ("I", "TIFF")])
def test_wide_greyscale_is_scaled_by_its_bit_depth(proc, tmp_path, capsys, mode, fmt):
    values = _ramp(65535, np.int64)
    raw = {"I;16": values.astype("<u2"), "I;16B": values.astype(">u2"), "I": values.astype(np.int32)}[mode]
    img = Image.frombytes(mode, (16, 16), raw.tobytes())
    path = tmp_path / f"deep.{fmt.lower()}"
    img.save(path, fmt)
    rgb = np.asarray(proc.load_image(str(path)))
    want = np.rint(values * 255 / 65535).astype(np.uint8)
    assert (rgb == want[..., None]).all()  # PIL's convert("RGB") clips: 255 from value 255 up (all white)
    proc.load_image(str(path))  # read again (the check, then every step): one note
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: image")]
    assert len(notes) == 1 and str(path) in notes[0] and "scaled to 8 bits" in notes[0]


def test_float_images_in_unit_range_scale_and_others_are_refused(proc, tmp_path):
    unit = tmp_path / "unit.tiff"
    Image.fromarray(_ramp(1, np.float32), "F").save(unit)
    assert (np.asarray(proc.load_image(str(unit)))[..., 0] == np.rint(_ramp(1, np.float64) * 255)).all()
    wild = tmp_path / "wild.tiff"
    Image.fromarray(_ramp(4000, np.float32) - 7, "F").save(wild)
    with pytest.raises(ValueError, match=r"^image .*wild\.tiff is 32-bit float greyscale \(PIL mode F\) with values "
                                         r"-7\.\.3993, which have no known bit depth; save it as an 8-bit"):
        proc.load_image(str(wild))


def test_eight_bit_integer_values_in_mode_i_are_kept(proc):
    img = Image.fromarray(_ramp(255, np.int32), "I")
    assert (np.asarray(proc.load_image(img))[..., 1] == _ramp(255, np.uint8)).all()


def test_transparent_images_composite_onto_white_and_a_blank_one_is_noted(proc, tmp_path, capsys):
    la = Image.fromarray(np.stack([_ramp(255, np.uint8), np.full((16, 16), 128, np.uint8)], -1), "LA")
    got = np.asarray(proc.load_image(la))[..., 0].astype(int)
    want = np.rint(_ramp(255, np.float64) * 128 / 255 + 255 * 127 / 255)
    assert np.abs(got - want).max() <= 1  # transformers' convert_to_rgb: the picture over white
    blank = tmp_path / "blank.png"
    Image.new("RGBA", (8, 8), (200, 10, 10, 0)).save(blank)
    assert (np.asarray(proc.load_image(str(blank))) == 255).all()
    assert f"note: image {blank} is fully transparent" in capsys.readouterr().err
    cmyk = np.asarray(proc.load_image(Image.new("CMYK", (4, 4), (0, 255, 255, 0))))
    assert (cmyk == [255, 0, 0]).all()  # CMYK converts as it is


def test_media_paths_that_are_folders_say_so(proc, tmp_path):
    with pytest.raises(ValueError, match=rf"^image {tmp_path} is a folder, not a file; name an image file in it$"):
        proc.load_image(str(tmp_path))
    with pytest.raises(ValueError, match=rf"^video {tmp_path} is a folder, not a file; name a video file"):
        proc.video_shape(str(tmp_path))
    with pytest.raises(ValueError, match=r"is a folder, not a file"):
        processor.decode_video(str(tmp_path))


BIG = ["rollout.group_size=100000", "workload.rollout_batch=800000",  # issue 51: 112 s, then the allocator
       "memory.plan=phase"]  # its offloaded classes' host copies counted (the default auto keeps all on CPU)


def _planned(*overrides):
    """(cfg, source, the trainer's memory plan) of the root recipe with `overrides`."""
    cfg = load_run_config(list(overrides))
    source = build_source(cfg)
    return cfg, source, memory_plan(cfg, source)


def _host(monkeypatch, gib: float) -> None:
    """This host has `gib` GiB available (no cgroup limit)."""
    monkeypatch.setattr(machine, "meminfo_available", lambda: int(gib * 2**30))
    monkeypatch.setattr(machine, "cgroup_room", lambda: None)


def test_a_batch_the_host_cannot_hold_is_refused_naming_the_settings(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg, source, plan = _planned(*BIG)
    _host(monkeypatch, 4)
    with pytest.raises(ValueError, match=r"^this run needs 5\.9 GiB per rank \(6\.3\de\+09 bytes; peak phase "
                                         r"'rollout', largest class rollout_kv 3\.1 GiB\), over the 4\.0 GiB of "
                                         r"available host memory; a rank's batch is 8 prompts \("
                                         r"workload\.rollout_batch=800000 / rollout\.group_size=100000\) x 100000 "
                                         r"responses of up to "
                                         r"task\.max_answer_tokens=4 tokens; lower rollout\.group_size, "
                                         r"workload\.rollout_batch or task\.max_answer_tokens$"):
        check_run_fits(cfg, source, plan)
    _host(monkeypatch, 64)
    check_run_fits(cfg, source, plan)  # the same batch where the host holds it
    _host(monkeypatch, 8)  # two ranks share the host: 4 GiB each
    with pytest.raises(ValueError, match=r"over the 4\.0 GiB of available host memory, shared by 2 ranks on this host"):
        check_run_fits(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp=2)), source, plan)


@pytest.mark.parametrize("overrides", [[], ["rollout.group_size=5000", "workload.rollout_batch=40000"]])
def test_the_main_job_and_a_large_group_fit_a_small_host(monkeypatch, overrides):
    cfg, source, plan = _planned(*overrides)
    _host(monkeypatch, 1)  # the main job plans 6 MiB; G=5000 0.27 GiB: slow on CPU, but it fits
    check_run_fits(cfg, source, plan)
    assert machine_need_gib(plan, cuda=False) < 0.5


def test_cpu_counts_the_host_copies_of_offloaded_classes():
    _, _, plan = _planned("memory.plan=phase")
    offloaded = [c["gib"] for c in plan["classes"].values() if c["action"] == "offload"]
    assert any(g > 0 for g in offloaded)  # memory.plan=phase offloads Adam's states (fp32: no masters)
    assert machine_need_gib(plan, cuda=False) == pytest.approx(plan["peak_gib"] + sum(offloaded))
    assert machine_need_gib(plan, cuda=True) == plan["peak_gib"]


def test_host_memory_is_the_least_of_meminfo_and_the_cgroup_limit(monkeypatch, tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal:       32000000 kB\nMemAvailable:   20000000 kB\n")
    monkeypatch.setattr(machine, "MEMINFO", tmp_path / "meminfo")
    monkeypatch.setattr(machine, "CGROUP", tmp_path)
    assert machine.host_available_bytes() == 20000000 * 1024  # no cgroup files: no limit
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text("100\n")
    assert machine.host_available_bytes() == 20000000 * 1024
    (tmp_path / "memory.max").write_text(f"{6 * 2**30}\n")
    (tmp_path / "memory.current").write_text(f"{2**30}\n")
    assert machine.host_available_bytes() == 5 * 2**30
    assert machine.free_bytes(4) == (5 * 2**30 // 4, "available host memory, shared by 4 ranks on this host")


def test_train_refuses_an_absurd_group_before_any_process_starts(tmp_path, capsys):
    # the engine's KV budget raised out of the way: the planner's check is what refuses (any host, real memory)
    rc = cli_main(["train", "rollout.group_size=100000000", "workload.rollout_batch=800000000",
                   "memory.kv_cache_gib=1000000", f"train.out={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert rc != 0 and re.search(r"error: this run needs 59\d\d\.\d GiB per rank .* of available host memory; .*"
                                 r"rollout\.group_size=100000000\) x 100000000 responses", err), err
    assert not (tmp_path / "run").exists()
