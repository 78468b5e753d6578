"""Tests of context parallelism (`torch_msa/distributed.py`)."""
