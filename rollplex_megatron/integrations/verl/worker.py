"""verl's colocated worker with the decode window's end (`window.RefWindow`) on its reference engine.

The `rollplex` trainer puts this class in place of verl's `ActorRolloutRefWorker` when the window is on
(`ROLLPLEX_SGLANG_BRIDGE=dir:PATH`), as verl's own separate-async trainer swaps in its worker subclass. It adds
one method the trainer calls during the rollout, `rollplex_window_submit`, and opens the window when the
reference engine is built.
"""
from __future__ import annotations

from verl.single_controller.base.decorator import Dispatch, register
from verl.workers.engine_workers import ActorRolloutRefWorker

from rollplex_megatron.integrations.verl.batch import multi_modal_rows, sample_prompt
from rollplex_megatron.integrations.verl.window import RefWindow, window_dir
from rollplex_megatron.prefix import execution as X


def open_window(engine, directory) -> RefWindow:
    """The reference engine's window: its model, shape and settings as the scheduler rebuilds them."""
    megatron = dict(getattr(engine.engine_config, "override_transformer_config", {}) or {})
    engine.window = RefWindow(X.unwrap(engine.module), engine.cfg, engine.dtype, megatron, directory,
                              engine.model_path)
    return engine.window


def read_prompts(keys: dict, partition_id: str = "train") -> dict:
    """{uid: Prompt} from one stored sample per uid ({uid: TransferQueue key}), as the batch will hold them."""
    import transfer_queue as tq

    uids = list(keys)
    data = tq.kv_batch_get(keys=[keys[u] for u in uids], partition_id=partition_id,
                           select_fields=["prompts", "multi_modal_inputs"])
    return prompts_of(data, uids)


def prompts_of(data, uids: list) -> dict:
    """{uid: Prompt} of a TensorDict of stored samples, one per uid in that order (verl's layout, as the engine
    reads its batches: `prompts` per sample, `multi_modal_inputs` one dict per sample)."""
    prompts = data["prompts"]  # jagged; a plain [n, P] tensor when the samples' prompts are one length
    ids = list(prompts.unbind()) if prompts.is_nested else list(prompts.unbind(0))
    if len(ids) != len(uids):
        raise ValueError(f"rollplex verl window: {len(uids)} uids but {len(ids)} stored samples")
    return {u: sample_prompt(x, mm) for u, x, mm in zip(uids, ids, multi_modal_rows(data, len(ids)))}


class RollplexActorRolloutRefWorker(ActorRolloutRefWorker):
    """verl's hybrid worker; its reference engine's prefix stages can run in SGLang's decode window."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        super().init_model()
        directory = window_dir()
        if directory is None:
            return
        if self.ref is None:
            raise RuntimeError("rollplex verl window: this worker has no reference engine (actor_rollout_ref "
                               "without a reference, or the reference inside the actor under LoRA); unset "
                               "ROLLPLEX_SGLANG_BRIDGE")
        if not hasattr(self.ref.engine, "window"):
            raise RuntimeError("rollplex verl window: the reference engine is not the rollplex engine; set "
                               "VERL_ENGINE_VENDOR=rollplex")
        open_window(self.ref.engine, directory)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rollplex_window_submit(self, keys: dict, ranks: dict) -> int:
        """The reference prefix stage of each uid this DP rank will score ({uid: TransferQueue key of one
        finished sample}, {uid: DP rank}), sent to the scheduler on this GPU; returns how many."""
        engine = self.ref.engine
        dp = engine.get_data_parallel_rank()
        mine = {u: k for u, k in keys.items() if ranks.get(u) == dp}
        return engine.window.submit(read_prompts(mine)) if mine else 0
