"""The trainer: serial, prefix_shared and rollplex compute the same rollouts and updates (fp32, CPU)."""
import pytest

from rollplex_megatron.data import build_source
from rollplex_megatron.dist import run_local
from rollplex_megatron.recipes import load_run_config
from tests import trainer_workers as W
from tests.in_turn import case, in_turn
from tests.numerics import rel_err

TOL = 1e-5  # docs/design.md §3, fp32 on CPU
# Adam's epsilon is raised from 1e-8 to 1e-6 here: parameters whose gradient is almost zero (the
# attention key biases) otherwise get full-size steps out of fp32 rounding noise, which differs
# between execution orders, and a drift of 1e-5 after 3 steps says nothing about the modes.
# lr 3e-4: the first step agrees to 4e-8 (loss) and 7e-7 (gradient norm), but at lr 3e-3 one Adam
# step moves the policy so far (KL 0.18) that the k3 term turns the modes' fp32 rounding into 1.4e-5
# on the second step's loss (measured); at 3e-4 the policy still moves and every step agrees to 7e-6.
BASE = ["model=tiny", "optim.adam_eps=1e-6", "workload.rollout_batch=32", "workload.responses_per_micro_batch=5",
        "rollout.group_size=4",
        "train.kl_coef=0.1", "task.format_reward=0.5", "task.max_answer_tokens=6", "optim.lr=3e-4",
        "memory.plan=phase"]  # every class released and brought back: the plan these runs compare through
STEP1_TOL = 1e-6  # the first step starts from identical weights: the mechanism alone
# Mean |trainer log-prob - sampler log-prob| per token: the sampler decodes with its own K/V cache
# (another reduction order), so fp32 rounding of log-probs of size ~6 (docs/design.md §3: never bit-exact).
LOGP_TOL = 1e-5


def _cfg(mode, *extra, hf=None):
    """BASE in `mode`; with `hf` the model is the checkpoint's (train.init_hf), not the tiny preset."""
    over = BASE + [f"mode.name={mode}"] + list(extra)
    if hf is not None:
        over = [o for o in over if o != "model=tiny"] + [f"train.init_hf={hf}"]
    return load_run_config(over)


def _param_err(run, ref):
    """Largest per-parameter relative difference of the trained weights (docs/design.md §3: parameters after the
    steps stay within the bound)."""
    assert any(float((ref["last"][n] - ref["first"][n]).norm()) > 0 for n in ref["last"])  # it trained
    errs = {n: rel_err(run["last"][n], ref["last"][n]) for n in ref["last"]}
    return max(errs.values()), max(errs, key=errs.get)


LATE_TOL = 1e-4  # the KL and gradient norm after the first step: 7-10x the fp32 drift measured there


def _records_close(a, b, keys=("loss", "kl", "entropy", "grad_norm", "reward_mean")):
    """Every step's metrics within TOL, except the logged KL and the gradient norm after the first step,
    which are held to LATE_TOL: from the second step on they are evaluated at weights that already differ
    by the earlier steps' fp32 rounding (the parameters after the steps are compared at TOL by
    `_param_err`), and k3's exponential turns that into ~1.4e-5 of the KL value (measured for TP=2
    against TP=1), Adam's normalisation into 1.0e-5 of the third step's gradient norm (rollplex against
    serial on an AMD EPYC). A wrong gradient or KL moves them by far more than LATE_TOL (the mutation
    tests below). The loss, which contains the KL term, stays compared at TOL at every step."""
    for i, (ra, rb) in enumerate(zip(a, b)):
        for k in keys:
            tol = LATE_TOL if k in ("kl", "grad_norm") and i > 0 else TOL
            assert abs(ra[k] - rb[k]) <= tol * max(abs(rb[k]), 1e-3), (i, k, ra[k], rb[k])


# serial_run and rollplex_run (conftest.py): BASE at the tiny checkpoint over 3 steps, shared with other files.
# The other one-process runs without a class-level mutation share two jobs (`tests.in_turn`), each run on its
# own fresh Runtime: the serial references in one, the runs compared with them in the other, so a run and
# its reference never share a process.


@pytest.fixture(scope="module")
def serial_refs(tiny_hf, example_dir):
    """The serial references of this file besides serial_run, in one job."""
    return run_local(in_turn, 1, {
        "data": (W.run_steps, (_data_cfg("serial", example_dir), 2)),
        "ppo": (W.run_steps, (_cfg("serial", *PPO, hf=tiny_hf), 2)),
        "knobs": (W.run_steps, (_cfg("serial", *KNOBS, hf=tiny_hf), 3)),
        "seq_mean": (W.run_steps, (_cfg("serial", "train.loss_agg_mode=seq-mean-token-mean", hf=tiny_hf), 1)),
    })[0]


@pytest.fixture(scope="module")
def mode_runs(tiny_hf, tiny_hf_tied, example_dir):
    """The runs compared with the serial references (and the one-stage side of the PP=2 test), in one job.
    The two loss mutants replace the loss on their own Runtime only (trainer_workers.run_steps)."""
    calls = {("base", "prefix_shared"): (W.run_steps, (_cfg("prefix_shared", hf=tiny_hf), 3))}
    for mode in ("prefix_shared", "rollplex"):
        calls["data", mode] = (W.run_steps, (_data_cfg(mode, example_dir), 2))
        calls["ppo", mode] = (W.run_steps, (_cfg(mode, *PPO, hf=tiny_hf), 2))
    # with the window's items through PrefixGraphs (on CPU its eager fallback: the wiring of mode.window_graphs)
    calls["packed", "rollplex"] = (W.run_steps, (_cfg("rollplex", PACKED, "mode.window_graphs=true", hf=tiny_hf), 3))
    for mode in ("serial", "rollplex"):  # the training attention without a mask (attention/split.py)
        calls["split", mode] = (W.run_steps, (_cfg(mode, SPLIT, hf=tiny_hf), 3))
    calls["data_split", "rollplex"] = (W.run_steps, (_data_cfg("rollplex", example_dir, SPLIT), 2))
    for mutant in ("untempered", "unbanned"):
        calls["data_mutant", mutant] = (W.run_steps, (_data_cfg("rollplex", example_dir), 1, mutant))
    calls["knobs", "rollplex"] = (W.run_steps, (_cfg("rollplex", *KNOBS, hf=tiny_hf), 3))
    calls["tied", "rollplex"] = (W.run_steps, (_cfg("rollplex", hf=tiny_hf_tied), 2))
    return run_local(in_turn, 1, calls)[0]


@pytest.mark.parametrize("mode", ["prefix_shared", "rollplex"])
def test_modes_match_serial_over_three_steps(request, serial_run, mode):
    run = request.getfixturevalue("rollplex_run") if mode == "rollplex" else case(
        request.getfixturevalue("mode_runs"), ("base", mode))
    assert run["tokens"] == serial_run["tokens"]  # same rollouts every step
    first, ref = run["records"][0], serial_run["records"][0]
    for k in ("loss", "grad_norm", "entropy"):
        assert abs(first[k] - ref[k]) <= STEP1_TOL * abs(ref[k]), (k, first[k], ref[k])
    _records_close(run["records"], serial_run["records"])
    assert serial_run["records"][-1]["kl"] > 0.01  # the updates moved the policy away from the reference
    err, name = _param_err(run, serial_run)
    assert err <= TOL, (name, err)
    assert any(r["reward_mean"] > 0 for r in run["records"])  # the update has signal (nonzero advantages)


def _data_cfg(mode, example_dir, *extra):
    """BASE on `make-example` rows (ragged prompts, images and two-frame videos) at temperature 0.7."""
    over = [o for o in BASE if not o.startswith(("task.", "model="))]  # the example's checkpoint sets the model
    return load_run_config(over + [f"mode.name={mode}", f"train.init_hf={example_dir / 'model'}",
                                   f"data.train_files=[{example_dir / 'train.parquet'}]", "rollout.temperature=0.7",
                                   "rollout.max_response_len=6", "reward.format_reward=0.5", *extra])


PACKED = "workload.prefix_pack_tokens=100000"  # every prefix stage of a step as one forward
SPLIT = "mode.attention_backend=split"


@pytest.mark.parametrize("mode", ["serial", "rollplex"])
def test_split_attention_matches_the_masked_serial_run(mode_runs, serial_run, mode):
    """Every scoring and update phase with the split attention (serial: full sequences, each causal over
    itself; rollplex: the group's prefix and the response's own tokens, merged) against serial with the masked
    SDPA attention, over three steps."""
    run = case(mode_runs, ("split", mode))
    assert run["tokens"] == serial_run["tokens"]
    _records_close(run["records"], serial_run["records"])
    err, name = _param_err(run, serial_run)
    assert err <= TOL, (name, err)


def test_split_attention_on_dataset_rows(mode_runs, data_serial_run):
    """Ragged image and video prompts at temperature 0.7, rollplex with the split attention: serial's rollouts
    and update, and the trainer's log-probs equal the sampler's."""
    run, ref = case(mode_runs, ("data_split", "rollplex")), data_serial_run
    assert run["tokens"] == ref["tokens"]
    _records_close(run["records"], ref["records"])
    err, name = _param_err(run, ref)
    assert err <= TOL, (name, err)
    assert all(rec["rollout_logp_diff"] <= LOGP_TOL for rec in run["records"])


def test_rollplex_with_packed_prefixes_matches_serial(mode_runs, serial_run):
    """The rollout's prefill (the actor prefix stage), the window's reference prefixes (through mode.window_graphs'
    path, eager on CPU) and the update's prefix backward, each over one pack of the step's groups: serial's
    rollouts and update over three steps (measured:
    weights 1.6e-6 apart). Ragged image+video prompts in packs are held to full sequences in
    test_prefix_packing.py; they are not used here because the example rows' first step has no reward, and
    Adam turns the rounding-level gradient (3.7e-8, where one group per forward gives exactly 0) into a step."""
    run = case(mode_runs, ("packed", "rollplex"))
    assert run["tokens"] == serial_run["tokens"]
    _records_close(run["records"], serial_run["records"])
    err, name = _param_err(run, serial_run)
    assert err <= TOL, (name, err)
    ro = run["records"][0]["rollout"]
    assert ro["items_in_window"] + ro.get("items_after", 0) == 1  # the reference prefixes: one item
    # mode.window_graphs: the item went through PrefixGraphs, eagerly without CUDA, and each step says so
    assert [r["rollout"]["prefix_graph_eager"] for r in run["records"]] == [1, 1, 1], ro
    assert ro["prefix_graphs_captured"] == 0 and ro["prefix_graph_pool_gib"] == 0.0, ro


@pytest.fixture(scope="module")
def data_serial_run(serial_refs):
    return case(serial_refs, "data")


def test_dataset_batches_mix_images_and_videos_of_ragged_length(example_dir):
    src = build_source(_data_cfg("serial", example_dir))
    rows = [r for step in range(2) for r in src.rows(step, 0, 1, 32 // 4)]
    assert any(r.prompt.pixel_values_videos is not None for r in rows)
    assert any(r.prompt.pixel_values is not None for r in rows)
    assert len({r.prompt.input_ids.numel() for r in rows}) >= 3


@pytest.mark.parametrize("mode", ["prefix_shared", "rollplex"])
def test_modes_match_serial_on_dataset_rows_at_temperature(mode_runs, data_serial_run, mode):
    """Processor-built prompts, sampling at 0.7: same rollouts, same update, and every mode's
    trainer log-probs equal the sampler's (the loss sees the policy that was sampled)."""
    run = case(mode_runs, ("data", mode))
    ref = data_serial_run
    assert run["tokens"] == ref["tokens"]
    _records_close(run["records"], ref["records"])
    err, name = _param_err(run, ref)
    assert err <= TOL, (name, err)
    for rec in run["records"] + ref["records"]:
        assert rec["rollout_logp_diff"] <= LOGP_TOL, rec["rollout_logp_diff"]
    assert any(r["reward_mean"] > 0 for r in run["records"])


@pytest.mark.parametrize("mutant", ["untempered", "unbanned"])
def test_loss_on_another_policy_is_detected(mode_runs, data_serial_run, mutant):
    """Raw logits instead of logits / temperature, or the vision placeholders the sampler bans left in
    the trainer's softmax: the trainer's log-probs leave the sampler's."""
    run = case(mode_runs, ("data_mutant", mutant))
    assert run["records"][0]["rollout_logp_diff"] > 100 * LOGP_TOL
    assert all(r["rollout_logp_diff"] <= LOGP_TOL for r in data_serial_run["records"])


KNOBS = ["train.loss_agg_mode=seq-mean-token-mean", "train.clip_ratio_c=3", "optim.lr_warmup_steps=1",
         "optim.lr_decay_style=cosine", "optim.min_lr=1e-5", "train.steps=3"]


def test_rollplex_matches_serial_with_the_grpo_knobs_on(serial_refs, mode_runs, serial_run):
    """Per-response loss aggregation, dual clip and a warm-up + cosine schedule: the modes still agree,
    and the knobs change the update (the learning rates follow megatron's scheduler). The token-mean side
    of the aggregation check is serial_run's first step (the same config and process as a 1-step run)."""
    serial = case(serial_refs, "knobs")
    rollplex = case(mode_runs, ("knobs", "rollplex"))
    assert rollplex["tokens"] == serial["tokens"]
    # seq-mean-token-mean at ratio 1 makes the loss the mean of group-centred advantages: 0 up to fp32
    # rounding (~1e-8), so it is compared absolutely; the gradient and the weights carry the comparison
    _records_close(rollplex["records"], serial["records"], keys=("kl", "entropy", "grad_norm", "reward_mean"))
    assert all(abs(a["loss"] - b["loss"]) < 1e-6 for a, b in zip(rollplex["records"], serial["records"]))
    err, name = _param_err(rollplex, serial)
    assert err <= TOL, (name, err)
    assert [r["lr"] for r in serial["records"]] == pytest.approx([0.0, 3e-4, 1e-5 + (3e-4 - 1e-5) * 0.5])
    plain = case(serial_refs, "seq_mean")
    token = serial_run["records"][0]
    assert abs(plain["records"][0]["grad_norm"] - token["grad_norm"]) > 1e-3 * token["grad_norm"]  # reaches the grad


PPO = ["train.ppo_mini_batches=2", "train.ppo_epochs=2", "train.dynamic_sampling=true", "train.max_resample_rounds=2"]


@pytest.fixture(scope="module")
def ppo_serial_run(serial_refs):
    return case(serial_refs, "ppo")


@pytest.mark.parametrize("mode", ["prefix_shared", "rollplex"])
def test_modes_match_serial_with_mini_batches_epochs_and_dynamic_sampling(mode_runs, ppo_serial_run, mode):
    """Two mini-batches x two epochs (4 optimizer steps a step) over a batch refilled by dynamic
    sampling: same groups trained, same update; the old log-probs of every mini-batch are the rollout
    policy's (they equal the sampler's), although the weights move between the updates."""
    run, ref = case(mode_runs, ("ppo", mode)), ppo_serial_run
    assert run["tokens"] == ref["tokens"]
    _records_close(run["records"], ref["records"])
    err, name = _param_err(run, ref)
    assert err <= TOL, (name, err)
    need = 32 // 4  # groups trained a step
    for rec, informative in zip(run["records"], run["informative"]):
        ds = rec["rollout"]["dynamic_sampling"]
        assert rec["optimizer_steps"] == 4 and rec["rollout_logp_diff"] <= LOGP_TOL
        found = ds["sampled_groups"] - ds["uninformative_groups"]
        assert informative == min(need, found) and ds["filled_groups"] == max(need - found, 0)
        assert ds["rounds_mean"] > 1  # the tiny model's groups are mostly all-equal: it resampled
        if mode == "rollplex":  # the prefix work done for groups not trained on is on the record
            assert ds["dropped_prefix_groups"] == ds["sampled_groups"] - need > 0
        assert {k: v for k, v in ds.items() if not k.startswith("dropped")} == \
            ref["records"][run["records"].index(rec)]["rollout"]["dynamic_sampling"]


def test_dynamic_sampling_counts_are_global_at_dp2(tiny_hf):
    """At DP=2 every dynamic-sampling count is over both ranks, the prefix work on groups not trained on too: the
    dropped groups are the sampled ones less the 8 trained (4 a rank)."""
    runs = run_local(W.run_steps, 2, _cfg("rollplex", *PPO, "parallel.dp=2", hf=tiny_hf), 1)
    ds = [r["records"][0]["rollout"]["dynamic_sampling"] for r in runs]
    assert ds[0] == ds[1]
    assert ds[0]["dropped_prefix_groups"] == ds[0]["sampled_groups"] - 8 > 0, ds[0]


def test_later_mini_batch_on_the_rollout_prefix_is_detected(tiny_hf, ppo_serial_run):
    """The second mini-batch reading the prefix K/V the rollout computed (at the weights before the
    first optimizer step) instead of recomputing it: the update leaves serial's."""
    run = run_local(W.run_steps, 1, _cfg("rollplex", *PPO, hf=tiny_hf), 2, "stale_prefix")[0]
    assert run["tokens"][0] == ppo_serial_run["tokens"][0]
    err, _ = _param_err(run, ppo_serial_run)
    assert err > 10 * TOL


@pytest.mark.parametrize("mutant", ["skip_prefix_backward", "stale_reference"])
def test_mode_equivalence_detects_breakage(tiny_hf, serial_run, mutant):
    run = run_local(W.run_steps, 1, _cfg("rollplex", hf=tiny_hf), 3, mutant)[0]
    err, _ = _param_err(run, serial_run)
    assert err > 10 * TOL
    late = [(i, k) for i, (rm, rs) in enumerate(zip(run["records"], serial_run["records"])) if i > 0
            for k in ("kl", "grad_norm") if abs(rm[k] - rs[k]) > LATE_TOL * max(abs(rs[k]), 1e-3)]
    assert late  # the later steps' KL / gradient-norm bound sees the breakage too


def test_rollplex_tp2_and_dp2_match_single_process(tiny_hf, rollplex_run):
    """Two steps at TP=2 and at DP=2 against one process (BASE's lr 3e-4: see its comment). The one process
    is rollplex_run's first two steps (the same config; its weights after step 2)."""
    r = rollplex_run
    one = {"tokens": r["tokens"][:2], "records": r["records"][:2], "first": r["first"], "last": r["after"]}
    tp2 = run_local(W.run_steps, 2, _cfg("rollplex", "parallel.tp=2", hf=tiny_hf), 2)
    dp2 = run_local(W.run_steps, 2, _cfg("rollplex", "parallel.dp=2", hf=tiny_hf), 2)
    assert tp2[0]["tokens"] == tp2[1]["tokens"]  # every TP rank samples the same tokens
    assert tp2[0]["tokens"] == one["tokens"]  # TP ranks hold shards: compared by rollouts and metrics
    _records_close(tp2[0]["records"], one["records"])
    assert one["records"][1]["kl"] > 0.1  # the first update moved the policy
    assert dp2[0]["tokens"] + dp2[1]["tokens"] != []  # each DP rank rolled out its own half
    merged = [a + b for a, b in zip(dp2[0]["tokens"], dp2[1]["tokens"])]
    assert merged == one["tokens"]
    _records_close(dp2[0]["records"], one["records"])
    err, name = _param_err(dp2[0], one)
    assert err <= TOL, (name, err)


def test_rollplex_pp2_matches_single_process(tiny_hf_tied, mode_runs):
    """Two steps on two pipeline stages (tied embeddings: the first and last stage each hold a copy,
    synced by megatron's finalize_model_grads) against one process: the engine decodes across the
    pipeline, every stage gets the same rollouts, and the metrics (loss terms from the last stage)
    agree with one stage's."""
    one = case(mode_runs, ("tied", "rollplex"))
    pp2 = run_local(W.run_steps, 2, _cfg("rollplex", "parallel.pp=2", hf=tiny_hf_tied), 2)
    assert pp2[0]["tokens"] == pp2[1]["tokens"] == one["tokens"]
    assert pp2[0]["records"][0]["entropy"] == pp2[1]["records"][0]["entropy"]  # broadcast from the last stage
    _records_close(pp2[0]["records"], one["records"])
    assert one["records"][1]["kl"] > 0.1  # the first update moved the policy


SMALL = ["workload.rollout_batch=8", "workload.responses_per_micro_batch=4", "rollout.group_size=4",
         "train.progress=false"]


def test_torchrun_two_processes_dp2(tmp_path):
    import subprocess

    from rollplex_megatron.recipes import RECIPES_DIR

    script = RECIPES_DIR.parent / "scripts" / "train.sh"
    import sys

    import os

    env = {**os.environ, "PYTHON_BIN": sys.executable}
    p = subprocess.run(["bash", str(script), "2", "parallel.dp=2", *SMALL, "train.steps=1", "train.save_final=false",
                        f"train.out={tmp_path / 'dp2'}"], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert (tmp_path / "dp2" / "metrics.jsonl").read_text().count("\n") == 1


def test_two_torchrun_nodes_equal_one_four_process_launch(tmp_path):
    """scripts/torchrun.sh's multi-node rendezvous on loopback: two launches of 2 processes acting as
    two nodes (TP=2 groups inside each, DP=2 across) train the same 2 steps as one 4-process launch."""
    import os
    import subprocess
    import sys

    from rollplex_megatron.dist import free_port
    from rollplex_megatron.recipes import RECIPES_DIR
    from rollplex_megatron.report import read_metrics

    script = str(RECIPES_DIR.parent / "scripts" / "torchrun.sh")
    args = ["train", "parallel.tp=2", "parallel.dp=2", *SMALL, "train.steps=2", "train.save_final=false",
            "train.progress=false"]
    env = {**os.environ, "PYTHON_BIN": sys.executable}
    one = subprocess.run(["bash", script, "4", *args, f"train.out={tmp_path / 'one'}"], capture_output=True,
                         text=True, timeout=900, env=env)
    assert one.returncode == 0, one.stderr[-3000:]
    nodes = {**env, "NNODES": "2", "RDZV_ENDPOINT": f"127.0.0.1:{free_port()}"}
    procs = [subprocess.Popen(["bash", script, "2", *args, f"train.out={tmp_path / 'two'}"],
                              env={**nodes, "NODE_RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=900) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-6000:] + outs[1][1][-6000:]
    a, b = read_metrics(tmp_path / "one" / "metrics.jsonl"), read_metrics(tmp_path / "two" / "metrics.jsonl")
    assert len(a) == len(b) == 2
    for ra, rb in zip(a, b):  # the same ranks, groups and reduction order: the same numbers
        assert (ra["loss"], ra["grad_norm"], ra["reward_mean"]) == (rb["loss"], rb["grad_norm"], rb["reward_mean"])


def test_tp_groups_never_span_nodes():
    from rollplex_megatron.dist import check_tp_in_node

    check_tp_in_node(2, 4, 2)
    check_tp_in_node(4, 4, 4)
    with pytest.raises(ValueError, match="span nodes"):
        check_tp_in_node(4, 8, 2)


def test_bad_training_config_fails_before_processes_start():
    """The three commands, started together (each fails in its own launcher, before any worker or port)."""
    import subprocess
    import sys

    bad = [["workload.rollout_batch=10", "rollout.group_size=4"], ["model=qwen2_5_vl_3b", "parallel.tp=3"],
           ["mode.name=fast"]]
    procs = [subprocess.Popen([sys.executable, "-m", "rollplex_megatron", "train", *a], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for a in bad]
    (batch, tp, mode) = [(p.communicate(timeout=600)[1], p.returncode) for p in procs]
    assert batch[1] != 0 and "rollout.group_size (4) must divide workload.rollout_batch (10)" in batch[0]
    assert tp[1] != 0 and "parallel.tp" in tp[0]
    assert mode[1] != 0 and "mode.name" in mode[0]
