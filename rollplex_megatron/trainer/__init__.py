"""The synchronous GRPO trainer (docs/design.md §2).

loop.py     train_rank and run_step: one line per phase, the mode decides how each runs
modes/      the execution modes (serial | prefix_shared | rollplex), a registry of strategies
runtime.py  what every mode uses: models, optimizer, engine, data source, memory manager, loss
metrics.py  phase timing and the step's metrics record
"""
