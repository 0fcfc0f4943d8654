"""Worker functions run in local processes by the parallel tests (importable for spawn)."""
from __future__ import annotations

from functools import partial

import torch


def fwd_bwd(hf_dir: str, tp: int, pp: int, seed: int = 5) -> dict:
    """Load `hf_dir` at (tp, pp), run 2 micro-batches through megatron's schedule (fwd+bwd).

    Returns this rank's coordinates, the summed loss (last stage) and its gradients (local names).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

    from rollplex_megatron.models.qwen25vl.hf import HFCheckpoint, load_hf_into_model
    from rollplex_megatron.dist import init_parallel
    from rollplex_megatron.models.qwen25vl import build_model
    from rollplex_megatron.verify.parity import position_ids_for, synthetic_inputs
    from rollplex_megatron.verify.smoke import _forward_step

    init_parallel(tp=tp, pp=pp)
    ckpt = HFCheckpoint(hf_dir)
    cfg = ckpt.model_config()
    model = build_model(cfg, "float32")
    load_hf_into_model(model, ckpt, cfg, ps.get_tensor_model_parallel_rank(), tp,
                       ps.get_pipeline_model_parallel_rank(), pp)
    batches = []
    for i in range(2):
        b = synthetic_inputs(cfg, seed + i, 2, (1, 4, 6), (2, 4, 4), 9)
        b["position_ids"] = position_ids_for(cfg, b)
        b["labels"] = torch.roll(b["input_ids"], -1, dims=1)
        batches.append(b)
    fb = get_forward_backward_func()
    res = fb(forward_step_func=partial(_forward_step, batches), data_iterator=iter(range(2)), model=[model],
             num_microbatches=2, seq_length=batches[0]["input_ids"].shape[1], micro_batch_size=2,
             forward_only=False)
    loss = sum(r["lm loss"][0].item() for r in res) if res else None
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    return {"tp_rank": ps.get_tensor_model_parallel_rank(), "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "loss": loss, "grads": grads, "no_grad": missing}


def hf_named_grads(results: list[dict], hf_dir: str, tp: int, pp: int) -> dict[str, torch.Tensor]:
    """Reassemble per-rank gradients into HF names and shapes with the checkpoint export layout."""
    from rollplex_megatron.models.qwen25vl.hf import HFCheckpoint, export_hf_tensors

    ckpt = HFCheckpoint(hf_dir)
    states = [[None] * tp for _ in range(pp)]
    for r in results:
        states[r["pp_rank"]][r["tp_rank"]] = r["grads"]
    return dict(export_hf_tensors(states, ckpt.model_config(), tp, pp, ckpt.naming))
