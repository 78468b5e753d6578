"""torch.library.opcheck over the sample matrix in opcheck/ (schema, autograd registration,
fake tensors, AOT dispatch with dynamic shapes)."""

import pytest

from opcheck.matrix import run, samples
from torch_msa import backends

MATRIX = samples("cpu")


@pytest.mark.parametrize("sample", MATRIX, ids=[s.name for s in MATRIX])
def test_opcheck(sample):
    run(sample)


def test_matrix_covers_every_op_with_and_without_grad():
    seen = {(s.op, any(getattr(a, "requires_grad", False) for a in s.args)) for s in MATRIX}
    assert seen == {(op, grad) for op in backends.OPS for grad in (False, True)}


def test_double_backward_raises_clearly():
    sample = next(s for s in MATRIX if s.op == "backward" and s.args[1].requires_grad)
    dq, dk, dv = sample.overload(*sample.args)
    with pytest.raises(NotImplementedError, match="double backward"):
        (dq.float().sum() + dk.float().sum()).backward()
