"""Settings described once (rollplex_megatron/schema.py): every field of RunConfig carries its help, the resume
check and the refusals of ignored settings are derived from that metadata, and the generated reference pages match
the code."""
from dataclasses import dataclass

import pytest
import yaml
from omegaconf import OmegaConf

from rollplex_megatron import schema
from rollplex_megatron.checkpoint import run_dir as R
from rollplex_megatron.config import RunConfig, flat_settings

# run_dir.RESUMABLE as written by hand until the metadata replaced it (2026-12): the derived set must equal it
HAND_RESUMABLE = ("train.steps", "train.save_every", "train.save_final", "train.resume", "train.out",
                  "train.progress", "run_dir", "mode.", "memory.", "rollout.cuda_graphs", "rollout.keep_decode_state",
                  "rollout.decode_attention", "rollout.sampling_kernel", "rollout.layer_kernel", "rollout.decode_gemm",
                  "train.logprob_kernel", "train.norm_kernel", "train.rope_kernel", "workload.prefix_pack_tokens",
                  "parallel.backend", "smoke.", "verify.", "plan.",
                  "train.val_every", "val.", "data.val_files", "data.prefetch", "train.tensorboard", "train.wandb",
                  "train.profile_step", "train.profile_phases", "data.accept_changed_files",
                  "reward.timeout_s")  # the last one declared resumable in its metadata when it was added


def _hand(key: str) -> bool:
    return any(key == r or (r.endswith(".") and key.startswith(r)) for r in HAND_RESUMABLE)


def test_every_setting_has_help_and_a_resumable_flag():
    """The schema walk: every field of every section reachable from RunConfig was declared with setting/section."""
    names = [s.name for s in schema.settings(RunConfig)]
    assert len(names) == len(set(names)) > 150
    for s in schema.settings(RunConfig):
        assert s.help.strip() and "\n" not in s.help, s.name
        assert isinstance(s.resumable, bool), s.name
    for path, _, help_ in schema.sections(RunConfig):
        assert help_.strip(), path


def test_a_field_without_metadata_is_refused():
    """Adding a field the plain way (no help, no resumable flag) fails the walk, naming the field and the fix."""
    @dataclass(kw_only=True)
    class Inner:
        ok: int = schema.setting(1, "a documented setting")
        bare: int = 3

    @dataclass(kw_only=True)
    class Root:
        inner: Inner = schema.section(Inner, "a section")

    with pytest.raises(TypeError, match=r"^config field inner\.bare \(Inner\.bare\) has no help: declare it with "
                                        r"setting\(default, help\)"):
        schema.settings(Root)


def test_resumable_settings_are_the_hand_list_they_replaced():
    """Every flat setting of the default config (empty mappings included) and keys no field names: the derived
    answer is the hand list's."""
    flat = flat_settings(OmegaConf.to_container(OmegaConf.structured(RunConfig)), keep_empty=True)
    keys = set(flat) | {"mode.not_a_field", "memory.x.y", "megatron.recompute_granularity", "optim.unknown",
                        "rollout.sglang.engine_args.chunked_prefill_size", "reward.fns.gsm8k", "model.vision.depth",
                        "nothing", "val.n"}
    derived = {k for k in keys if schema.resumable(RunConfig, k)}
    assert derived == {k for k in keys if _hand(k)}
    assert {"train.steps", "mode.name", "val.n", "data.accept_changed_files"} <= derived
    assert not {"optim.lr", "megatron.recompute_granularity", "seed"} & derived


def test_resume_refuses_a_setting_declared_without_resumable():
    """resume_changes reads the metadata: a setting flagged resumable may change, one that is not is refused."""
    saved = yaml.safe_dump({"train": {"steps": 2, "rope_kernel": "auto"}, "optim": {"lr": 0.001}})
    new = yaml.safe_dump({"train": {"steps": 5, "rope_kernel": "torch"}, "optim": {"lr": 0.5}})
    assert R.resume_changes(saved, new) == [("optim.lr", 0.001, 0.5)]


# the settings refused while their feature is off, as the 16 hand-written unused_unless calls listed them
HAND_REFUSED = {"rollout.length_mean", "rollout.length_sigma", "rollout.split_gemm", "mode.window_tail_fraction",
                "mode.window_green_sms", "mode.window_graphs", "mode.window_graph_buckets", "memory.prefetch_ahead",
                "memory.auto_margin_gib", "train.max_resample_rounds", "train.kl_estimator", "optim.lr_warmup_init",
                "optim.min_lr", "optim.lr_decay_steps", "reward.fn", "reward.fns", "reward.format_reward"}
HAND_REFUSED |= {f"val.{n}" for n in ("temperature", "n", "max_rows", "before_train")}
HAND_REFUSED |= {f"rollout.sglang.{n}" for n in ("model_path", "mem_fraction_static", "window_depth", "timeout_s",
                                                 "startup_timeout_s", "engine_args")}
HAND_REFUSED |= {f"data.{n}" for n in ("processor", "prompt_key", "image_key", "video_key", "min_pixels", "max_pixels",
                                       "video_fps", "max_frames", "min_frames", "shuffle", "seed", "truncation",
                                       "prefetch")}


def test_refused_settings_are_the_hand_lists_they_replaced():
    """The settings with an `applies_with` condition are the ones the hand-written calls refused (plus
    reward.timeout_s and the streamed optimizer step's, declared with their conditions when they were added)."""
    derived = {s.name for s in schema.settings(RunConfig) if s.applies_with}
    assert derived == HAND_REFUSED | {"reward.timeout_s", "memory.optimizer_step", "memory.optimizer_bucket_mib",
                                      "memory.optimizer_buckets"}


def test_a_condition_in_the_metadata_refuses_its_setting():
    """refuse_unused reads only the metadata: a toy section refuses its setting while the condition is false."""
    switched_on = schema.Needs("toy.on=true", lambda toy: toy.on)

    @dataclass(kw_only=True)
    class Toy:
        on: bool = schema.setting(False, "the switch")
        knob: int = schema.setting(3, "tuned only when on", applies_with=switched_on)

    schema.refuse_unused(Toy(on=True, knob=5), "toy")
    schema.refuse_unused(Toy(knob=3), "toy")  # at its default
    with pytest.raises(ValueError, match=r"^toy\.knob=5 has no effect without toy\.on=true; set it or drop the "
                                         r"toy\.knob override$"):
        schema.refuse_unused(Toy(knob=5), "toy")


def test_sampling_kernel_triton_is_refused_by_one_check():
    """The config (at start-up) and the engine (per request) refuse a top-k/top-p filter with the triton draw through
    the same function, so the two messages cannot drift apart."""
    from rollplex_megatron.config import RolloutConfig, check_sampling_kernel

    with pytest.raises(ValueError, match=r"^rollout\.sampling_kernel=triton draws with temperature only, but "
                                         r"rollout\.top_k/top_p sets top_k=5, top_p=1\.0; set top_k=0"):
        RolloutConfig(sampling_kernel="triton", top_k=5)
    with pytest.raises(ValueError, match=r"but this request sets top_k=0, top_p=0\.9"):
        check_sampling_kernel("triton", 0, 0.9, "this request")
    check_sampling_kernel("torch", 5, 0.9, "this request")
    RolloutConfig(sampling_kernel="triton")


def test_generated_reference_pages_are_current(tmp_path):
    """docs/reference/settings.md and cli.md are what `python -m rollplex_megatron docs` writes now; a changed help
    text makes a page stale."""
    from rollplex_megatron import cli
    from rollplex_megatron.cli import reference

    texts = reference.pages(cli.COMMANDS, cli.__doc__, cli.USER_ERRORS)
    assert reference.stale_pages(texts) == [], "regenerate with `python -m rollplex_megatron docs`"
    assert "| `rollout.group_size` | `int` | `4` | no | always | G: responses sampled per prompt |" in texts[
        "settings.md"]
    assert "## `rollplex print-config`" in texts["cli.md"] and "--explain" in texts["cli.md"]
    reference.write_pages(texts, tmp_path)
    assert reference.stale_pages(texts, tmp_path) == []
    page = tmp_path / "settings.md"
    page.write_text(page.read_text().replace("G: responses sampled per prompt", "G: responses per prompt"))
    assert reference.stale_pages(texts, tmp_path) == ["settings.md"]
    assert cli.main(["docs", "--check", "--out", str(tmp_path)]) == 1


def test_print_config_explain_is_the_config_with_its_help(capsys):
    """`print-config --explain`: the same YAML as `print-config` (comments aside), each value with its help."""
    from rollplex_megatron import cli

    assert cli.main(["print-config", "rollout.group_size=8", "+megatron.recompute_granularity=selective"]) == 0
    plain = capsys.readouterr().out
    assert cli.main(["print-config", "--explain", "rollout.group_size=8",
                     "+megatron.recompute_granularity=selective"]) == 0
    explained = capsys.readouterr().out
    assert yaml.safe_load(explained) == yaml.safe_load(plain)
    assert "  group_size: 8  # G: responses sampled per prompt\n" in explained
    assert "megatron: {recompute_granularity: selective}  # megatron-core TransformerConfig" in explained
