"""GPU machine, two GPUs: rollout weights on the training storage for the 3B preset (bf16).

Run under torchrun with 2 processes, e.g.
  torchrun --standalone --nproc_per_node 2 benchmarks/gpu_weights.py OUT_JSON
For (t, r) in {(2, 1), (2, 1) with split GEMMs, (1, 2)}: build the training model at TP=t, switch megatron's groups to
TP=r, build the rollout model, bind it with SharedRolloutWeights, and record the plan's bytes,
the measured allocator bytes (a full rollout copy vs the bound rollout side), the refresh time
after an in-place weight update (median of 5), and whether rollout logits stay finite.
"""
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist


def run(t, r, cfg, split_gemm=False):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from rollplex_megatron.models.qwen25vl import build_model, gather_vocab_logits
    from rollplex_megatron.verify.parity import position_ids_for, sample_inputs
    from rollplex_megatron.dist import parallel_orders
    from rollplex_megatron.weights.plan import plan_weights
    from rollplex_megatron.weights.share import SharedRolloutWeights

    import gc

    gc.collect()  # free the previous configuration's models before any memory reading
    torch.cuda.empty_cache()
    t_order, r_order = parallel_orders(t, r)
    ps.initialize_model_parallel(tensor_model_parallel_size=t, order=t_order)
    model_parallel_cuda_manual_seed(1)
    train = build_model(cfg, "bfloat16")
    group = ps.get_tensor_model_parallel_group()
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=r, order=r_order)
    model_parallel_cuda_manual_seed(2)
    torch.cuda.synchronize()
    m0 = torch.cuda.memory_allocated()
    rollout = build_model(cfg, "bfloat16")
    torch.cuda.synchronize()
    m1 = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    shared = SharedRolloutWeights(train, rollout, cfg, t, r, group, gpu=dist.get_rank(), split_gemm=split_gemm)
    torch.cuda.synchronize()
    bind_s = time.perf_counter() - t0
    gc.collect()
    torch.cuda.synchronize()
    m2 = torch.cuda.memory_allocated()
    times = []
    for _ in range(6):
        with torch.no_grad():
            for p in train.parameters():
                p.mul_(0.999)  # stand-in for an optimizer step: every training weight changes in place
        times.append(shared.refresh())
    # The side-stream rebuild (non-blocking, then wait) must equal a rebuild on the current stream.
    with torch.no_grad():
        for p in train.parameters():
            p.mul_(1.001)
    shared.refresh(blocking=False)
    shared.wait()
    owned = {**{p.name: shared.roll[p.name].data for p in shared.plan
                if p.klass in ("local_permute", "gather") and p.name not in shared.remote}, **shared.remote}
    snap = {n: v.clone() for n, v in owned.items()}
    shared._rebuild()
    torch.cuda.synchronize()
    consistent = all(torch.equal(snap[n], owned[n]) for n in snap)
    x = sample_inputs(cfg, seed=0)
    with torch.no_grad():
        out = rollout(input_ids=x["input_ids"].cuda(), position_ids=position_ids_for(cfg, x).cuda(),
                      pixel_values=x["pixel_values"].cuda(), image_grid_thw=x["image_grid_thw"],
                      pixel_values_videos=x["pixel_values_videos"].cuda(), video_grid_thw=x["video_grid_thw"])
        finite = bool(torch.isfinite(gather_vocab_logits(out, cfg.vocab_size)).all())
    s = plan_weights(cfg, t, r).summary()
    res = {"train_tp": t, "rollout_tp": r, "split_gemm": split_gemm, "rank": dist.get_rank(),
           "plan_full_copy_bytes_worst_gpu": s["full_copy_bytes"],
           "plan_allocated_bytes_worst_gpu": s["allocated_bytes"],
           "plan_allocated_bytes_split_gemm_worst_gpu": s["allocated_bytes_split_gemm"],
           "plan_per_gpu": s["per_gpu"], "plan_saved_fraction": s["saved_fraction"],
           "measured_full_rollout_copy_bytes": m1 - m0, "measured_bound_rollout_bytes": m2 - m0,
           "plan_allocated_bytes_this_gpu": shared.allocated_bytes(),
           "bind_s": bind_s, "refresh_s_median": statistics.median(times[1:]), "refresh_s_all": times,
           "logits_finite": finite, "side_stream_consistent": consistent,
           "classes_this_gpu": sorted({p.klass for p in shared.plan})}
    ps.destroy_model_parallel()
    del train, rollout, shared
    torch.cuda.empty_cache()
    return res


def main():
    from rollplex_megatron.dist import init_parallel
    from rollplex_megatron.recipes import load_run_config
    from rollplex_megatron.runtime import environment_record

    init_parallel(1, 1)
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    cfg = load_run_config(["model=qwen2_5_vl_3b"]).model
    results = []
    for t, r, split in ((2, 1, False), (2, 1, True), (1, 2, False)):
        mine = run(t, r, cfg, split)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        results.append(every)
    if dist.get_rank() == 0:
        out = {"command": "torchrun --standalone --nproc_per_node 2 benchmarks/gpu_weights.py", "model": cfg.name,
               "dtype": "bfloat16", "results": results, "environment": environment_record()}
        json.dump(out, open(sys.argv[1], "w"), indent=2)
        for every in results:
            for x in every:
                print({k: x[k] for k in ("train_tp", "rollout_tp", "split_gemm", "rank",
                                         "plan_full_copy_bytes_worst_gpu",
                                         "plan_allocated_bytes_this_gpu", "measured_full_rollout_copy_bytes",
                                         "measured_bound_rollout_bytes", "refresh_s_median", "logits_finite",
                                         "side_stream_consistent")})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
