import sys

from bench.data.main import main

sys.exit(main())
