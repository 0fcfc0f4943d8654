"""Bad configs and checkpoints fail early with errors that name the setting or tensor and the numbers."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException
from safetensors.torch import load_file, save_file

from rollplex_megatron.models.qwen25vl.hf import CheckpointError, HFCheckpoint, validate_checkpoint
from rollplex_megatron.config import ParallelConfig, check_model_parallel
from rollplex_megatron.recipes import load_run_config

# every size set (none left to the planner's auto sizing, which reads memory.auto_margin_gib on a GPU)
FIXED_SIZES = ["workload.micro_batch_tokens=0", "rollout.keep_decode_state=false"]


@pytest.mark.parametrize("overrides,match", [
    (["model=qwen2_5_vl_3b", "parallel.tp=4"], r"model.num_query_groups \(2\) is not divisible by parallel.tp \(4\)"),
    (["model=qwen2_5_vl_7b", "parallel.tp=8"],
     r"model.num_attention_heads \(28\) is not divisible by parallel.tp \(8\)"),
    (["model=qwen2_5_vl_7b", "parallel.pp=3"], r"model.num_layers \(28\) is not divisible by parallel.pp \(3\)"),
    (["model.mrope_section=[2,3,4]"],
     r"model.mrope_section \[2, 3, 4\] must have 3 entries >= 0 summing to head_dim/2 = 8"),
    (["model.mrope_section=[10,-1,-1]"], r"model.mrope_section \[10, -1, -1\] must have 3 entries >= 0 summing to"),
    (["model.rope_theta=0"], r"^model.rope_theta must be > 0, got 0.0$"),
    (["model.rms_norm_eps=-1"], r"^model.rms_norm_eps must be > 0, got -1.0$"),
    (["model.vision.rope_theta=0"], r"^model.vision.rope_theta must be > 0, got 0.0$"),
    (["model.image_token_id=310", "model.video_token_id=310"],
     r"^model.image_token_id, video_token_id, vision_start_token_id and vision_end_token_id must differ"),
    # nan and inf: no setting means either (they ran to a NaN loss, or a timeout never reached)
    (["train.clip_high=nan"], r"^train.clip_high must be a finite number, got nan$"),
    (["train.kl_coef=nan"], r"^train.kl_coef must be a finite number, got nan$"),
    (["train.entropy_coef=inf"], r"^train.entropy_coef must be a finite number, got inf$"),
    (["optim.clip_grad=nan"], r"^optim.clip_grad must be a finite number, got nan$"),
    (["optim.weight_decay=nan"], r"^optim.weight_decay must be a finite number, got nan$"),
    (["val.temperature=nan"], r"^val.temperature must be a finite number, got nan$"),
    (["rollout.temperature=inf"], r"^rollout.temperature must be a finite number, got inf$"),
    (["memory.auto_margin_gib=nan"], r"^memory.auto_margin_gib must be a finite number, got nan$"),
    (["model.vision.out_hidden_size=32"], r"model.vision.out_hidden_size \(32\) must equal model.hidden_size \(64\)"),
    (["model.vision.fullatt_block_indexes=[9]"], r"fullatt_block_indexes \[9\] out of range for depth 4"),
    (["smoke.image_grid=[1,3,4]"], r"smoke.image_grid h and w must be multiples"),
    (["parallel.tp=0"], r"parallel.tp must be >= 1"),
    (["workload.rollout_batch=-16"], r"^workload.rollout_batch must be >= 1, got -16$"),
    (["train.kl_coef=0.1", "train.clip_high=-1"], r"^train.clip_high must be >= 0, got -1.0$"),
    (["train.save_every=-1"], r"^train.save_every must be >= 0, got -1 \(0: off\)$"),
    (["optim.min_lr=0.5"], r"^optim.min_lr must be within \[0, optim.lr=0.0005\], got 0.5$"),
    (["val.n=0"], r"^val.n must be >= 1, got 0$"),
    (["train.logprob_kernel=fast"], r"train.logprob_kernel must be auto, triton or torch, got 'fast'"),
    (["train.norm_kernel=fused"], r"train.norm_kernel must be auto, triton or torch, got 'fused'"),
    (["train.rope_kernel=fast"], r"train.rope_kernel must be auto, triton or torch, got 'fast'"),
    (["memory.copy_streams=3"], r"memory.copy_streams must be 1 \(one copy stream\) or 2 \(one per direction\), got 3"),
    (["train.profile_phases=[update,decode]"],
     r"train.profile_phases: unknown phase\(s\) \['decode'\]; the phases are"),
    (["workload.micro_batch_tokens=-8"],
     r"workload.micro_batch_tokens must be >= 0, or -1 for auto, got -8 \(0 packs by "
     r"workload.responses_per_micro_batch\)"),
    # each of these reached the model (or a step) before, and failed there without naming the setting or ran
    (["seed=-1"], r"^seed must be >= 0 \(numpy and the samplers take unsigned seeds\), got -1$"),
    (["data.seed=-2"], r"^data.seed must be >= 0, got -2$"),
    (["task=motion", "task.jitter_px=-2"], r"^task.jitter_px must be >= 0, got -2$"),
    (["task=motion", "task.step_px=-3"], r"^task.step_px must be >= 1 \(the target's motion per frame is the answer\)"),
    (["task.frames=0"], r"^task.frames must be >= 1, got 0$"),
    (["task.object_px=0"], r"^task.object_px must be >= 1, got 0$"),
    (["task.format_reward=-1"], r"^task.format_reward must be >= 0, got -1.0$"),
    (["optim.adam_beta1=1.5"], r"^optim.adam_beta1 must be in \[0, 1\), got 1.5$"),
    (["optim.weight_decay=-1"], r"^optim.weight_decay must be >= 0, got -1.0$"),
    (["optim.adam_eps=0"], r"^optim.adam_eps must be > 0, got 0.0$"),
    (["model.num_layers=0"], r"^model.num_layers must be >= 1, got 0$"),
    (["model.vision.depth=0", "model.vision.fullatt_block_indexes=[]"], r"^model.vision.depth must be >= 1, got 0$"),
    (["smoke.warmup=-1"], r"^smoke.warmup must be >= 0, got -1$"),
    (["verify.text_tokens=-5"], r"^verify.text_tokens must be >= 1, got -5$"),
    (["verify.video_grid=[2,0,4]"], r"^verify.video_grid must be three positive ints \(t, h, w\), got \[2, 0, 4\]$"),
    (["train.clip_low=1.5"], r"^train.clip_low must be < 1 \(the ratio's lower bound is 1 - clip_low\), got 1.5$"),
    # settings of a switched-off feature: the run would ignore them
    (["rollout.length_mean=512"], r"^rollout.length_mean=512 has no effect without rollout.length_dist=lognormal; "
                                  r"set it or drop the rollout.length_mean override$"),
    (["rollout.length_sigma=0.3"], r"^rollout.length_sigma=0.3 has no effect without rollout.length_dist=lognormal"),
    (["train.max_resample_rounds=5"],
     r"^train.max_resample_rounds=5 has no effect without train.dynamic_sampling=true; set it or drop"),
    (["rollout.sglang.window_depth=8"], r"^rollout.sglang.window_depth=8 has no effect without rollout.engine=sglang"),
    (["reward.fn=exact_match", "+reward.fns={gsm: math_boxed}"],
     r"^reward.fn=exact_match applies to every row, so reward.fns \(gsm\) would never be read; give one of them$"),
    (["data.train_files=['']"], r"^data.train_files\[0\] is empty; name a parquet / jsonl file \(or drop the entry\)$"),
    (["data.train_files=[a.jsonl]", "data.val_files=[b.jsonl, ' ']"], r"^data.val_files\[1\] is empty"),
    (["rollout.split_gemm=all"], r"^rollout.split_gemm=all has no effect without a rollout model bound to the "),
    (["parallel.tp=2", "rollout.tp=2", "rollout.split_gemm=off"], r"^rollout.split_gemm=off has no effect without"),
    (["optim.lr_warmup_init=1e-5"], r"^optim.lr_warmup_init=1e-05 has no effect without optim.lr_warmup_steps > 0"),
    (["optim.min_lr=1e-5"], r"^optim.min_lr=1e-05 has no effect without a decaying optim.lr_decay_style \(linear"),
    (["optim.lr_decay_steps=10"], r"^optim.lr_decay_steps=10 has no effect without a decaying optim.lr_decay_style"),
    (["train.kl_estimator=k3"], r"^train.kl_estimator=k3 has no effect without a reference \(train.kl_coef > 0"),
    (["val.n=4"], r"^val.n=4 has no effect without data.val_files \(the rows validation answers\); set it or drop"),
    (["val.before_train=false"], r"^val.before_train=false has no effect without data.val_files"),
    (["mode.window=interleave", "mode.window_tail_fraction=0.5"],
     r"^mode.window_tail_fraction=0.5 has no effect without mode.window=tail"),
    (["mode.window=stream", "mode.window_green_sms=16"],
     r"^mode.window_green_sms=16 has no effect without mode.window=green"),
    (["memory.plan=keep", "memory.prefetch_ahead=true"],
     r"^memory.prefetch_ahead=true has no effect without memory.plan=phase or auto; set it or drop"),
    ([*FIXED_SIZES, "workload.prefix_pack_tokens=0", "memory.plan=phase", "memory.optimizer_step=resident",
      "memory.auto_margin_gib=8"],
     r"^memory.auto_margin_gib=8.0 has no effect without memory.budget_gib=0 and one of memory.plan=auto"),
    ([*FIXED_SIZES, "workload.prefix_pack_tokens=0", "memory.plan=keep", "memory.auto_margin_gib=8"],
     r"^memory.auto_margin_gib=8.0 has no effect"),
    (["memory.plan=auto", "memory.budget_gib=60", "memory.auto_margin_gib=8"],
     r"^memory.auto_margin_gib=8.0 has no effect"),  # a budget given: the margin is not read
])
def test_config_errors_name_the_setting(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_run_config(overrides)


def test_the_rendered_frame_size_is_checked_against_the_models_patches():
    """task.image_size against the model's patch x merge (28 for Qwen2.5-VL, 16 for qwen3_vl_tiny), naming a size
    that fits; a size that fits passes."""
    from rollplex_megatron.data import build_source

    # the check belongs to the rendered task: a config alone (a dataset run, a parity check) loads with any size
    cfg = load_run_config(["model=qwen3_vl_tiny", "task.image_size=28"])
    with pytest.raises(ValueError, match=r"^task.image_size=28 must be a multiple of 16 for this model \(model.vision"
                                         r".patch_size 8 x spatial_merge_size 2\): set task.image_size=32"):
        build_source(cfg)
    with pytest.raises(ValueError, match=r"^task.image_size=30 must be a multiple of 28 .*set task.image_size=56 "):
        build_source(load_run_config(["task.image_size=30"]))
    assert build_source(load_run_config(["model=qwen3_vl_tiny", "task.image_size=32"])).longest_prompt[0] > 0


@pytest.mark.parametrize("overrides", [
    ["memory.plan=auto", *FIXED_SIZES, "workload.prefix_pack_tokens=0"],
    ["memory.plan=phase", "memory.prefetch_ahead=true", *FIXED_SIZES, "workload.prefix_pack_tokens=0"],
    ["memory.plan=phase", *FIXED_SIZES, "workload.prefix_pack_tokens=4096"],
    ["memory.plan=keep"],  # the sizes left to the planner (the default) read it too
])
def test_the_auto_margin_is_taken_wherever_a_budget_comes_from_the_free_memory(overrides):
    """Each path that reads memory.auto_margin_gib (runtime.auto_budget_gib's callers) accepts it."""
    assert load_run_config([*overrides, "memory.auto_margin_gib=8"]).memory.auto_margin_gib == 8.0


@pytest.mark.parametrize("overrides,match", [
    (["model.bogus=1"], r"^unknown config key 'model.bogus' \(`rollplex print-config`"),
    (["train.stepz=2"], r"^unknown config key 'train.stepz'; did you mean train.steps\?"),  # Hydra: "use +train..."
    (["trian.steps=2"], r"^unknown config key 'trian.steps'; did you mean train.steps\?"),
    (["rollout.sglang.engine_args.mem=1"],
     r"^rollout.sglang.engine_args is a mapping whose keys are yours: add 'rollout.sglang.engine_args.mem' with "
     r"\+rollout.sglang.engine_args.mem=VALUE"),
    (["+train.stepz=2"], r"did you mean train.steps\?"),
    (["train.steps=abc"], r"^train.steps=abc: Value 'abc' of type 'str' could not be converted to Integer; give a "),
    (["mode=mode_schema"], r"^mode=mode_schema: mode_schema is the schema of mode, not a recipe; choose one of "
                           r"\['disaggregated', 'prefix_shared', 'rollplex', 'serial'\]"),
    (["mode=rollplx"], r"^mode=rollplx: no such recipe in recipes/mode/; did you mean mode=rollplex\? choose one of "
                       r"disaggregated, prefix_shared, rollplex, serial$"),  # Hydra's text lists the schemas too
    (["--mdoes", "serial"], r"^unknown option --mdoes: this command has no such option, and settings are key=value"),
    (["+bench=video_lng"], r"^bench=video_lng: no such recipe in recipes/bench/; did you mean bench=video_long\?"),
])
def test_unknown_keys_wrong_types_and_schemas_are_one_line_errors(overrides, match):
    with pytest.raises(ValueError, match=match) as err:
        load_run_config(overrides)
    assert "\n" not in str(err.value) and not isinstance(err.value, ConfigCompositionException)


def test_released_presets_compose():
    for name, tp in (("qwen2_5_vl_3b", 2), ("qwen2_5_vl_7b", 4), ("qwen2_5_vl_32b", 8)):
        cfg = load_run_config([f"model={name}", f"parallel.tp={tp}"])
        assert cfg.model.name == name and cfg.model.padded_vocab_size(tp) % (128 * tp) == 0


def _edit_checkpoint(src, dst, fn):
    shutil.copytree(src, dst)
    tensors = load_file(Path(dst) / "model.safetensors")
    fn(tensors)
    save_file(tensors, Path(dst) / "model.safetensors")
    return HFCheckpoint(dst)


def test_missing_tensor_is_named(tiny_hf, tmp_path):
    ck = _edit_checkpoint(tiny_hf, tmp_path / "c", lambda t: t.pop("model.layers.2.self_attn.k_proj.bias"))
    with pytest.raises(CheckpointError, match=r"missing tensors \(1\): model.layers.2.self_attn.k_proj.bias"):
        validate_checkpoint(ck, ck.model_config())


def test_extra_tensor_is_named(tiny_hf, tmp_path):
    def add(t):
        t["model.layers.9.mlp.gate_proj.weight"] = torch.zeros(2, 2)

    ck = _edit_checkpoint(tiny_hf, tmp_path / "c", add)
    with pytest.raises(CheckpointError, match=r"unexpected tensors \(1\): model.layers.9.mlp.gate_proj.weight"):
        validate_checkpoint(ck, ck.model_config())


def test_shape_mismatch_names_tensor_and_numbers(tiny_hf, tmp_path):
    def shrink(t):
        t["visual.blocks.1.attn.qkv.weight"] = t["visual.blocks.1.attn.qkv.weight"][:90]

    ck = _edit_checkpoint(tiny_hf, tmp_path / "c", shrink)
    want = r"visual.blocks.1.attn.qkv.weight: checkpoint \(90, 32\) vs model \(96, 32\)"
    with pytest.raises(CheckpointError, match=want):
        validate_checkpoint(ck, ck.model_config())


def test_checkpoint_heads_not_divisible_by_tp(tiny_hf):
    cfg = HFCheckpoint(tiny_hf).model_config()
    with pytest.raises(ValueError, match=r"model.num_query_groups \(2\) is not divisible by parallel.tp \(4\)"):
        check_model_parallel(cfg, ParallelConfig(tp=4))


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        HFCheckpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    with pytest.raises(CheckpointError, match=r"no \*.safetensors files"):
        HFCheckpoint(tmp_path)


def test_command_arguments_are_checked_before_any_work(tmp_path, tiny_hf, capsys):
    """What a command's own arguments get wrong is one `error:` line naming the argument and the fix, before an
    export, a model or a process: a record is never overwritten, a finished evaluation never lost to a missing
    folder, a --step never silently ignored, a count below 1 never read as a slice."""
    from rollplex_megatron.cli import main

    existing, run_like = tmp_path / "eval.json", tmp_path / "run"
    existing.write_text("{}")
    (run_like / "checkpoints").mkdir(parents=True)
    single, compared = tmp_path / "single", tmp_path / "compared"  # a run of one mode; a --modes comparison
    single.mkdir()
    (single / "config.yaml").write_text("seed: 1\n")
    (compared / "rollplex").mkdir(parents=True)
    (compared / "rollplex" / "metrics.jsonl").write_text("")
    (compared / "rollplex" / "checkpoints").mkdir()
    run_with_checkpoints = tmp_path / "done"
    (run_with_checkpoints / "checkpoints").mkdir(parents=True)
    (run_with_checkpoints / "config.yaml").write_text("seed: 1\n")
    rows = "data.val_files=[rows.parquet]"
    cases = [
        (["eval", "--hf-dir", tiny_hf, "--step", "3", rows], "--step 3 selects a checkpoint of a training run: use "
                                                             "it with --run RUN"),
        (["eval", "--hf-dir", str(tmp_path / "nothere"), rows], "nothere does not exist; name a Hugging Face"),
        (["eval", "--hf-dir", str(existing), rows], "eval.json is a file, not a folder; name a Hugging Face"),
        (["convert", "hf-to-mcore", "--hf-dir", str(Path(tiny_hf) / "config.json"), "--out", str(tmp_path / "mc")],
         "config.json is a file; name the Hugging Face model folder that holds it"),
        (["generate", "--hf-dir", str(run_like), rows], f"is a training run directory (it has checkpoints/); use "
                                                        f"--run {run_like}"),
        (["eval", "--hf-dir", tiny_hf, rows, "--out", str(existing)], "eval.json exists; choose a new path"),
        (["eval", "--hf-dir", tiny_hf, rows, "--out", str(tmp_path / "no" / "x.json")], "does not exist; create it"),
        (["generate", "--hf-dir", tiny_hf, rows, "--rows", "0"], "--rows must be >= 1, got 0"),
        (["make-example", str(tmp_path / "ex"), "--train-rows", "0"], "--train-rows and --val-rows must be >= 1"),
        (["make-example", str(tmp_path / "ex"), "--seed", "-5"], "--seed must be >= 0 (numpy takes unsigned seeds), "
                                                                   "got -5"),
        (["make-example", str(tmp_path / "ex"), "train.steps=5"], "train.steps=5: make-example reads model overrides "
                                                                   "only"),
        (["convert", "mcore-to-hf", "--mcore-dir", str(tmp_path), "--out", str(tmp_path / "o"), "--max-shard-gib",
          "0"], "--max-shard-gib must be a positive number of GiB, got 0.0"),
        (["convert", "train-to-hf", "--run", str(tmp_path), "--out", str(tmp_path / "o"), "--max-shard-gib", "nan"],
         "--max-shard-gib must be a positive number of GiB, got nan"),
        (["convert", "train-to-hf", "--run", str(tmp_path / "norun"), "--out", str(tmp_path / "o")],
         "norun: no such run directory"),
        (["print-config", f"train.init_hf={tmp_path / 'nomodel'}"], "nomodel does not exist; name a Hugging Face"),
        (["eval", "--hf-dir", tiny_hf, rows, "model.num_layers=2"], "model.num_layers=2: the model is the "
                                                                     "checkpoint's (--hf-dir"),
        (["generate", "--run", str(run_like), rows, "model=qwen2_5_vl_3b"], "model=qwen2_5_vl_3b: the model is the "
                                                                            "checkpoint's (--run"),
        (["train", "--modes", "serial,rollplex,serial", "train.steps=1", f"train.out={tmp_path / 'o'}"],
         "--modes: serial given twice"),
        (["train", "train.steps=1", f"run_dir={existing}"], "eval.json is a file; run_dir is the folder new runs"),
        *([(["train", "train.steps=1", "memory.cap_gib=20", f"train.out={tmp_path / 'capped'}"],
            "memory.cap_gib=20 caps a GPU's allocator and this run has no GPU: drop it")]
          if not torch.cuda.is_available() else []),  # refused in this process, before the ranks start
        (["smoke", f"run_dir={existing}"], "eval.json is a file; run_dir is the folder the smoke summary is written"),
        (["train", "--modes", "serial", "train.steps=1", f"train.out={single}"],
         f"train.out={single} holds a run of one mode (config.yaml at its top); --modes trains each mode into "
         f"train.out/<mode>: choose a new train.out, or resume that run without --modes"),
        (["train", "train.steps=1", f"train.out={run_with_checkpoints / 'checkpoints' / 'x'}"],
         f"lies inside the run {run_with_checkpoints}; choose a folder outside it"),
        (["train", "train.steps=1", f"train.out={tiny_hf}"], "is a Hugging Face model folder; choose a new folder"),
        (["train", "train.steps=1", f"train.out={compared}"],
         f"train.out={compared} holds a --modes comparison (rollplex/); a run of one mode writes its files at the "
         f"top of train.out"),
        (["eval", "--hf-dir", tiny_hf, rows, "rollout.temperature=0.7"], "rollout.temperature: eval and generate do "
                                                                          "not read it; use val.temperature; drop"),
        (["generate", "--hf-dir", tiny_hf, rows, "rollout.group_size=4"], "rollout.group_size: eval and generate do "
                                                                           "not read it; use val.n; drop"),
        (["eval", "--hf-dir", tiny_hf, rows, "optim.lr=1e-3"], "optim.lr: eval and generate do not read it; drop"),
        (["eval", "--hf-dir", tiny_hf, rows, "data.train_files=[a.parquet]"], "data.train_files: eval and generate do "
                                                                               "not read it (the rows come from"),
        (["eval", "--hf-dir", tiny_hf, "data.val_files=[]"], "give the rows to answer: data.val_files=[FILE, ...]"),
        (["eval", "--hf-dir", tiny_hf, rows, "val.before_train=false"], "val.before_train: eval and generate do not "
                                                                         "read it (they evaluate once, the checkpoint"),
        (["generate", "--hf-dir", tiny_hf, rows, "val.max_rows=2"], "val.max_rows=2: generate answers the first --rows "
                                                                     "K rows (val.max_rows is eval's limit); drop"),
        (["eval", "--hf-dir", tiny_hf, rows, "task=motion"], "task: eval and generate do not read it (the rows come "
                                                              "from data.val_files); drop"),
        (["plan-memory", "plan.response_tokens=512"], "plan.response_tokens=512 is over rollout.max_response_len=256, "
                                                      "which a run of this config would refuse; raise"),
        (["convert", "train-to-hf", "--run", str(compared), "--out", str(tmp_path / "o")],
         f"{compared} is not a run but holds runs; name one of them: --run {compared / 'rollplex'}"),
        (["eval", "--run", str(compared), rows], "is not a run but holds runs; name one of them"),
        (["plan-memory", "memory.plan=keep"], "memory.plan=keep: plan-memory plans serial (memory.plan=keep) against "
                                              "rollplex (memory.plan=phase) side by side"),
        (["plan-memory", "mode=prefix_shared"], "mode=prefix_shared: plan-memory plans serial"),
        (["plan-memory", "plan.prefix_tokens=9000"], "plan.prefix_tokens=9000 is over rollout.max_prompt_len=8192"),
        (["plan-memory", "plan.vision_patches=4097"], "plan.vision_patches=4097 is not a multiple of 4 (the merger"),
        (["plan-memory", "plan.prefix_tokens=1000"], "plan.prefix_tokens=1000 cannot hold the 1024 vision tokens of "
                                                     "plan.vision_patches=4096 and their start and end tokens; raise "
                                                     "plan.prefix_tokens to at least 1026"),
    ]
    for argv, want in cases:
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert want in err and err.startswith("error: ") and err.count("\n") == 1, (argv, err)
    assert existing.read_text() == "{}" and not (tmp_path / "ex").exists() and not (tmp_path / "o").exists()
    assert sorted(p.name for p in single.iterdir()) == ["config.yaml"] and sorted(
        p.name for p in compared.iterdir()) == ["rollplex"]  # nothing written into either


def test_nccl_without_cuda_devices_is_refused_before_any_process(tmp_path, monkeypatch, capsys):
    from rollplex_megatron.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a CPU machine, wherever this runs
    for argv in (["train", "train.steps=1", f"train.out={tmp_path / 'o'}"], ["smoke"], ["verify-equivalence"]):
        assert main([*argv, "parallel.backend=nccl"]) == 1, argv
        err = capsys.readouterr().err
        assert err.startswith("error: parallel.backend=nccl needs CUDA devices") and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()


def test_a_profile_that_would_never_run_is_refused():
    with pytest.raises(ValueError, match=r"^train\.profile_step=5 is after the run's last step \(train\.steps=2\)"):
        load_run_config(["train.steps=2", "train.profile_step=5"]).check_training()
    with pytest.raises(ValueError, match=r"^train\.profile_phases chooses the phases train\.profile_step profiles"):
        load_run_config(["train.profile_phases=[update]"]).check_training()
    load_run_config(["train.steps=2", "train.profile_step=2", "train.profile_phases=[update]"]).check_training()
    with pytest.raises(ValueError, match=r"^train\.profile_phases names ref_logp, but this run scores no reference"):
        load_run_config(["train.steps=2", "train.profile_step=2", "train.profile_phases=[ref_logp]"]).check_training()
    load_run_config(["train.steps=2", "train.profile_step=2", "train.profile_phases=[ref_logp]",
                     "train.reference=always"]).check_training()
    prof = ["train.steps=2", "train.profile_step=2"]
    with pytest.raises(ValueError, match=r"^train\.profile_phases names weight_refresh, a phase this run does not "
                                         r"have \(the rollout's weights phase here: none, it decodes on the actor\)"):
        load_run_config([*prof, "train.profile_phases=[weight_refresh]"]).check_training()
    assert load_run_config([]).weights_phase is None
    assert load_run_config(["rollout.bound_model=true"]).weights_phase == "weight_refresh"
    load_run_config([*prof, "train.profile_phases=[weight_refresh]", "rollout.bound_model=true"]).check_training()


def test_rendered_task_longer_than_the_rollout_limits_is_refused_before_any_model():
    """The rendered task's answer budget and prompt length against the rollout's limits, at the data source's
    construction (the engine refused every request of step 1 before)."""
    from rollplex_megatron.data import build_source

    with pytest.raises(ValueError, match=r"^task\.max_answer_tokens \(4\) exceeds rollout\.max_response_len \(1\)"):
        build_source(load_run_config(["rollout.max_response_len=1", "task.max_answer_tokens=4"]))
    with pytest.raises(ValueError, match=r"^the rendered task's prompt is 19 tokens .* over "
                                         r"rollout\.max_prompt_len=18"):
        build_source(load_run_config(["rollout.max_prompt_len=18"]))
    build_source(load_run_config(["rollout.max_prompt_len=19", "rollout.max_response_len=4"]))  # exactly fits


@pytest.mark.parametrize("override,match", [
    ("reward.fn=pkg.mod:score", r"^reward\.fn=pkg\.mod:score has no effect without data\.train_files \(the rendered "
                                r"task scores its answers itself, with task\.format_reward\); set it or drop"),
    ("+reward.fns={multiple_choice: exact_match}", r"^reward\.fns=\{'multiple_choice': 'exact_match'\} has no effect"),
    ("reward.format_reward=0.5", r"^reward\.format_reward=0\.5 has no effect without data\.train_files"),
    ("data.truncation=left", r"^data\.truncation=left has no effect without data\.train_files \(the rendered task "
                             r"draws its own prompts, from seed and task\.\*\)"),
    ("data.shuffle=false", r"^data\.shuffle=false has no effect without data\.train_files"),
    ("data.max_pixels=3136", r"^data\.max_pixels=3136 has no effect without data\.train_files"),
])
def test_reward_and_data_settings_on_the_rendered_task_are_refused(override, match):
    """The rendered task scores with its own reward and draws its own prompts: a reward.* or data.* reading setting
    there would be ignored, so the source refuses it before any model (the dataset source reads them: test_dataset)."""
    from rollplex_megatron.data import build_source

    with pytest.raises(ValueError, match=match):
        build_source(load_run_config([override]))
    build_source(load_run_config(["task.format_reward=0.5"]))  # the rendered task's own setting


def test_validation_files_without_a_validation_period_are_refused():
    """data.val_files with train.val_every=0 would never be evaluated; the reverse was refused already."""
    with pytest.raises(ValueError, match=r"^data\.val_files are evaluated every train\.val_every steps, which is 0"):
        load_run_config(["data.train_files=[t.parquet]", "data.val_files=[v.parquet]"]).check_training()
    files = ["data.train_files=[t.parquet]", "data.val_files=[v.parquet]"]
    load_run_config([*files, "train.val_every=5"]).check_training()
    with pytest.raises(ValueError, match=r"^train\.val_every > 0 needs data\.val_files"):
        load_run_config(["train.val_every=5"]).check_training()


def test_eval_of_a_run_checks_its_rows_and_processor_before_exporting_it(tmp_path, monkeypatch, capsys):
    """`eval`/`generate --run`: a missing rows file and a run that started from no HF checkpoint (so its export
    has no tokenizer) are one line each, before the checkpoint is exported (the export here fails the test)."""
    from rollplex_megatron.checkpoint import convert
    from rollplex_megatron.cli import main

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("{}\n")
    seen = {}
    monkeypatch.setattr(convert, "checkpoint_config",
                        lambda r, step=None: seen.setdefault("yaml", "train:\n  init_hf: ''\ndata:\n  processor: ''\n"))
    monkeypatch.setattr(convert, "train_to_hf", lambda *a, **k: pytest.fail("exported before the checks"))
    cases = [(["eval", "--run", str(run), f"data.val_files=[{rows}]"],
              "started from no HF checkpoint (train.init_hf was empty), so its export has no tokenizer or processor "
              "to read the rows with: add data.processor=DIR"),
             (["generate", "--run", str(run), f"data.val_files=[{rows}]"], "add data.processor=DIR"),
             (["eval", "--run", str(run), f"data.processor={tmp_path}", f"data.val_files=[{tmp_path / 'none.jsonl'}]"],
              f"data.val_files: {tmp_path / 'none.jsonl'} does not exist; name parquet or jsonl files of rows")]
    for argv, want in cases:
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert want in err and err.startswith("error: ") and err.count("\n") == 1, (argv, err)
    assert "yaml" in seen  # the run's own config was read for the processor check
