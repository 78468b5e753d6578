"""What the CuTe DSL tests share: the skip marker (the `cute` extra; CI installs it with `test`),
the launch-type check and the import-hygiene check."""

import subprocess
import sys

import pytest
import torch

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
