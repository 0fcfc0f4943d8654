"""The decode window under verl (rollplex_megatron/integrations/verl/window.py, worker.py, trainer.py): the
reference prefix stage of each uid runs in SGLang's scheduler (a stand-in here: SGLang cannot be installed, see
`tests/sglang_workers.py`), found through a rendezvous directory, and the reference phase uses those K/V only
where the job's prompt is the batch's bit for bit (fp32 CPU, docs/design.md §3: 1e-5)."""
import json
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
    assert window["connected"] and window["window"] == {"from_window": 3, "computed": 0}, window["window"]
    assert window["rel"] <= TOL, window["rel"]
    assert window["published"] == [f"{window['slot']}.json"]  # one rendezvous file, named by the device
    assert window["steps"] == 5 and window["scheduler_exit"] == 0, window
    assert window["unclaimed"] == ({}, 1, 0)  # K/V the reference phase does not claim are dropped there


def test_window_without_a_scheduler_fails_the_reference_phase_naming_the_fix(window):
    """No SGLang scheduler connects (the plugin is not where SGLang runs): the reference phase raises, naming the
    rendezvous file and the fix, instead of hanging on the jobs."""
    err = window.get("lonely_error", "")
    assert "no SGLang scheduler connected" in err and "nobody" in err and "sglang.srt.plugins" in err, err
    assert not window["lonely_file_left"]  # closing the window takes its rendezvous file away
    assert "ROLLPLEX_VERL_WINDOW_MECHANISM=sideways: mode.window must be one of" in window["bad_mechanism"]
    assert window["lonely_mechanism"] == "after"


def test_window_prefix_of_another_prompt_is_not_used(window):
    """A job under a batch's uid whose prompt has the same shapes but other ids and pixels: the check refuses it
    (that prefix runs again), the other two are used, and the log-probs equal."""
    assert window["wrong_window"] == {"from_window": 2, "computed": 1}, window["wrong_window"]
    assert window["rel_wrong"] <= TOL, window["rel_wrong"]


def test_mutation_trusting_the_window_uid_is_caught(window):
    """Mutation: the prompt check off; the wrong prompt's K/V are used and the log-probs are wrong."""
    assert window["trusted_window"] == {"from_window": 3, "computed": 0}
    assert window["rel_trusted"] > 100 * TOL and math.isfinite(window["rel_trusted"]), window["rel_trusted"]


def test_group_partitions_keep_each_uid_on_its_window_rank():
    """The balancing puts a uid where the window sent its prefix while that rank has room, the rest by load."""
    from rollplex_megatron.integrations.verl.trainer import group_partitions

    uids = [u for u in "abcd" for _ in range(3)]
    load = [9.0] * 3 + [8.0] * 3 + [1.0] * 3 + [1.0] * 3  # by load alone: a with c or d, b with the other
    free = group_partitions(uids, load, 2)
    assert {uids[i] for i in free[0]} == {"a", "d"}  # the case the pins must change
    pinned = group_partitions(uids, load, 2, pinned={"a": 1, "b": 1})
    assert [sorted({uids[i] for i in p}) for p in pinned] == [["c", "d"], ["a", "b"]]
    full = group_partitions(uids, load, 2, pinned={"a": 0, "b": 0, "c": 0})  # rank 0 holds two groups only
    assert sorted({uids[i] for i in full[0]}) == ["a", "b"] and len(full[0]) == len(full[1]) == 6


class _WG:
    """A stand-in worker group: verl's dispatch info and the window method, recorded."""

    def __init__(self, ranks):
        self._dispatch_info = {"ref": ranks, "actor": ranks}
        self.calls = []

    def rollplex_window_submit(self, keys, ranks):
        self.calls.append((dict(keys), dict(ranks)))
        return [len(keys)]


def _trainer(monkeypatch, tags):
    import transfer_queue as tq
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    from rollplex_megatron.integrations.verl.trainer import RollplexTrainer

    t = RollplexTrainer.__new__(RollplexTrainer)  # no Ray: only the window's bookkeeping runs
    t._window_init()
    t.ref_policy_wg = t.actor_rollout_wg = _WG([0, 0, 1, 1])  # 4 workers, TP 2, DP 2
    monkeypatch.setattr(PPOTrainer, "_submit_batch_to_rollout", lambda self, batch: len(batch["uid"]))
    monkeypatch.setattr(tq, "kv_list", lambda: {"train": dict(tags)})
    return t


def test_window_poller_hands_each_finished_uid_once_to_its_rank(monkeypatch):
    """Each poll hands the submitted uids with a finished sample (not prompts' own tags, not uids this trainer did
    not submit) to the workers once, each to the DP rank with the fewest uids, then the fewest prompt tokens; a
    failed hand-out leaves its uids for the next poll; the batch consumes the pins and forgets older steps'."""
    tags = {"a": {"is_prompt": True, "status": "running"}, "a_0_0": {"status": "success", "prompt_len": 100},
            "a_1_0": {"status": "success", "prompt_len": 100}, "zz_0_0": {"status": "success", "prompt_len": 9}}
    t = _trainer(monkeypatch, tags)
    t.global_steps = 3
    assert t._submit_batch_to_rollout({"uid": ["a", "b", "c"]}) == 3
    assert t.window_poll_once() == 1 and t.ref_policy_wg.calls == [({"a": "a_0_0"}, {"a": 0})]
    assert t.window_poll_once() == 0  # a was handed out already
    tags["b_2_0"] = {"status": "success", "prompt_len": 50}
    submit = t.ref_policy_wg.rollplex_window_submit
    t.ref_policy_wg.rollplex_window_submit = lambda keys, ranks: 1 / 0  # e.g. a sample cleared meanwhile
    assert t.window_poll_once() == 0 and t.window_failures == 1
    t.ref_policy_wg.rollplex_window_submit = submit
    tags["c_0_0"] = {"status": "success", "prompt_len": 70}
    assert t.window_poll_once() == 2  # b (tried again) to rank 1; c to rank 1, which holds fewer tokens
    assert t.ref_policy_wg.calls[-1] == ({"b": "b_2_0", "c": "c_0_0"}, {"b": 1, "c": 1})
    t._window_ranks["old"] = (0, 1)  # handed out at step 1, never in a batch
    t._window_wanted["older"] = 1
    assert t._take_pins({"a", "b", "c"}) == {"a": 0, "b": 1, "c": 1}
    assert t._window_ranks == {} and t._window_wanted == {}


def test_window_swaps_verls_worker_before_any_starts(monkeypatch, tmp_path):
    """On verl's own config (the recipe with docs/guides/verl.md's window overrides): the trainer's resource set-up puts
    the rollplex worker in verl's colocated role; SGLang at another TP than the reference, a layout without a
    colocated reference, and listener addresses are refused there, before any worker starts."""
    import os

    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo.utils import Role

    from rollplex_megatron.integrations.verl.trainer import RollplexTrainer
    from rollplex_megatron.integrations.verl.worker import RollplexActorRolloutRefWorker
    from rollplex_megatron.rollout.sglang.protocol import ENV_ADDRESS
    from tests.test_verl_plugin import WINDOW_OVERRIDES

    def trainer(*overrides):
        with initialize_config_dir(config_dir=os.path.abspath("recipes/verl"), version_base=None):
            cfg = compose("qwen2_5_vl_rollplex", overrides=["actor_rollout_ref.model.path=/m", *overrides])
        t = RollplexTrainer.__new__(RollplexTrainer)
        t.config = cfg
        return t

    monkeypatch.setenv(ENV_ADDRESS, f"dir:{tmp_path}")
    kl = "actor_rollout_ref.actor.use_kl_loss=true"
    t = trainer(kl, *WINDOW_OVERRIDES[1:])
    t._init_resource_pool_mgr()
    assert t.role_worker_mapping[Role.ActorRolloutRef].__ray_actor_class__ is RollplexActorRolloutRefWorker
    assert t._window
    with pytest.raises(ValueError, match="rollout.tensor_model_parallel_size=1"):  # verl's default rollout TP 2
        trainer(kl)._init_resource_pool_mgr()
    with pytest.raises(ValueError, match="Role.ActorRolloutRef"):  # no reference model: nothing to move
        trainer(*WINDOW_OVERRIDES[1:])._init_resource_pool_mgr()
    monkeypatch.setenv(ENV_ADDRESS, "127.0.0.1:1")
    with pytest.raises(ValueError, match="dir:PATH"):
        trainer(kl, *WINDOW_OVERRIDES[1:])._init_resource_pool_mgr()
    monkeypatch.setenv("ROLLPLEX_VERL_PREFIX", "fulll")  # a worker would refuse it only after Ray started it
    with pytest.raises(ValueError, match="ROLLPLEX_VERL_PREFIX='fulll': use one of shared, full"):
        trainer(kl, *WINDOW_OVERRIDES[1:])._init_resource_pool_mgr()


@pytest.mark.parametrize("name,value,want", [
    ("ROLLPLEX_VERL_ATTENTION", "sdpaa", "use one of auto, sdpa, flex, split"),
    ("ROLLPLEX_VERL_DTYPE", "fp16", "use one of bfloat16"),
    ("ROLLPLEX_VERL_NORM_KERNEL", "trion", "use one of auto, triton, torch"),
    ("ROLLPLEX_VERL_ROPE_KERNEL", "x", "use one of auto, triton, torch"),
    ("ROLLPLEX_VERL_WINDOW", "no", "use one of on, off"),
    ("ROLLPLEX_VERL_WINDOW_MECHANISM", "fast", "use one of interleave"),
    ("ROLLPLEX_VERL_KV_CACHE_GIB", "lots", "a positive number of GiB"),
    ("ROLLPLEX_VERL_KV_CACHE_GIB", "-1", "a positive number of GiB"),
])
def test_every_verl_environment_value_is_checked_in_the_driver(name, value, want):
    from rollplex_megatron.integrations.verl.trainer import check_environment

    good = {"ROLLPLEX_VERL_PREFIX": "full", "ROLLPLEX_VERL_ATTENTION": "sdpa", "ROLLPLEX_VERL_DTYPE": "float32",
            "ROLLPLEX_VERL_NORM_KERNEL": "torch", "ROLLPLEX_VERL_ROPE_KERNEL": "auto", "ROLLPLEX_VERL_WINDOW": "off",
            "ROLLPLEX_VERL_WINDOW_MECHANISM": "after", "ROLLPLEX_VERL_KV_CACHE_GIB": "0.5"}
    check_environment(good)
    with pytest.raises(ValueError, match=f"^{name}={value!r}: .*{want}"):
        check_environment({**good, name: value})


def test_window_needs_sglang_at_the_reference_tp():
    """Refused before any worker starts: an SGLang TP group must be one reference TP group."""
    from omegaconf import OmegaConf

    from rollplex_megatron.integrations.verl.trainer import RollplexTrainer

    t = RollplexTrainer.__new__(RollplexTrainer)
    t.config = OmegaConf.create({"actor_rollout_ref": {"actor": {"megatron": {"tensor_model_parallel_size": 2}},
                                                       "ref": {"megatron": {"tensor_model_parallel_size": 2}},
                                                       "rollout": {"tensor_model_parallel_size": 2}}})
    t._check_window_layout()
    t.config.actor_rollout_ref.rollout.tensor_model_parallel_size = 1
    with pytest.raises(ValueError, match=r"rollout.tensor_model_parallel_size=2"):
        t._check_window_layout()


def test_rendezvous_trusts_only_a_private_folder_and_file(tmp_path, monkeypatch):
    """The rendezvous file's address and key open a channel of pickles into the scheduler: a folder other users may
    write, or a file other users may read or write, is refused by name before any connection (a planted listener
    would otherwise be trusted); the trainer's own publish makes a fresh folder private and refuses an open one."""
    from multiprocessing.connection import Listener

    from rollplex_megatron.rollout.sglang import protocol as P

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv(P.ENV_ADDRESS, f"dir:{shared}")
    slot = P.device_slot(0)
    # a listener's address that no longer answers: without the checks `connect` would return None, not hang
    with Listener(("127.0.0.1", 0), authkey=bytes.fromhex("11" * 16)) as gone:
        port = gone.address[1]
    (shared / f"{slot}.json").write_text(json.dumps({"address": f"127.0.0.1:{port}",
                                                      "key": "11" * 16, "model_path": None}))
    with pytest.raises(P.BridgeError, match="rendezvous folder .* mode 777, open to other users"):
        P.connect(0)
    with pytest.raises(P.BridgeError, match="mkdir -m 700"):
        P.publish(shared, slot, "127.0.0.1:1", "00" * 16)
    own = tmp_path / "own" / "deeper"
    P.publish(own, slot, f"127.0.0.1:{port}", "11" * 16)
    assert own.stat().st_mode & 0o777 == 0o700
    monkeypatch.setenv(P.ENV_ADDRESS, f"dir:{own}")
    (own / f"{slot}.json").chmod(0o644)
    with pytest.raises(P.BridgeError, match="rendezvous file .* mode 644"):
        P.connect(0)
    (own / f"{slot}.json").unlink()
    (own / f"{slot}.json").symlink_to(shared / f"{slot}.json")
    with pytest.raises(P.BridgeError, match="a symbolic link"):
        P.connect(0)


def test_rendezvous_connects_only_the_scheduler_of_the_trainers_checkpoint(tmp_path, monkeypatch):
    """Under `dir:` a scheduler connects only where a trainer rank published for its device and checkpoint: no
    file (a GPU without a trainer rank), another checkpoint (a reward model's server on the same GPU) or a
    listener that is gone (a file of an earlier run) leave the bridge off there, decided once; the model load
    takes no weights from the trainer (verl syncs SGLang's own)."""
    from multiprocessing.connection import Listener
    from types import SimpleNamespace

    from rollplex_megatron.rollout.sglang import plugin
    from rollplex_megatron.rollout.sglang import protocol as P

    monkeypatch.setenv(P.ENV_ADDRESS, f"dir:{tmp_path}")
    slot = P.device_slot(0)
    assert P.connect(0, model_path="/m") is None and not P.binds_weights()
    with Listener(("127.0.0.1", 0), authkey=bytes.fromhex("00" * 16)) as dead:
        port = dead.address[1]
    P.publish(tmp_path, slot, f"127.0.0.1:{port}", "00" * 16, "/m")
    assert (tmp_path / f"{slot}.json").stat().st_mode & 0o777 == 0o600
    assert P.connect(0, model_path="/m") is None  # nobody listens there any more
    assert P.connect(0, model_path="/reward-model") is None  # another server's checkpoint: not even tried
    monkeypatch.setattr(plugin, "_BRIDGE", None)
    sched = SimpleNamespace(tp_rank=0, tp_size=1, server_args=SimpleNamespace(model_path="/reward-model"))
    assert plugin.bridge_of(sched) is None and plugin._BRIDGE is plugin._NO_BRIDGE
    assert plugin.after_load_model("loaded", sched) == "loaded"
    monkeypatch.setattr(plugin, "_BRIDGE", None)
