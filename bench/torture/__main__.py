"""`python -m bench.torture`: see bench/torture/main.py."""

import sys

from bench.torture.main import main

if __name__ == "__main__":
    sys.exit(main())
