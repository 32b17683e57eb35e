"""`python -m pgcarve_api`: run the API server (see server.py)."""

import sys

from pgcarve_api.server import main

sys.exit(main())
