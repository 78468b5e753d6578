"""The Triton backend's ops in the backends' form (`torch_msa.backends.Backend`): input checks, then
the kernels (`README.md`)."""

import torch

from ..index_loss import dense as index_loss_dense
from ..index_loss import sparse as index_loss_sparse
from ..index_loss import sparse_deterministic as index_loss_sparse_deterministic
from ..plan import kernels as plan_kernels
from ..query_windows import forward_in_windows
from ..stages import query_outer
from ..triton_utils.common import check_dtype_and_group
from . import backward as backward_atomic
from . import backward_deterministic, select
from . import forward as forward_kernel


def select_blocks(index_q, index_k, documents, topk, block_size):
    check_dtype_and_group("index_q", index_q.dtype)
    return select.select_blocks(index_q, index_k, documents, topk, block_size)


def plan(block_indices, documents, num_keys, block_size, entries_per_item):
    return plan_kernels.plan(block_indices, documents, num_keys, block_size, entries_per_item)


def forward(q, k, v, block_indices, documents, block_size, softmax_scale, plan=None):
    check_dtype_and_group("q", q.dtype, q.shape[1] // k.shape[1])
    block_indices, plan, window_arguments = query_outer.split_forward(q, block_indices, documents, k.shape[0],
                                                                      block_size, plan)
    return forward_in_windows(forward_kernel.forward, q, k, v, block_indices, documents, block_size, softmax_scale,
                              plan, window_arguments=window_arguments)


def backward(grad_out, q, k, v, out, lse, block_indices, documents, block_size, softmax_scale, grad_lse=None,
             plan=None):
    check_dtype_and_group("q", q.dtype, q.shape[1] // k.shape[1])
    # Decided per call, like torch's own kernels: the flag may change between steps.
    module = backward_deterministic if torch.are_deterministic_algorithms_enabled() else backward_atomic
    return module.backward(grad_out, q, k, v, out, lse, block_indices, documents, block_size, softmax_scale,
                           grad_lse, plan)


def _sparse_index_loss():
    # Decided per call, like the backward's kernels.
    deterministic = torch.are_deterministic_algorithms_enabled()
    return index_loss_sparse_deterministic if deterministic else index_loss_sparse


def indexer_kl(q, k, lse, index_q, index_k, block_indices, documents, block_size, softmax_scale, index_softmax_scale,
               plan=None):
    """`plan`: the step's plan for these arguments (sparse support), walked in place of a new one
    (in the deterministic mode, while one window holds every query)."""
    check_dtype_and_group("q", q.dtype, q.shape[1] // k.shape[1])
    check_dtype_and_group("index_q", index_q.dtype)
    if block_indices is None:
        return index_loss_dense.indexer_kl_dense(q, k, lse, index_q, index_k, documents, softmax_scale,
                                                 index_softmax_scale)
    return _sparse_index_loss().indexer_kl(q, k, lse, index_q, index_k, block_indices, documents, block_size,
                                           softmax_scale, index_softmax_scale, plan)


def indexer_kl_backward(grad_loss, index_q, index_k, index_lse, teacher_mass, teacher_index_keys,
                        teacher_index_queries, block_indices, documents, block_size, index_softmax_scale, plan=None):
    """`plan`: the step's plan for these arguments (sparse support), walked in place of a new one
    (in the deterministic mode, while one window holds every query)."""
    check_dtype_and_group("index_q", index_q.dtype)
    teacher = (index_lse, teacher_mass, teacher_index_keys, teacher_index_queries)
    if block_indices is None:
        return index_loss_dense.indexer_kl_dense_backward(grad_loss, index_q, index_k, *teacher, documents,
                                                          index_softmax_scale)
    return _sparse_index_loss().indexer_kl_backward(grad_loss, index_q, index_k, *teacher, block_indices, documents,
                                                    block_size, index_softmax_scale, plan)
