"""Tests of the benchmark (`benchmarks/`, run from a checkout as `python -m benchmarks`)."""
