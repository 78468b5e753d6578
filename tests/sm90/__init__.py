"""Tests of the SM90 CuTe DSL backend (`torch_msa/sm90`)."""
