"""Triton stages the Triton and SM90 backends both run around their own kernels (`README.md`)."""
