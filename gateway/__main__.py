"""`python -m gateway` runs the command line."""

import sys

from gateway.cli.main import main

sys.exit(main())
