"""torch.library.opcheck over the sample matrix of `tests/support/opcheck_samples.py` (schema,
autograd registration, fake tensors, AOT dispatch with dynamic shapes)."""

import pytest
import torch

from tests.support.opcheck_samples import run, samples

MATRIX = samples("cpu")


@pytest.mark.parametrize("sample", MATRIX, ids=[s.name for s in MATRIX])
def test_opcheck(sample):
    run(sample)


def test_matrix_covers_every_op_with_and_without_grad():
    seen = {(s.op, any(getattr(a, "requires_grad", False) for a in s.args)) for s in MATRIX}
    float_ops = ("select_blocks", "forward", "backward", "indexer_kl", "indexer_kl_backward", "forward_with_index_loss",
                 "backward_with_index_loss")
    assert seen == {(op, grad) for op in float_ops for grad in (False, True)} | {("plan", False)}


def test_matrix_passes_plans_to_forward_and_backward():
    with_plan = {s.op for s in MATRIX if s.op in ("forward", "backward")
                 and isinstance(s.args[-1], torch.Tensor) and s.args[-1].dtype == torch.int32}
    assert with_plan == {"forward", "backward"}


def test_double_backward_raises_clearly():
    sample = next(s for s in MATRIX if s.op == "backward" and s.args[1].requires_grad)
    dq, dk, dv = sample.overload(*sample.args)
    with pytest.raises(NotImplementedError, match="double backward"):
        (dq.float().sum() + dk.float().sum()).backward()
