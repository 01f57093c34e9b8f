"""`python -m bench.gpu_check`: see bench/gpu_check/main.py."""

import sys

from bench.gpu_check.main import main

if __name__ == "__main__":
    sys.exit(main())
