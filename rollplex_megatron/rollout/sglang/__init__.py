"""SGLang as the rollout engine, with the decode window inside SGLang's scheduler (docs/design.md §2).

- `plugin.py`: the `sglang.srt.plugins` entry point; AROUND hooks on `Scheduler.run_batch` and
  `Scheduler.on_idle` that drive the bridge (`install_direct` for releases without plugins, through
  `patches/sglang/`).
- `bridge.py`: the scheduler process's end: prefix jobs run on the trainer's modules (aliased weights),
  inside SGLang's decode loop, through the same `DecodeWindow` the embedded engine uses.
- `client.py`: the trainer's end; `protocol.py`: the messages and the link with timeouts.
- `engine.py`: the `RolloutEngine` adapter over `sglang.Engine`; `weights.py`: Megatron shards as
  SGLang's parameters (aliases where the layouts agree) and the custom weight loader.
- `source.py`: the checks of all of the above against SGLang's source (the releases we support).
Nothing in this package imports SGLang at import time.
"""
