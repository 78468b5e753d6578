"""Skip markers shared by the CuTe DSL tests (the `cute` extra; CI installs it with `test`)."""

import pytest

from torch_msa import UnavailableError


def cute_dsl_available() -> bool:
    from torch_msa.cute_dsl import require_cute_dsl

    try:
        require_cute_dsl()
    except UnavailableError:
        return False
    return True


requires_cute = pytest.mark.skipif(
    not cute_dsl_available(), reason="nvidia-cutlass-dsl==4.6.2 / cuda-bindings not installed (extra `cute`)"
)
