"""Non-finite inputs in one document change no other document's results: the Triton forward (with
and without its query-outer part), backward (both modes) and selection kernels.

Where and how they run, and why in fp32 and fp16: `tests/support/triton_kernels.py`.
"""

import functools

import pytest
import torch

from tests.support.documents import Documents, backend_arguments
from tests.support.triton_kernels import (
    DEVICE,
    INTERPRETING,
    POISONED_DOC,
    doc_rows,
    layout,
    poison,
    require_a_device,
)
from torch_msa.plan.groups import build_query_groups, group_tokens
from torch_msa.plan.schedule import build_schedule, pack
from torch_msa.stages import query_outer
from torch_msa.triton import backward as backward_kernel
from torch_msa.triton import backward_deterministic
from torch_msa.triton import forward as forward_kernel
from torch_msa.triton import select as select_kernel

require_a_device()


# Three documents whose key ends are not block-aligned: the last block of document 0 holds the
# keys of documents 1 and 2, and document 1's only block holds keys of document 2.
POISON_LAYOUT = ([50, 40, 30], [70, 40, 30])


def _assert_other_docs_unchanged(name, got, want, rows_per_doc, exact):
    for doc, rows in enumerate(rows_per_doc):
        if doc == POISONED_DOC or not rows:
            continue
        part, clean = got[rows.start:rows.stop], want[rows.start:rows.stop]
        assert part.isfinite().all(), f"{name} of document {doc} has non-finite values"
        if exact:
            assert torch.equal(part, clean), f"{name} of document {doc} changed"
        else:  # the default backward adds with atomics: order-dependent in the last bits on a GPU
            torch.testing.assert_close(part, clean, rtol=1e-5, atol=1e-5, msg=f"{name} of document {doc} changed")


def _run_attention(x, args):
    """Forward, backward and deterministic backward of the tensors in `x`."""
    forward_args = backend_arguments("forward", x["q"], x["k"], x["v"], *args)
    out, lse = forward_kernel.forward(*forward_args)
    # Every query selects blocks 0 and 1; groups of 32 queries. The groups whose queries all see
    # block 0 alone and fill 11/16 of a tile (queries 0-31 of documents 0 and 1, document 2's 30) run it
    # query-outer; the rest (document 0's last 18 queries, 6 of which see block 1, and document 1's
    # last 8) run KV-outer.
    block_indices, documents, num_keys, block_size = forward_args[3], forward_args[4], x["k"].shape[0], args[-2]
    # The reference builds of the groups and the plan, which the interpreter runs faster.
    groups = build_query_groups(block_indices, documents, num_keys, block_size, group_tokens(x["q"].shape[1], 1))
    kv_outer = groups.kv_outer_indices
    query_outer_rows = torch.zeros(kv_outer.shape[1], dtype=torch.bool, device=kv_outer.device)
    for start, stop in ((0, 32), (50, 82), (90, 120)):
        query_outer_rows[start:stop] = True
    assert torch.equal(kv_outer[0, :, 0] < 0, query_outer_rows) and (kv_outer[..., 1] == 1).all()
    plan = pack(build_schedule(kv_outer, documents, num_keys, block_size, 16))
    work = query_outer.QueryOuter(groups, block_indices, documents, 0, block_indices.shape[1])
    query_outer_out = forward_kernel.forward(*backend_arguments("forward", x["q"], x["k"], x["v"], kv_outer,
                                                                *args[1:], plan), query_outer=work)
    backward_args = (x["grad_out"], x["q"], x["k"], x["v"], out, lse, *args, x["grad_lse"])
    grads = backward_kernel.backward(*backend_arguments("backward", *backward_args))
    deterministic = backward_deterministic.backward(*backend_arguments("backward", *backward_args))
    return {"out": out, "lse": lse, "query-outer out": query_outer_out[0], "query-outer lse": query_outer_out[1],
            **dict(zip(("dq", "dk", "dv"), grads)),
            **dict(zip(("deterministic dq", "deterministic dk", "deterministic dv"), deterministic))}


@functools.cache
def _clean_attention():
    """The clean problem of POISON_LAYOUT, its kernel arguments and results (run once for every
    poisoned input)."""
    cu_q, cu_k, num_queries, num_keys, max_q, max_k = layout(*POISON_LAYOUT)
    num_heads, num_kv_heads, dim, block_size, topk = 4, 1, 64, 64, 2
    generator = torch.Generator().manual_seed(1)
    clean = {
        "q": torch.randn(num_queries, num_heads, dim, generator=generator),
        "k": torch.randn(num_keys, num_kv_heads, dim, generator=generator),
        "v": torch.randn(num_keys, num_kv_heads, dim, generator=generator),
        "grad_out": torch.randn(num_queries, num_heads, dim, generator=generator),
        "grad_lse": torch.randn(num_queries, num_heads, generator=generator),
    }
    clean = {name: x.to(DEVICE) for name, x in clean.items()}
    # Every query reads every block it may (topk >= its visible blocks), so each tail block is read.
    block_indices = torch.arange(topk, dtype=torch.int32, device=DEVICE)
    block_indices = block_indices.expand(num_kv_heads, num_queries, topk).contiguous()
    args = (block_indices, cu_q, cu_k, max_q, max_k, block_size, dim**-0.5)
    return clean, args, doc_rows(cu_q), doc_rows(cu_k), _run_attention(clean, args)


@pytest.mark.parametrize("poisoned", ["q", "k", "v", "grad_out", "grad_lse"])
def test_a_non_finite_document_changes_no_other_document(poisoned):
    clean, args, query_rows, key_rows, want = _clean_attention()
    rows = (key_rows if poisoned in ("k", "v") else query_rows)[POISONED_DOC]
    got = _run_attention(dict(clean, **{poisoned: poison(clean[poisoned], rows)}), args)
    for name in ("out", "lse", "query-outer out", "query-outer lse"):
        _assert_other_docs_unchanged(name, got[name], want[name], query_rows, exact=True)
    for name, rows_per_doc in (("dq", query_rows), ("dk", key_rows), ("dv", key_rows)):
        _assert_other_docs_unchanged(name, got[name], want[name], rows_per_doc, exact=INTERPRETING)
        _assert_other_docs_unchanged(f"deterministic {name}", got[f"deterministic {name}"],
                                     want[f"deterministic {name}"], rows_per_doc, exact=True)


@pytest.mark.parametrize("poisoned", ["index_q", "index_k"])
def test_a_non_finite_document_changes_no_other_documents_selection(poisoned):
    cu_q, cu_k, num_queries, num_keys, max_q, max_k = layout([50, 140, 30], [70, 140, 30])
    generator = torch.Generator().manual_seed(2)
    clean = {"index_q": torch.randn(num_queries, 2, 32, generator=generator).to(DEVICE),
             "index_k": torch.randn(num_keys, 1, 32, generator=generator).to(DEVICE)}
    rows = (doc_rows(cu_k) if poisoned == "index_k" else doc_rows(cu_q))[POISONED_DOC]
    dirty = dict(clean, **{poisoned: poison(clean[poisoned], rows)})

    def run(x):
        return select_kernel.select_blocks(x["index_q"], x["index_k"], Documents(cu_q, cu_k, max_q, max_k), 3, 64)

    want, got = run(clean), run(dirty)
    for doc, rows in enumerate(doc_rows(cu_q)):
        if doc != POISONED_DOC:
            assert torch.equal(got[:, rows.start:rows.stop], want[:, rows.start:rows.stop]), f"document {doc}"
