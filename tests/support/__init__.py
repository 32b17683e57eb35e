"""Fixtures and doubles shared by more than one test module (and by the benchmarks in bench/)."""
