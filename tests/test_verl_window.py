"""The decode window under verl (rollplex_megatron/integrations/verl/window.py, worker.py, trainer.py): the
reference prefix stage of each uid runs in SGLang's scheduler (a stand-in here: SGLang cannot be installed, see
`tests/sglang_workers.py`), found through a rendezvous directory, and the reference phase uses those K/V only
where the job's prompt is the batch's bit for bit (fp32 CPU, DESIGN 1e-5)."""
import math

import pytest

from rollplex_megatron.dist import run_local
from tests import verl_workers as W

TOL = 1e-5


@pytest.fixture(scope="module")
def window(tiny_hf, tmp_path_factory):
    return run_local(W.window_cases, 1, str(tiny_hf), str(tmp_path_factory.mktemp("rendezvous")))[0]


def test_reference_log_probs_from_window_prefixes_equal_its_own(window):
    """Three uids' prefixes from the scheduler (two bridge steps): no prefix recomputed, log-probs as without."""
    assert window["window"] == {"from_window": 3, "computed": 0}, window["window"]
    assert window["rel"] <= TOL, window["rel"]
    assert window["published"] == [f"{window['slot']}.json"]  # one rendezvous file, named by the device
    assert window["steps"] == 4 and window["scheduler_exit"] == 0, window


def test_window_prefix_of_another_prompt_is_not_used(window):
    """A job under a batch's uid whose prompt has the same shapes but other ids and pixels: the check refuses it
    (that prefix runs again), the other two are used, and the log-probs equal."""
    assert window["wrong_window"] == {"from_window": 2, "computed": 1}, window["wrong_window"]
    assert window["rel_wrong"] <= TOL, window["rel_wrong"]


def test_mutation_trusting_the_window_uid_is_caught(window):
    """Mutation: the prompt check off; the wrong prompt's K/V are used and the log-probs are wrong."""
    assert window["trusted_window"] == {"from_window": 3, "computed": 0}
    assert window["rel_trusted"] > 100 * TOL and math.isfinite(window["rel_trusted"]), window["rel_trusted"]
