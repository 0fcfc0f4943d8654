"""GPU-only: rollout.engine=sglang with SGLang itself (not the stand-in scheduler of test_gpu_sglang_ipc.py).

The trainer's Runtime starts `sglang.Engine` on make-example's tiny Qwen2.5-VL in bf16, with the plugin's
hooks in SGLang's own scheduler process (`tests/sglang_real_workers.py`). One start serves three greedy
rollouts of the same prompts, each with the window's prefix jobs. Checked: the jobs ran in the scheduler and
some between SGLang's decode steps; their K/V equal the same prefix stages run directly; SGLang's parameters
are the training storage (the trainer's allocator gained only the shards' own buffers while SGLang started);
an in-place weight change reaches SGLang's next rollout with nothing sent; SGLang's greedy tokens are the
embedded engine's (up to bf16 ties); and the mutation (SGLang's parameters bound to copies) is caught.

Marked `gpu`: skipped, with a reason, without CUDA or without an importable SGLang (on the device machine:
`bash benchmarks/gpu_sglang_real.sh`, which unpacks a carried SGLang 0.5.17 and runs this file).
"""
import pytest
import torch

from rollplex_megatron.data.example import make_example
from rollplex_megatron.dist import run_local
from rollplex_megatron.recipes import load_run_config
from tests import sglang_real_workers as W

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA: SGLang's engine and the bridge's CUDA IPC handles run only on a GPU",
                allow_module_level=True)
try:
    import sglang  # noqa: F401
except Exception as e:  # a broken install too (SGLang checks transformers' version at import)
    pytest.skip(f"needs SGLang importable (e.g. 0.5.17, the release for torch 2.11): import sglang failed with "
                f"{type(e).__name__}: {e}", allow_module_level=True)

KV_TOL = 1e-2  # docs/design.md §3, bf16 on GPU (norm-relative)
LOGP_TOL = 1e-2  # docs/design.md §3: per-token log-probs, bf16 on GPU
# SGLang without what the carried site leaves out (fa3, flashinfer sampling); no CUDA graphs: the mutation
# rebinds SGLang's parameters after start-up, which graphs captured at start-up would not read
ENGINE_ARGS = {"attention_backend": "triton", "mm_attention_backend": "sdpa", "sampling_backend": "pytorch",
               "disable_cuda_graph": "true", "log_level": "warning"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The worker's record: one SGLang start, three rollouts."""
    base = load_run_config([])
    ex = make_example(tmp_path_factory.mktemp("ex") / "example", base.model, train_rows=8, val_rows=2)
    cfg = load_run_config([f"train.init_hf={ex / 'model'}", "dtype=bfloat16", "rollout.engine=sglang",
                           "rollout.group_size=2", "train.reference=always", "memory.plan=keep",
                           "memory.kv_cache_gib=1", "rollout.sglang.mem_fraction_static=0.3",
                           "rollout.sglang.startup_timeout_s=200", "rollout.sglang.timeout_s=60"]
                          + [f"+rollout.sglang.engine_args.{k}={v}" for k, v in ENGINE_ARGS.items()])
    return run_local(W.real_sglang, 1, cfg, str(tmp_path_factory.mktemp("plugin")))[0]


def test_sglang_rollout_with_window_jobs_in_its_scheduler(run):
    """SGLang itself decodes (its scheduler is another process that says its release); the window's jobs ran there,
    some between its decode steps, and their K/V equal the prefix stages run directly."""
    assert run["scheduler_pid"] != run["trainer_pid"] and run["scheduler_version"] == run["sglang"], run
    for name in ("first", "changed", "copied"):
        r = run[name]
        assert r["window"]["decode_steps"] > 0, (name, r["window"])  # the run_batch hook saw SGLang's decode
        assert r["jobs_done"] == r["jobs"] == r["window"]["items_in_window"] + r["window"]["items_after"], r
        assert r["kv_rel"] and max(r["kv_rel"]) <= KV_TOL, (name, max(r["kv_rel"]))
        assert all(len(t) == W.NEW_TOKENS for s in r["tokens"] for t in s), name
    assert run["first"]["window"]["items_in_window"] + run["changed"]["window"]["items_in_window"] > 0, run


def test_sglang_parameters_are_the_training_storage(run):
    """While SGLang started, the trainer allocated only the shards' rebuilt buffers (the views are its weights;
    a copy would allocate the model again), and nothing but the jobs crossed after start-up."""
    slack = W.WEIGHTS_TOL * 2**20
    assert run["engine_alloc"] <= run["buffer_bytes"] + slack, run
    assert run["buffer_bytes"] < run["param_bytes"], run  # some parameters are views: their bytes are not allocated
    assert "WeightHandles" not in run["sent_before_mutation"] and "ModuleHandles" not in run["sent_before_mutation"]


def test_greedy_tokens_are_the_embedded_engines_and_follow_weight_changes(run):
    """SGLang's greedy samples equal the embedded engine's on the same prompts and weights (a sample may part at
    a bf16 tie: SGLang's top two within TIE, the embedded engine's choice second), before and after an in-place
    weight change that SGLang sees with nothing sent; log-probs agree on the common tokens."""
    for name in ("first", "changed"):
        v = run[name]["vs_embedded"]
        assert v["samples"] == 2 * W.REQUESTS and not v["breaks"] and v["lp_rel"] <= LOGP_TOL, (name, v)
        assert v["agreed"] >= v["samples"] * W.NEW_TOKENS // 4, (name, v)  # a tie is rare: most tokens come first
    assert run["changed"]["tokens"] != run["first"]["tokens"]  # the change mattered to greedy decoding


def test_mutation_sglang_on_copied_weights_is_caught(run):
    """Mutation: SGLang's parameters bound to copies (its own weight update, the project's loader). The next
    in-place change stays in the trainer: SGLang decodes as before it, and the comparison above fails."""
    v = run["copied"]["vs_embedded"]
    assert run["copied"]["tokens"] == run["changed"]["tokens"], v
    assert v["breaks"], v
