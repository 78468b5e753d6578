"""Test support shared by the test packages: oracles, skip marks, sample matrices and scripts."""
