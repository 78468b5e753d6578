"""Helpers the Triton kernel modules share: `common.py` and `launch.py`."""
