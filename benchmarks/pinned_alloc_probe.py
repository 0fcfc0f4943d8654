"""GPU machine: what the first offload of a class costs. Times allocating pinned host buffers of the
sizes the 3B phase plan offloads (main weights 15.0 GB, Adam states 30.0 GB, as in
bench_video_long_c1fc225.json's offload bytes) and the device-to-host copy into them, first and second time.
Writes $OUT/pinned_alloc_probe.json."""
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from rollplex_megatron.runtime import environment_record  # noqa: E402

out = {}
dev = torch.empty(int(7.5e9), dtype=torch.uint8, device="cuda")  # one 7.5 GB device buffer, copied repeatedly
for name, gb in (("main_weights", 15.0), ("optimizer_states", 30.0)):
    n = int(gb / 7.5)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    host = [torch.empty(int(7.5e9), dtype=torch.uint8, pin_memory=True) for _ in range(n)]
    t1 = time.perf_counter()
    for h in host:
        h.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    for h in host:
        h.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    out[name] = {"gb": gb, "pinned_alloc_s": t1 - t0, "first_d2h_s": t2 - t1, "second_d2h_s": t3 - t2}
    print(name, out[name], flush=True)
out.update(environment_record(), command="python benchmarks/pinned_alloc_probe.py")
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "pinned_alloc_probe.json"), "w"), indent=1)
