"""`python -m bench`: run the benchmarks (see bench/README.md)."""

import sys

from bench.harness_all import main

sys.exit(main())
