"""Shared fixtures: tiny HF checkpoints built once per session."""
import warnings

import pytest

from rollplex_megatron.compat import quiet_known_warnings
from tests.hf_models import make_tiny_hf

quiet_known_warnings()
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
