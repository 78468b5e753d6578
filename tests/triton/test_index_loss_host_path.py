"""The host work of the index loss from a given teacher (`torch_msa/index_loss/sparse.py`, what the
SM90 backward runs after its kernel), counted on CPU with the Triton kernels replaced by counters:
each ATen call and each launch costs host time in an eager step."""

import pytest
import torch

from tests.support import install
from tests.support.documents import documents_of
from tests.support.host_calls import CountOps, KernelLaunches
from torch_msa import testing
from torch_msa.plan.schedule import build_schedule, entries_per_item, pack

pytest.importorskip("triton", reason=install.TRITON)

# Views launch nothing.
VIEWS = {"aten.slice.Tensor", "aten.view.default", "aten.split_with_sizes.default", "aten.unbind.int",
         "aten.select.int", "aten.unsqueeze.default", "aten.expand.default", "aten.alias.default"}


def test_the_loss_from_a_teacher_is_five_launches_and_few_aten_calls(monkeypatch):
    from torch_msa.index_loss import sparse
    from torch_msa.plan import kernels as plan_kernels

    launches = KernelLaunches(monkeypatch)
    item_kernels = ("msa_plan_item_counts_kernel", "msa_plan_item_tables_kernel")
    kernels = ("msa_kl_fwd_from_teacher_kernel", "msa_kl_finish_kernel", "msa_kl_bwd_kernel")
    launches.replace(plan_kernels, *item_kernels)
    launches.replace(sparse, *kernels)
    tokens, index_heads, topk, block_size, index_dim = 300, 4, 16, 64, 64
    cu_q, cu_k = testing.cu_seqlens([tokens])
    block_indices = testing.random_block_indices(cu_q, cu_k, index_heads, topk, block_size)
    documents = documents_of(cu_q, cu_k)
    plan = pack(build_schedule(block_indices, documents, tokens, block_size, entries_per_item(64, index_heads)))
    teacher = torch.rand(tokens, index_heads, topk, block_size)
    index_q = torch.randn(tokens, index_heads, index_dim, dtype=torch.bfloat16)
    index_k = torch.randn(tokens, 1, index_dim, dtype=torch.bfloat16)
    arguments = (teacher, torch.ones(()), index_q, index_k, block_indices, documents, block_size, 0.1, plan)
    sparse.index_loss_from_teacher(*arguments)  # the launch memo's first choice
    launches.names.clear()
    with CountOps() as counted:
        loss, d_index_q, d_index_k = sparse.index_loss_from_teacher(*arguments)
    assert launches.names == [*item_kernels, *kernels]
    assert (d_index_q.dtype, d_index_k.dtype, d_index_q.shape, d_index_k.shape) == (
        torch.bfloat16, torch.bfloat16, index_q.shape, index_k.shape)
    # Two zero fills (the partials share the query gradient's), four allocations, the loss's sum,
    # the gradients' casts: the loss's items, the combined partials, the mean's scale and the
    # gradient's coefficient come from kernels, not from ATen calls.
    work = [str(call) for call in counted.calls if str(call) not in VIEWS]
    assert sorted(work) == sorted(["aten.zeros.default"] * 2 + ["aten.empty.memory_format"] * 4
                                  + ["aten.sum.default"] + ["aten._to_copy.default"] * 2), sorted(work)
    assert not {"aten.logsumexp.default", "aten.log2.default", "aten.where.self"} & set(work), sorted(work)
