"""`torch_msa.documents.Documents`, the one value the six document arguments travel as below the
op schemas, and the conversion of an op's arguments into it (`torch_msa.ops.backend_arguments`)."""

import dataclasses

import pytest
import torch

from torch_msa._schemas import SCHEMAS
from torch_msa.documents import DOCUMENT_ARGUMENTS, FRAGMENT_ARGUMENTS, Documents, locate_queries, token_fragments
from torch_msa.ops import backend_arguments


def _int32(*values):
    return torch.tensor(values, dtype=torch.int32)


def _fragmented():
    # Two documents of 5 and 3 keys; fragments: document 0 from position 2 (2 queries), document 1
    # from 0 (3 queries), document 0 again from position 4 (1 query).
    return Documents(_int32(0, 2, 5, 6), _int32(0, 5, 8), 3, 5, _int32(0, 1, 0), _int32(2, 0, 4))


def test_the_value_is_frozen():
    documents = _fragmented()
    with pytest.raises(dataclasses.FrozenInstanceError):
        documents.max_seqlen_q = 7  # type: ignore[misc]


def test_its_fields_are_the_ops_document_arguments_in_order():
    assert tuple(field.name for field in dataclasses.fields(Documents)) == DOCUMENT_ARGUMENTS
    assert DOCUMENT_ARGUMENTS[-2:] == FRAGMENT_ARGUMENTS
    # Every op ends with the fragment pair, and names the six once each.
    for schema in SCHEMAS.values():
        assert all(schema.count(f" {name}") == 1 for name in DOCUMENT_ARGUMENTS), schema
        assert schema.index(FRAGMENT_ARGUMENTS[0]) < schema.index(FRAGMENT_ARGUMENTS[1]) < schema.index(")")


@pytest.mark.parametrize("fragmented", [False, True])
def test_its_methods_are_the_location_rule(fragmented):
    documents = _fragmented() if fragmented else Documents(_int32(0, 2, 5), _int32(0, 5, 8), 3, 5)
    num_queries, num_keys = int(documents.cu_seqlens_q[-1]), int(documents.cu_seqlens_k[-1])
    expected = locate_queries(documents.cu_seqlens_q, documents.cu_seqlens_k, num_queries, num_keys,
                              *documents.fragments)
    located = documents.locate(num_queries, num_keys)
    assert torch.equal(located.key_start, expected.key_start) and torch.equal(located.position, expected.position)
    for got, want in zip(documents.token_fragments(num_queries, num_keys),
                         token_fragments(documents.cu_seqlens_q, documents.cu_seqlens_k, num_queries, num_keys,
                                         *documents.fragments)):
        assert torch.equal(got, want)
    assert documents.has_fragments is fragmented
    assert documents.num_documents == 2
    if fragmented:
        # Fragment 2 (query row 5) is document 0's position 4: keys start at row 0.
        assert located.position.tolist() == [2, 3, 0, 1, 2, 4]


def test_op_arguments_become_one_value_where_cu_seqlens_q_stood():
    q, k = torch.zeros(6, 4, 8), torch.zeros(8, 1, 8)
    documents = _fragmented()
    four = (documents.cu_seqlens_q, documents.cu_seqlens_k, documents.max_seqlen_q, documents.max_seqlen_k)
    converted = backend_arguments("select_blocks", q, k, *four, 2, 4, *documents.fragments)
    assert converted[0] is q and converted[1] is k and converted[3:] == [2, 4]
    assert all(getattr(converted[2], name) is getattr(documents, name) for name in DOCUMENT_ARGUMENTS)
    # By name, and with the trailing fragment pair left at its default.
    plain = backend_arguments("select_blocks", q, k, documents.cu_seqlens_q, documents.cu_seqlens_k, 3, 5,
                              topk=2, block_size=4)
    assert plain[2].cu_seqlens_q is documents.cu_seqlens_q and plain[2].max_seqlen_k == 5
    assert plain[2].fragments == (None, None) and not plain[2].has_fragments
