"""`python -m daemon.cli …`: the service unit and the scripts start the daemon this way."""

import sys

from daemon.cli import main

sys.exit(main())
