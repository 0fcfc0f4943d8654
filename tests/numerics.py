"""The norm-relative error of docs/design.md §3 (rollplex_megatron/verify/numerics.py), by the name the tests and
their spawned workers import.

Workers import it as `tests.numerics` (as they import `tests.in_turn`), so spawn and torchrun processes find it
by the same name as pytest does.
"""
from rollplex_megatron.verify.numerics import rel_err

__all__ = ["rel_err"]
