"""A whole verl 0.9.1 PPO run on CPU: verl's own driver (`main_ppo`, the v1 `rollplex` trainer, Ray, TransferQueue)
with this project's engine and `rollout.name=rollplex`, 2 steps on 2 CPU ranks (TP=2), fp32, GRPO.

The checkpoint and rows are `make-example --verl`'s, as a user gets them (verl 0.9.1 on transformers 5.24 without
torchvision): its video config names `RollplexQwen2VLVideoProcessor` (integrations/verl/video.py), its tokenizer
has a one-token newline (verl's Qwen token builder) and plain vision tokens (verl's agent loop decodes the prompt
dropping special tokens, then the processor counts placeholders), and its rows are ragged. A batch whose samples
all have one length fails in verl 0.9.1's own actor update (verl issue #7899); the plugin fixes it
(integrations/verl/positions.py, checked in-process by tests/test_verl_positions.py), and on such rows (prompts of
one length whose ids are equal, only the pixels differ) these checks pass too now that the rollout seeds each
prompt from its whole content (tests/test_verl_rollout_seeds.py; docs/guides/verl.md, Known gaps). The dataset
class is `RollplexRLHFDataset` (no qwen_vl_utils).

Checked: rewards and losses logged for both steps; the rollout's log-probs equal the actor's old log-probs (verl's
own rollout-vs-training metrics); with a KL loss (the reference in the same workers) the shared run's old
log-probs read the rollout prefill's K/V and its reference log-probs the decode window's, for every group; the
same 2 steps with every group as full sequences (ROLLPLEX_VERL_PREFIX=full, nothing held) give the same losses,
KL losses and grad norms within docs/design.md §3's fp32 tolerance (1e-5, norm-relative). Mutation: a third step
whose held K/V are another prompt's fails both checks.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollplex_megatron.data.example import make_example
from rollplex_megatron.recipes import load_run_config

TOL = 1e-5
REPO = Path(__file__).resolve().parents[1]
# a reward that differs within a group, so GRPO's advantages, losses and gradients are not all zero
REWARD = ("def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):\n"
          "    return float(len(solution_str) % 5)\n")


def example(root: Path) -> Path:
    """`make-example --verl`'s checkpoint and rows, used as written."""
    return make_example(root / "ex", load_run_config([]).model, train_rows=4, val_rows=2, verl=True)


# Mutation from the third rollout that holds K/V on (the first two are the steps checked; verl's first sleep comes
# before any rollout, so rounds are counted as seen), as a verl plugin of its own (verl imports every
# `verl.plugins` entry point in every process): the K/V a rollplex rollout holds for the scoring phases are replaced
# by others of the same shape and scale, as another prompt's would be
MUTATION = ("import torch\n"
            "from rollplex_megatron.integrations.verl import held\n"
            "hold = held.HeldPrefixes.hold\n"
            "seen = []\n"
            "def other(self, prompt, store, group, version, dtype):\n"
            "    hold(self, prompt, store, group, version, dtype)\n"
            "    if self.round not in seen:\n"
            "        seen.append(self.round)\n"
            "    if seen.index(self.round) < 2:\n"
            "        return\n"
            "    gen = torch.Generator().manual_seed(group)\n"
            "    for kv in self.entries[held.prompt_key(prompt)][-1][1].values():\n"
            "        for t in kv:\n"
            "            t.copy_(torch.randn(t.shape, generator=gen) * t.std())\n"
            "held.HeldPrefixes.hold = other\n")


def mutation_site(root: Path) -> Path:
    """A folder that, on PYTHONPATH, installs `MUTATION` as a verl plugin."""
    site = root / "mutation_site"
    info = site / "rollplex_mutation-0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rollplex-mutation\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[verl.plugins]\nmutation = rollplex_mutation\n")
    (site / "rollplex_mutation.py").write_text(MUTATION)
    return site


def run_verl(ex: Path, run: Path, env: dict, path: str = "", steps: int = 2) -> list[dict]:
    """verl's driver with the recipe for `steps` steps; returns the metrics verl's file logger wrote per step.
    `path`: put first on PYTHONPATH (of the driver, hence of its Ray workers)."""
    run.mkdir()
    (run / "reward.py").write_text(REWARD)
    ray_env = "+ray_kwargs.ray_init.runtime_env.env_vars"
    args = [f"data.train_files={ex}/train.parquet", f"data.val_files={ex}/val.parquet", "data.train_batch_size=2",
            "data.max_prompt_length=256", "data.max_response_length=4", "data.filter_overlong_prompts=False",
            "data.dataloader_num_workers=0", "data.shuffle=False",
            "data.custom_cls.path=pkg://rollplex_megatron.integrations.verl.data",
            "data.custom_cls.name=RollplexRLHFDataset",
            f"reward.custom_reward_function.path={run}/reward.py", "reward.num_workers=1",
            f"actor_rollout_ref.model.path={ex}/model",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.optim.lr=1e-3",
            # a KL loss: verl builds the reference in the same workers, whose prefix stage the rollout's window runs
            "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.1",
            "actor_rollout_ref.rollout.name=rollplex", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.calculate_log_probs=True",
            "actor_rollout_ref.rollout.agent.num_workers=1",
            "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
            "trainer.device=cpu", "trainer.n_gpus_per_node=2", "trainer.nnodes=1",
            f"trainer.total_training_steps={steps}",
            "trainer.logger=[console,file]", "trainer.val_before_train=False", "trainer.test_freq=-1",
            f"trainer.default_local_dir={run}/ckpt", "+ray_kwargs.ray_init.num_gpus=2",
            "ray_kwargs.ray_init.num_cpus=16", f"{ray_env}.ROLLPLEX_VERL_DTYPE=float32",
            f"{ray_env}.VERL_FILE_LOGGER_PATH={run}/metrics.jsonl", f"hydra.run.dir={run}/hydra",
            *[f"{ray_env}.{k}={v}" for k, v in env.items()]]
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", f"--config-path={REPO}/recipes/verl",
           "--config-name=qwen2_5_vl_rollplex", *args]
    out = subprocess.run(cmd, cwd=run, capture_output=True, text=True, timeout=400,
                         env={**os.environ, "VERL_ENGINE_VENDOR": "rollplex", "PYTHONWARNINGS": "ignore",
                              **({"PYTHONPATH": os.pathsep.join([path, os.environ.get("PYTHONPATH", "")])}
                                 if path else {})})
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
    return [json.loads(line)["data"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(shared, full, mutant): the metrics of 3 steps with prefix sharing and with every group as full rows; the
    shared run's third step holds other K/V (`MUTATION`), so its first two are `shared` and its third `mutant`.
    One driver after another (side by side on 2 cores they took longer), one driver for the shared steps and the
    mutant step (a driver's start-up is most of its time)."""
    root = tmp_path_factory.mktemp("verl_step")
    ex = example(root)
    site = str(mutation_site(root))  # the driver's path and its Ray workers'
    shared = run_verl(ex, root / "shared", {"PYTHONPATH": site}, site, steps=3)
    full = run_verl(ex, root / "full", {"ROLLPLEX_VERL_PREFIX": "full"}, steps=3)
    return shared[:2], full, shared[2:]


def test_two_verl_steps_log_rewards_and_losses(runs):
    shared = runs[0]
    assert [m["training/global_step"] for m in shared + runs[2]] == [1, 2, 3]
    for m in shared:
        assert {"critic/score/mean", "critic/rewards/mean", "actor/pg_loss", "actor/grad_norm"} <= set(m)
        assert m["critic/score/max"] > m["critic/score/min"]  # the reward differs within the batch
    assert any(m["actor/grad_norm"] > 0 for m in shared)  # a real update, not zero advantages


def test_rollout_log_probs_equal_the_actors_old_log_probs(runs):
    for m in runs[0] + runs[1]:  # not the mutant step's
        # verl's rollout-vs-training metrics: per-token probabilities and per-sequence mean log-probs
        assert m["training/rollout_probs_diff_max"] <= TOL
        assert max(abs(m["rollout_corr/log_ppl_diff_max"]), abs(m["rollout_corr/log_ppl_diff_min"])) <= TOL


KEYS = ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/score/mean", "actor/entropy")


def _worst(a: list[dict], b: list[dict]) -> float:
    """The largest norm-relative difference of `KEYS` between two runs' steps (GRPO's on-policy loss is ~0, with
    unit-scale advantages summing to 0: its scale is 1)."""
    return max(abs(x[k] - y[k]) / max(abs(x[k]), abs(y[k]), 1.0) for x, y in zip(a, b, strict=True) for k in KEYS)


def test_full_sequences_give_the_same_losses_and_grad_norms(runs):
    shared, full, _ = runs
    assert _worst(shared, full[:2]) <= TOL


def test_other_held_kv_fail_the_checks(runs):
    """Mutation (the third step): other K/V held; the on-policy check and the comparison with full sequences both
    fail."""
    _, full, mutant = runs
    # per-sequence mean log-probs (the probabilities themselves are ~1/vocabulary on this checkpoint: their
    # difference is small whatever the log-probs do)
    ppl = max(max(abs(m["rollout_corr/log_ppl_diff_max"]), abs(m["rollout_corr/log_ppl_diff_min"])) for m in mutant)
    assert ppl > 100 * TOL, [{k: m[k] for k in KEYS} for m in mutant]
    assert len(mutant) == 1 and _worst(mutant, full[2:]) > 100 * TOL, ([{k: m[k] for k in KEYS} for m in mutant],
                                                                         full)


def test_the_rollout_ran_the_prefix_stages_the_scoring_phases_read(runs):
    """Shared: every group's old log-probs read the rollout prefill's K/V and its reference log-probs the decode
    window's (rollout.py, held.py); none computed again. Full sequences read no prefix K/V."""
    shared, full, mutant = runs
    for m in shared + mutant:
        for phase in ("old_logp", "ref"):
            got = [m[f"rollplex/{phase}_prefix_{k}"] for k in ("from_rollout", "computed", "stale")]
            assert got == [2, 0, 0], (phase, got)  # 2 prompts a step (data.train_batch_size), DP 1
        # the balancing read each uid's stored prompt and kept it on the rank holding its K/V
        assert (m["rollplex/rollout_uids_pinned"], m["rollplex/rollout_uids_moved"]) == (2, 0), m
    assert not any(k.startswith("rollplex/") and "prefix" in k for m in full for k in m)
