"""`python -m bench.release`: see bench/release/main.py."""

import sys

from bench.release.main import main

if __name__ == "__main__":
    sys.exit(main())
