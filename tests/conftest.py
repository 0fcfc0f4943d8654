"""Shared fixtures: tiny HF checkpoints built once per session.

ROLLPLEX_NUM_THREADS=k runs this process and every `run_local` rank with k intra-op threads: run the
suite with 1 and with 2 to find assertions that depend on the CPU's reduction order.
"""
import os
import tempfile
import warnings

import pytest
import torch

from rollplex_megatron.compat import quiet_known_warnings
from rollplex_megatron.data.example import make_example
from rollplex_megatron.recipes import load_run_config
from tests.hf_models import make_tiny_hf

quiet_known_warnings()
if os.environ.get("ROLLPLEX_NUM_THREADS"):
    torch.set_num_threads(int(os.environ["ROLLPLEX_NUM_THREADS"]))
warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS.*")
# what the suite's runs cache (video probes) stays out of the user's cache; every rank started from here inherits it
os.environ.setdefault("ROLLPLEX_CACHE_DIR", tempfile.mkdtemp(prefix="rollplex-test-cache-"))


LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@pytest.fixture(autouse=True)
def no_launch_env_left():
    """A test that initialises torch.distributed in pytest's own process must not leave the launch variables
    behind: every later command started with this environment would take that rendezvous (and its port, still
    held). Fails the test that leaves them, naming them, and restores the environment for the next."""
    before = {k: os.environ.get(k) for k in LAUNCH_ENV}
    yield
    left = {k: os.environ.get(k) for k in LAUNCH_ENV if os.environ.get(k) != before[k]}
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    assert not left, f"the test left launch variables {left}: run torch.distributed in a worker (run_local)"


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """Untied tiny checkpoint."""
    return make_tiny_hf(tmp_path_factory.mktemp("hf") / "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_hf_tied(tmp_path_factory):
    """Tied-embedding tiny checkpoint (like the 3B release)."""
    return make_tiny_hf(tmp_path_factory.mktemp("hf") / "tiny_tied", seed=1, tie=True)


@pytest.fixture(scope="session")
def tiny_hf_tp4(tmp_path_factory):
    """Tiny checkpoint whose heads, KV groups and widths divide TP=4."""
    return make_tiny_hf(tmp_path_factory.mktemp("hf") / "tiny_tp4", seed=3,
                        text={"num_attention_heads": 8, "num_key_value_heads": 4,
                              "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                  "mrope_section": [1, 1, 2]}},
                        vision={"num_heads": 4})


@pytest.fixture(scope="session")
def example_dir(tmp_path_factory):
    """`make-example`'s directory (tiny preset checkpoint with its processor; ragged image and video rows)."""
    return make_example(tmp_path_factory.mktemp("ex") / "example", load_run_config([]).model, train_rows=24,
                        val_rows=8, videos=True, ragged=True)


@pytest.fixture(scope="session")
def serial_run(tiny_hf):
    """Serial mode on test_trainer's BASE at the tiny checkpoint, 3 steps: the trainer tests' reference, and
    the colocated run the one-rank disaggregated tests of test_rollout_layout compare with (the same config,
    so one run serves all)."""
    from rollplex_megatron.dist import run_local
    from tests import trainer_workers as W
    from tests.test_trainer import _cfg

    return run_local(W.run_steps, 1, _cfg("serial", hf=tiny_hf), 3)[0]


@pytest.fixture(scope="session")
def rollplex_run(tiny_hf):
    """Rollplex mode on test_trainer's BASE at the tiny checkpoint, 3 steps, with the weights after step 2
    (`after`): the mode-equivalence run, the one-process side of the TP2/DP2 test (its first 2 steps) and the
    phase-plan run of test_memory_runtime (test_trainer's BASE names memory.plan=phase)."""
    from rollplex_megatron.dist import run_local
    from tests import trainer_workers as W
    from tests.test_trainer import _cfg

    return run_local(W.run_steps, 1, _cfg("rollplex", hf=tiny_hf), 3, "", 2)[0]
