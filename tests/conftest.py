"""Shared fixtures: tiny HF checkpoints built once per session.

ROLLPLEX_NUM_THREADS=k runs this process and every `run_local` rank with k intra-op threads: run the
suite with 1 and with 2 to find assertions that depend on the CPU's reduction order.
"""
import os
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
