import sys

from bench.preemption.main import main

sys.exit(main())
