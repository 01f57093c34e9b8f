"""`python -m bench.engine`: see bench/engine/main.py."""

import sys

from bench.engine.main import main

if __name__ == "__main__":
    sys.exit(main())
