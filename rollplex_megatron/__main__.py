"""`python -m rollplex_megatron <command>` and the `rollplex` script: the command line (rollplex_megatron/cli)."""
import sys

from rollplex_megatron.compat import quiet_known_warnings

quiet_known_warnings()  # before the CLI imports megatron-core, whose import prints them

from rollplex_megatron.cli import main  # noqa: E402  (after the warning filters, on purpose)

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
