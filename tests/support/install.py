"""What a test that skips for a missing package says: what is missing and the command that
installs it. Under CI such a skip fails the run (`tests/conftest.py`): the `test` extra installs
every package the suite uses."""

TEST_EXTRA = 'pip install -e ".[test]"'
"""Installs everything the suite uses, from the checkout's root."""

TRITON = "triton is not installed; install it with: pip install triton (Linux x86_64 torch wheels bring it)"
MATPLOTLIB = f"matplotlib is not installed; install it with: pip install matplotlib (or {TEST_EXTRA})"
NINJA = f"ninja is not installed (torch.utils.cpp_extension builds with it); install it with: pip install ninja (or {TEST_EXTRA})"
