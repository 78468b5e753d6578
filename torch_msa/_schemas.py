"""The `msa::` operator schemas: the single source of truth for the op contract.

`csrc_stub/msa_stub.cpp` repeats these strings for processes that load an exported artifact
without Python; `tests/core/test_schemas.py` pins both to the text below, so a change is deliberate.
"""

from .documents import FRAGMENT_ARGUMENTS

NAMESPACE = "msa"

# The documents (torch_msa/documents.py), after the op's own leading tensors.
_DOCUMENTS = "Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k"
# Every op ends with the optional fragment description (`FRAGMENT_ARGUMENTS`, int32 [F] each):
# query fragments of documents that share the documents' keys, for context parallelism. Omitted,
# `cu_seqlens_q` and `cu_seqlens_k` delimit the same documents and the queries are the causal
# suffix of the keys.
_FRAGMENTS = ", ".join(f"Tensor? {name}=None" for name in FRAGMENT_ARGUMENTS)

SCHEMAS: dict[str, str] = {
    "select_blocks": (
        f"select_blocks(Tensor index_q, Tensor index_k, {_DOCUMENTS}, int topk, int block_size, {_FRAGMENTS}) -> Tensor"
    ),
    # The key-to-query schedule of one layer's selection, built once per step and passed to
    # forward and backward as their trailing optional `plan` (layout: torch_msa/plan/schedule.py).
    "plan": (
        f"plan(Tensor block_indices, {_DOCUMENTS}, SymInt num_keys, int block_size, int entries_per_item, "
        f"{_FRAGMENTS}) -> Tensor"
    ),
    "forward": (
        f"forward(Tensor q, Tensor k, Tensor v, Tensor block_indices, {_DOCUMENTS}, int block_size, "
        f"float softmax_scale, Tensor? plan=None, {_FRAGMENTS}) -> (Tensor, Tensor)"
    ),
    # `grad_lse` (trailing, optional) lets autograd fold the gradient of `lse` into dS instead
    # of dropping it: dS = P * (dP - delta + grad_lse).
    "backward": (
        f"backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor block_indices, "
        f"{_DOCUMENTS}, int block_size, float softmax_scale, Tensor? grad_lse=None, Tensor? plan=None, {_FRAGMENTS}) "
        "-> (Tensor, Tensor, Tensor)"
    ),
    # The index branch's KL distillation loss. `lse` omitted: the teacher's normaliser is computed
    # over the support; `block_indices` omitted: the support is every visible key (dense warm-up).
    # Outputs: loss, the teacher lse used, the student's lse over the support, the teacher's mass
    # on it and the teacher's two index reductions `sum_J P_t index_k` [Tq, Hi, Di] and
    # `sum_(t, r) P_t index_q` [Tk, 1, Di]: the backward needs these, and neither q nor k.
    "indexer_kl": (
        f"indexer_kl(Tensor q, Tensor k, Tensor? lse, Tensor index_q, Tensor index_k, Tensor? block_indices, "
        f"{_DOCUMENTS}, int block_size, float softmax_scale, float index_softmax_scale, {_FRAGMENTS}) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
    ),
    "indexer_kl_backward": (
        "indexer_kl_backward(Tensor grad_loss, Tensor index_q, Tensor index_k, Tensor index_lse, "
        "Tensor teacher_mass, Tensor teacher_index_keys, Tensor teacher_index_queries, Tensor? block_indices, "
        f"{_DOCUMENTS}, int block_size, float index_softmax_scale, {_FRAGMENTS}) -> (Tensor, Tensor)"
    ),
    # The attention forward and the index branch's KL loss as one autograd node, so that the
    # backward computes the KL's teacher where it recomputes P (no teacher pass in the forward).
    # Outputs: out, lse and the loss term, whose value is 0: the loss is known once the backward
    # has run, which writes it into `loss_value` (a 0-D fp32 tensor, not read by the forward).
    "forward_with_index_loss": (
        f"forward_with_index_loss(Tensor q, Tensor k, Tensor v, Tensor index_q, Tensor index_k, Tensor block_indices, "
        f"{_DOCUMENTS}, int block_size, float softmax_scale, float index_softmax_scale, Tensor loss_value, "
        f"Tensor? plan=None, {_FRAGMENTS}) -> (Tensor, Tensor, Tensor)"
    ),
    # Its backward: dq, dk, dv, d index_q, d index_k and the KL loss value.
    "backward_with_index_loss": (
        f"backward_with_index_loss(Tensor grad_out, Tensor grad_loss, Tensor q, Tensor k, Tensor v, Tensor out, "
        f"Tensor lse, Tensor index_q, Tensor index_k, Tensor block_indices, {_DOCUMENTS}, int block_size, "
        f"float softmax_scale, float index_softmax_scale, Tensor? grad_lse=None, Tensor? plan=None, {_FRAGMENTS}) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
    ),
}
