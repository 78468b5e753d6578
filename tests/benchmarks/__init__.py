"""Tests of the benchmark (`torch_msa/bench`)."""
