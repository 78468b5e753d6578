"""Stages the backends compose around their own kernels, in Triton: the forward's `combine.py`,
the backward's `delta.py` (before the key pass) and `dq.py` (after it), and the deterministic
backward's fixed-order reduction and query-outer dQ (`deterministic.py`). The Triton and SM90
backends both run them; none of them chooses a backend.
"""
