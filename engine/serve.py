"""`python -m engine.serve`, kept working beside the `pagoda-serve` command: both run entrypoints/cli.py."""

import sys

from entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
