#!/usr/bin/env bash
# GPU machine: rollout.engine=sglang with SGLang itself (0.5.17: the release that pins the machine's torch 2.11).
# 1. unpacks the carried SGLang site into /tmp/site, first on PYTHONPATH (it carries transformers 5.12.1, which
#    SGLang 0.5.17 needs and must shadow the machine's);
# 2. a first-start probe without this project's hooks: make-example's tiny Qwen2.5-VL with dummy weights and the
#    SGLang settings the adapter uses (memory saver, deterministic inference), one request, a KV release and
#    resume. A failure here is SGLang's own (or the carried site's), not the bridge's, and the test is not run;
# 3. tests/test_gpu_sglang_real.py through gpu_tests (its JSON: the command, verdicts and environment).
# Writes $OUT/sglang_env.txt, $OUT/sglang_probe.json (stage reached, timings, the exact error), sglang_probe.log
# (SGLang's own output), gpu_sglang_real_tests.txt and .json. About 9 minutes at most (each step has a timeout).
#
# What to carry (the device tool's `carry`; both folders git-ignored through .git/info/exclude):
#   .sgl/  build_carry.sh .sgl   -- the script of the shared SGLang helper folder: SGLang 0.5.17 and the packages
#          it imports that the machine lacks, slimmed to .sgl/site.tar.xz (about 45 MiB of the 64 MiB a call carries)
#   .whl/  the device wheels (fetch_wheels.sh) plus SGLang's memory saver, which the site leaves out and the adapter
#          needs (enable_memory_saver); its wheel holds a CUDA 13 build:
#          python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#            --platform manylinux2014_x86_64 -d .whl torch-memory-saver==0.0.10
# Run from the repo root on the device:  bash benchmarks/gpu_sglang_real.sh
set -uo pipefail
source benchmarks/gpu_env.sh
export TVM_FFI_CACHE_DIR=/tmp/jit  # SGLang's kernels compiled at first use (nvcc), kept for the second start
[ -f .sgl/site.tar.xz ] || { echo "no .sgl/site.tar.xz: build and carry it (see this file's header)" \
  | tee "$out/sglang_probe.log"; exit 1; }
t0=$SECONDS
tar -xJf .sgl/site.tar.xz -C /tmp/site 2>/dev/null \
  || python3 -c "import tarfile; tarfile.open('.sgl/site.tar.xz').extractall('/tmp/site')" \
  || { echo "unpacking .sgl/site.tar.xz failed" | tee "$out/sglang_probe.log"; exit 1; }
echo "site unpacked in $((SECONDS - t0)) s"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -W ignore -c "import sys, torch, transformers; print(sys.version.split()[0], 'torch', torch.__version__, \
'transformers', transformers.__version__)"
  python3 -W ignore -c "import torch_memory_saver; print('torch_memory_saver', torch_memory_saver.__file__)"
  python3 -W ignore -c "import megatron.core; print('megatron.core', megatron.core.__version__)"
} > "$out/sglang_env.txt" 2>&1
cat "$out/sglang_env.txt"
rm -rf /tmp/sgl_example
python3 -m rollplex_megatron make-example /tmp/sgl_example --train-rows 8 --val-rows 2 > "$out/make_example.log" 2>&1 \
  || { tail -5 "$out/make_example.log"; exit 1; }
cat > /tmp/sglang_probe.py <<'PY'
"""First start of SGLang on this machine, without the rollplex hooks: writes $OUT/sglang_probe.json."""
import json, os, sys, time, traceback


def main():
    t0, rec = time.time(), {"stage": "import sglang", "model": sys.argv[1]}
    try:
        import sglang
        rec.update(version=sglang.__version__, import_s=round(time.time() - t0, 1), stage="engine start")
        eng = sglang.Engine(model_path=sys.argv[1], load_format="dummy", dtype="bfloat16", mem_fraction_static=0.3,
                            attention_backend="triton", mm_attention_backend="sdpa", sampling_backend="pytorch",
                            disable_cuda_graph=True, enable_memory_saver=True, enable_deterministic_inference=True,
                            log_level="warning")
        rec.update(start_s=round(time.time() - t0, 1), stage="generate")
        out = eng.generate(input_ids=[[1, 5, 6, 7, 2, 1]], return_logprob=True, sampling_params=[
            {"max_new_tokens": 8, "temperature": 1.0, "top_k": 1, "ignore_eos": True, "sampling_seed": 7}])
        rec.update(output_ids=out[0].get("output_ids"), meta_keys=sorted(out[0]["meta_info"]),
                   stage="release and resume the KV cache")
        eng.release_memory_occupation(tags=["kv_cache", "cuda_graph"])
        eng.resume_memory_occupation(tags=["kv_cache", "cuda_graph"])
        rec["stage"] = "shutdown"
        eng.shutdown()
        rec["stage"] = "done"
    except BaseException:
        rec["error"] = traceback.format_exc()[-4000:]
    rec["wall_s"] = round(time.time() - t0, 1)
    json.dump(rec, open(os.path.join(os.environ.get("OUT", "."), "sglang_probe.json"), "w"), indent=1)
    print(json.dumps({k: v for k, v in rec.items() if k != "error"}))
    print(rec.get("error", ""))
    sys.exit(0 if rec["stage"] == "done" else 1)


if __name__ == "__main__":
    main()
PY
OUT=$out timeout -k 10 200 python3 /tmp/sglang_probe.py /tmp/sgl_example/model > "$out/sglang_probe.log" 2>&1
rc=$?
tail -25 "$out/sglang_probe.log"
if [ $rc -ne 0 ]; then
  echo "SGLang's own first start failed (rc=$rc; 124: the 200 s timeout): see $out/sglang_probe.json and .log;" \
    "the bridge's test was not run"
  exit 1
fi
export out
export -f gpu_tests
timeout -k 10 300 bash -c 'gpu_tests tests/test_gpu_sglang_real.py gpu_sglang_real_tests.txt'
rc=$?
[ $rc -eq 124 ] && echo "the test ran past 300 s; its output so far is in $out/gpu_sglang_real_tests.txt" \
  | tee -a "$out/gpu_sglang_real_tests.txt"
echo "total $((SECONDS - t0)) s"
