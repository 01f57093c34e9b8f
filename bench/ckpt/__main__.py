"""`python -m bench.ckpt`: see bench/ckpt/main.py."""

import sys

from bench.ckpt.main import main

if __name__ == "__main__":
    sys.exit(main())
