"""`python -m bench.goodput`: see bench/goodput/main.py."""

import sys

from bench.goodput.main import main

if __name__ == "__main__":
    sys.exit(main())
