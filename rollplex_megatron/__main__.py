"""`python -m rollplex_megatron <command>`: the command line (rollplex_megatron/cli)."""
import sys

from rollplex_megatron.cli import main

if __name__ == "__main__":
    sys.exit(main())
