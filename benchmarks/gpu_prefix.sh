#!/usr/bin/env bash
# GPU machine: prefix/response execution vs full sequences on Qwen2.5-VL-3B shapes (4 LLM layers,
# the full 32-block vision tower or VISION_DEPTH blocks), bf16, one group: prompt 4096 tokens (448x448-patch image -> 1024
# tokens, 16-frame 448x448 video -> 2048 tokens, 1020 text tokens), G=8 responses of 256 tokens,
# 2 responses per micro-batch. Checks the bf16 tolerances of docs/design.md §3, times both paths (median of the
# repeats after the first) and records the analytic FLOPs. Writes $OUT/prefix_vs_full_3b_bf16_<backend>[_vision<depth>].json.
set -euo pipefail
source benchmarks/gpu_env.sh
backend=${BACKEND:-auto}
depth=${VISION_DEPTH:-32}  # vision blocks; below 32 the last block is the one full-attention block
suffix=""
vision=()
if [ "$depth" != 32 ]; then
  suffix="_vision$depth"
  vision=(model.vision.depth=$depth "model.vision.fullatt_block_indexes=[$((depth - 1))]")
fi
args=(model=qwen2_5_vl_3b model.num_layers=4 "${vision[@]}" dtype=bfloat16 rollout.group_size=8 rollout.max_response_len=256
      verify.groups_per_rank=1 verify.min_response_len=256 verify.max_response_len=256
      verify.responses_per_micro_batch=2 "verify.image_grid=[1,64,64]" "verify.video_grid=[8,32,32]"
      verify.text_tokens=1020 verify.advantage_mean=1.0 verify.repeats=${REPEATS:-3}
      verify.attention_backend=$backend verify.noise_floor=true verify.fp32_reference=true)
set +e
python3 -m rollplex_megatron verify-equivalence "${args[@]}" --json > /tmp/prefix.log 2> /tmp/prefix.err
rc=$?
set -e
tail -2 /tmp/prefix.log | head -1
[ -s /tmp/prefix.log ] || { tail -40 /tmp/prefix.err; exit 1; }
python3 - "$out/prefix_vs_full_3b_bf16_${backend}${suffix}.json" "python -m rollplex_megatron verify-equivalence ${args[*]} --json" "$rc" <<'PY'
import json, sys
from rollplex_megatron.runtime import environment_record
res = json.loads(open("/tmp/prefix.log").read().strip().splitlines()[-1])
t = res["times_s"]; f = res["flops_local_batch"]
res["measured_speedup_full_over_prefix"] = t["full_fwd_bwd_s"] / t["prefix_fwd_bwd_s"]
res["flop_ratio_full_over_prefix"] = f["flop_ratio_full_over_prefix"]
res["achieved_tflops"] = {"full": f["full_fwd_bwd_flops"] / t["full_fwd_bwd_s"] / 1e12,
                          "prefix": f["prefix_fwd_bwd_flops"] / t["prefix_fwd_bwd_s"] / 1e12}
res["command"] = sys.argv[2]; res["exit_status"] = int(sys.argv[3]); res["environment"] = environment_record()
json.dump(res, open(sys.argv[1], "w"), indent=2)
print(json.dumps({k: res[k] for k in ("ok", "max_rel_err_logp", "max_rel_err_loss", "max_rel_err_grad",
      "max_rel_err_ref_logp", "times_s", "measured_speedup_full_over_prefix", "flop_ratio_full_over_prefix",
      "achieved_tflops", "peak_mem_bytes", "attention_backend", "rel_err_grad_global_local", "top_grad_errs_local", "serial_noise_floor_local", "grad_rule", "max_grad_excess_over_serial", "fp32_reference_local")}, indent=1))
PY
