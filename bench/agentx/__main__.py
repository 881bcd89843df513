"""`python -m bench.agentx`: see bench/agentx/run.py."""

import sys

from bench.agentx.run import main

sys.exit(main())
