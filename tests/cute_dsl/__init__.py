"""Tests of the architecture-neutral CuTe DSL kernels (`torch_msa/cute_dsl`)."""
