"""Every GPU kernel on a pack with junk ids, for compute-sanitizer (not collected by pytest).

    compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 python tests/support/memcheck_pack.py

`--report-api-errors no`: the CuTe DSL's CUDA bindings probe driver entry points that a driver may
lack (`cuGetProcAddress` returns `CUDA_ERROR_INVALID_VALUE`), which memcheck would count as errors;
memory access errors are reported either way.

M3 heads, bf16; documents of 300, 0, 1, 1500, 129 tokens and one with Lq < Lk; 30% of the block
ids replaced by random values in [-2^30, 2^30), repeats and ids far past every document. Runs the
selection, the plan, the forward, the backward, the KL loss and the KL fused into the backward (the
last three default and deterministic), the deterministic backward with NaN in the last document's
output gradient, and the forward's query-outer part;
then the same ops and the dense-support KL on query fragments of these documents with junk
fragment fields (a document id out of range, a start past its document, a negative start).
"""
import os

import torch

import torch_msa
from torch_msa.settings import QUERY_OUTER_ENV
from torch_msa.testing import cu_seqlens, random_block_indices

torch.manual_seed(0)
q_lens = [300, 0, 1, 1500, 129, 700]
k_lens = [300, 0, 1, 1500, 129, 2000]  # the last document has Lq < Lk
cu_q, cu_k = cu_seqlens(q_lens, k_lens, "cuda")
tq, tk = int(cu_q[-1]), int(cu_k[-1])
bf = dict(device="cuda", dtype=torch.bfloat16)
q = torch.randn(tq, 64, 128, **bf, requires_grad=True)
k = torch.randn(tk, 4, 128, **bf, requires_grad=True)
v = torch.randn(tk, 4, 128, **bf, requires_grad=True)
iq = torch.randn(tq, 4, 128, **bf, requires_grad=True)
ik = torch.randn(tk, 1, 128, **bf, requires_grad=True)
docs = (cu_q, cu_k, max(q_lens), max(k_lens))
sel = torch_msa.select_blocks(iq.detach(), ik.detach(), *docs)
bi = random_block_indices(cu_q, cu_k, 4, 16, 128).cuda()
junk = torch.randint(-(1 << 30), 1 << 30, bi.shape, device="cuda", dtype=torch.int32)
bi = torch.where(torch.rand(bi.shape, device="cuda") < 0.3, junk, bi)
bi[1, :, 3] = bi[1, :, 0]  # repeats
bi[2, :, 5] = 1 << 20       # far past every document
for deterministic in (False, True):
    torch.use_deterministic_algorithms(deterministic)
    out, lse = torch_msa.sparse_attention(q, k, v, bi, *docs, return_lse=True)
    (out.float().square().sum() + lse.sum()).backward()
torch.use_deterministic_algorithms(False)
# NaN in the last document's output gradient: the deterministic backward marks its rows, the last
# of the fixed-point dQ's row scales among them.
poisoned = torch.ones_like(q)
poisoned[int(cu_q[-2]):] = float("nan")
torch.use_deterministic_algorithms(True)
out = torch_msa.sparse_attention(q, k, v, bi, *docs)
(nan_grads,) = torch.autograd.grad(out, (q,), poisoned)
assert torch.isnan(nan_grads[int(cu_q[-2]):]).all() and torch.isfinite(nan_grads[:int(cu_q[-2])]).all()
torch.use_deterministic_algorithms(False)
attn = torch_msa.msa_attention(q, k, v, iq, ik, *docs, return_lse=True, return_block_indices=True)
for deterministic in (False, True):
    torch.use_deterministic_algorithms(deterministic)
    loss = torch_msa.indexer_kl_loss(q.detach(), k.detach(), attn.lse.detach(), iq, ik, bi, *docs)
    loss.backward()
    # The KL fused into the attention backward: through msa_attention, and on the junk ids.
    step = torch_msa.msa_attention(q, k, v, iq, ik, *docs, index_loss=True)
    (step.out.float().square().sum() + step.kl).backward()
    out, lse = torch_msa.sparse_attention(q.detach(), k.detach(), v.detach(), bi, *docs, return_lse=True)
    torch.ops.msa.backward_with_index_loss(torch.ones_like(out), torch.ones((), device="cuda"), q.detach(), k.detach(),
                                           v.detach(), out, lse, iq.detach(), ik.detach(), bi, *docs, 128, 128**-0.5,
                                           128**-0.5)
torch.use_deterministic_algorithms(False)

# Fragments: the first three of the pack's queries in three fragments whose fields are junk, then
# the rest as well-formed fragments of the documents 3 and 5.
frag_docs = torch.tensor([7, 3, 3, 5, -1], dtype=torch.int32, device="cuda")
frag_starts = torch.tensor([0, 1 << 30, 0, 100, -5], dtype=torch.int32, device="cuda")
frag_lens = [1, 1, 1400, 600, tq - 2003]
cu_frag = torch.tensor([0, *torch.tensor(frag_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
frag_args = (cu_frag, cu_k, max(frag_lens), max(k_lens))
fragments = dict(fragment_documents=frag_docs, fragment_starts=frag_starts)
sel = torch_msa.select_blocks(iq.detach(), ik.detach(), *frag_args, **fragments)
for deterministic in (False, True):
    torch.use_deterministic_algorithms(deterministic)
    out, lse = torch_msa.sparse_attention(q, k, v, bi, *frag_args, return_lse=True, **fragments)
    (out.float().square().sum() + lse.sum()).backward()
torch.use_deterministic_algorithms(False)
out, lse = torch_msa.sparse_attention(q, k, v, sel, *frag_args, return_lse=True, **fragments)
for deterministic in (False, True):
    torch.use_deterministic_algorithms(deterministic)
    loss = torch_msa.indexer_kl_loss(q.detach(), k.detach(), lse.detach(), iq, ik, sel, *frag_args, **fragments)
    loss.backward()
    # The dense-support KL (its key-tile-outer kernels walk fragments run by run), on the pack and
    # on the junk fragments.
    torch_msa.indexer_kl_loss_dense(q.detach(), k.detach(), iq, ik, *docs).backward()
    torch_msa.indexer_kl_loss_dense(q.detach(), k.detach(), iq, ik, *frag_args, **fragments).backward()
torch.use_deterministic_algorithms(False)

# The forward's query-outer part (asked for per call), on the junk ids and on a selection shared by
# runs of 8 queries (most of it query-outer), on the pack and on the junk fragments.
shared = bi[:, (torch.arange(tq, device="cuda") // 8 * 8 + 7).clamp(max=tq - 1)].contiguous()
os.environ[QUERY_OUTER_ENV] = "1"
for selection in (bi, shared):
    torch_msa.sparse_attention(q.detach(), k.detach(), v.detach(), selection, *docs)
    torch_msa.sparse_attention(q.detach(), k.detach(), v.detach(), selection, *frag_args, **fragments)
del os.environ[QUERY_OUTER_ENV]
torch.cuda.synchronize()
print("sanitize run done:", {op: torch_msa.resolve(op, q.device).name for op in torch_msa.backends.OPS},
      "loss", float(loss), "selected", tuple(sel.shape))
