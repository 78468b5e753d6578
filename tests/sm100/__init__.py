"""Tests of the SM100 backend (`torch_msa/sm100`)."""
