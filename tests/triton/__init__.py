"""Tests of the Triton backend (`torch_msa/triton`)."""
