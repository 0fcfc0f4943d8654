"""disaggregated: the paper's other baseline; the rollout decodes on ranks of its own (its own full
weights, `parallel.rollout_ranks`), the training ranks run serial's phases, and the new weights are sent
to the rollout ranks after each step's optimizer steps (`weight_transfer`, rollout/disaggregated.py)."""
from __future__ import annotations

from rollplex_megatron.trainer.modes.serial import Serial


class Disaggregated(Serial):
    """serial's phases on the training ranks; rollout on the rollout ranks; weights sent after the update."""

    name = "disaggregated"
    phases = ("rollout", "old_logp", "ref_logp", "update", "optimizer", "weight_transfer")
