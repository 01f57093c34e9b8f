"""`python -m bench.recovery`: see bench/recovery/main.py."""

import sys

from bench.recovery.main import main

if __name__ == "__main__":
    sys.exit(main())
