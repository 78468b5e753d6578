"""The `msa::` operator schemas: the single source of truth for the op contract.

`csrc_stub/msa_stub.cpp` repeats these strings for processes that load an exported artifact
without Python; `tests/core/test_schemas.py` pins both to the text below, so a change is deliberate.
"""

from .documents import FRAGMENT_ARGUMENTS

NAMESPACE = "msa"

# The documents (torch_msa/documents.py), after the op's own leading tensors.
_DOCUMENTS = "Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k"
# Every op ends with the optional query fragments (int32 [F] each); omitted, the queries are the
# causal suffix of their document's keys.
_FRAGMENTS = ", ".join(f"Tensor? {name}=None" for name in FRAGMENT_ARGUMENTS)

SCHEMAS: dict[str, str] = {
    "select_blocks": (
        f"select_blocks(Tensor index_q, Tensor index_k, {_DOCUMENTS}, int topk, int block_size, {_FRAGMENTS}) -> Tensor"
    ),
    # The key-to-query schedule of a selection, passed to forward and backward as their `plan`.
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
    # The index loss; `block_indices` omitted: every visible key (dense warm-up). Besides the loss it
    # returns what the backward needs instead of q and k (torch_msa/reference_index_loss.py).
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
    # The attention forward and the index loss as one autograd node: the backward computes the loss
    # where it recomputes P and writes its value into `loss_value`; the loss output is 0.
    "forward_with_index_loss": (
        f"forward_with_index_loss(Tensor q, Tensor k, Tensor v, Tensor index_q, Tensor index_k, Tensor block_indices, "
        f"{_DOCUMENTS}, int block_size, float softmax_scale, float index_softmax_scale, Tensor loss_value, "
        f"Tensor? plan=None, {_FRAGMENTS}) -> (Tensor, Tensor, Tensor)"
    ),
    # Its backward: dq, dk, dv, d index_q, d index_k and the index loss's value.
    "backward_with_index_loss": (
        f"backward_with_index_loss(Tensor grad_out, Tensor grad_loss, Tensor q, Tensor k, Tensor v, Tensor out, "
        f"Tensor lse, Tensor index_q, Tensor index_k, Tensor block_indices, {_DOCUMENTS}, int block_size, "
        f"float softmax_scale, float index_softmax_scale, Tensor? grad_lse=None, Tensor? plan=None, {_FRAGMENTS}) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
    ),
}
