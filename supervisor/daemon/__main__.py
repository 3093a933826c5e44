"""`python -m supervisor.daemon` runs train-supervisord (the demo and the tests start it so)."""

import sys
import time

from supervisor.daemon.main import main

time.tzset()
sys.exit(main())
