"""Rollplex for verl (0.9.x engine API): the `rollplex` engine vendor and the `rollplex` v1 trainer.

`plugin` is the module verl imports through the `verl.plugins` entry point; `engine` and `batch` hold the
engine and verl's batch layout; `trainer` the trainer. Nothing here is imported unless verl is installed.
"""
