"""What the CuTe DSL tests share: the skip marker (the `cute` extra; CI installs it with `test`),
the nvdisasm check of the SASS listings, the warning filter of the compile tests, the launch-type
check and the import-hygiene check."""

import contextlib
import subprocess
import sys
import warnings

import pytest
import torch

from torch_msa import UnavailableError
from torch_msa.cute_dsl import CUTE_DSL_REQUIREMENT


def cute_dsl_available() -> bool:
    from torch_msa.cute_dsl import require_cute_dsl

    try:
        require_cute_dsl()
    except UnavailableError:
        return False
    return True


requires_cute = pytest.mark.skipif(
    not cute_dsl_available(), reason=f"{CUTE_DSL_REQUIREMENT} / cuda-bindings not installed (extra `cute`)"
)

SASS_INSTALL_HINT = 'pip install "nvidia-cutlass-dsl-libs-base[sass]"'
"""What brings nvdisasm from CuTe DSL 4.8 on (the `test` extra installs it); earlier releases depend on it."""


def skip_without_nvdisasm() -> None:
    """Skip the calling test or fixture, naming `SASS_INSTALL_HINT`, when the CuTe DSL finds no
    nvdisasm: a compile that keeps its listings writes the SASS with it and fails without it.

    The question goes to the DSL's own lookup (`cutlass.base_dsl.env_manager._find_nvdisasm_binary`,
    in every served release), so the answer is the one the compile will get."""
    from cutlass.base_dsl.common import DSLUserCodeError
    from cutlass.base_dsl.env_manager import _find_nvdisasm_binary

    try:
        _find_nvdisasm_binary()
    except DSLUserCodeError:
        pytest.skip(f"the SASS listings need nvdisasm, which the CuTe DSL cannot find; install it with: {SASS_INSTALL_HINT}")


@contextlib.contextmanager
def deprecated_dsl_use_is_an_error():
    """Within the block, a DeprecationWarning attributed to a torch_msa module raises: what a
    deprecated CuTe DSL name warns where torch_msa's code uses it, which users would otherwise see
    at every first compile."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", category=DeprecationWarning, module=r"torch_msa\.")
        yield


def assert_launch_types_match(operands) -> None:
    """Each `(name, dtype, inner shape)` operand converted at launch (`cute_rows`) has the type the
    kernel was compiled for (`fake_rows`): nothing checks this at launch, so a mismatch would read
    memory with the wrong layout."""
    from cutlass._mlir import ir

    from torch_msa.cute_dsl.cute_io import cute_rows, fake_rows

    with ir.Context(), ir.Location.unknown():
        for name, dtype, inner in operands:
            for rows in (1, 37):
                got = str(cute_rows(torch.zeros(rows, *inner, dtype=dtype)).__get_mlir_types__()[0])
                want = str(fake_rows(dtype, inner).__get_mlir_types__()[0])
                # Host tensors report the generic memory space; the layout is what must agree.
                assert got.replace("generic", "gmem") == want, (name, rows)


def assert_imports_without(statements: str, forbidden: tuple[str, ...]) -> None:
    """`statements` run in a fresh interpreter import none of the `forbidden` modules."""
    checks = "".join(f"assert {name!r} not in sys.modules, 'the import loaded {name}'\n" for name in forbidden)
    code = f"import sys\n{statements}\n{checks}print('ok')\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
