"""`python -m pgcarve.cli`: the same as the `pgcarve` command."""

import sys

from pgcarve.cli.main import main

sys.exit(main())
