"""`python -m orchestrator.cli ...` is `undying ...` (for environments without the console script)."""

import sys

from orchestrator.cli.main import main

sys.exit(main())
