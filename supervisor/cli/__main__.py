"""`python -m supervisor.cli` runs supervisorctl (the demo and the tests call it so)."""

import sys

from supervisor.cli.main import main

sys.exit(main())
