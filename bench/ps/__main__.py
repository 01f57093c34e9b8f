import sys

from bench.ps.main import main

sys.exit(main())
