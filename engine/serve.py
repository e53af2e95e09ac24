"""`python -m engine.serve`, as documented: the headless OpenAI-compatible server, which lives in
entrypoints/cli.py (the engine itself has no web framework)."""
import sys

from entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
