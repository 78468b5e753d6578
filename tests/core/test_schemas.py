"""The op contract, pinned: a schema change must be deliberate (and the C++ stub updated)."""

import expecttest
import torch

import torch_msa  # noqa: F401
from torch_msa._schemas import SCHEMAS


class TestSchemas(expecttest.TestCase):
    def test_select_blocks(self):
        self.assertExpectedInline(
            str(torch.ops.msa.select_blocks.default._schema),
            """msa::select_blocks(Tensor index_q, Tensor index_k, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, int topk, int block_size, Tensor? fragment_documents=None, Tensor? fragment_starts=None) -> Tensor""",
        )

    def test_plan(self):
        self.assertExpectedInline(
            str(torch.ops.msa.plan.default._schema),
            """msa::plan(Tensor block_indices, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, SymInt num_keys, int block_size, int entries_per_item, Tensor? fragment_documents=None, Tensor? fragment_starts=None) -> Tensor""",
        )

    def test_forward(self):
        self.assertExpectedInline(
            str(torch.ops.msa.forward.default._schema),
            """msa::forward(Tensor q, Tensor k, Tensor v, Tensor block_indices, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, int block_size, float softmax_scale, Tensor? plan=None, Tensor? fragment_documents=None, Tensor? fragment_starts=None) -> (Tensor, Tensor)""",
        )

    def test_backward(self):
        self.assertExpectedInline(
            str(torch.ops.msa.backward.default._schema),
            """msa::backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor block_indices, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, int block_size, float softmax_scale, Tensor? grad_lse=None, Tensor? plan=None, Tensor? fragment_documents=None, Tensor? fragment_starts=None) -> (Tensor, Tensor, Tensor)""",
        )

    def test_indexer_kl(self):
        self.assertExpectedInline(
            str(torch.ops.msa.indexer_kl.default._schema),
            """msa::indexer_kl(Tensor q, Tensor k, Tensor? lse, Tensor index_q, Tensor index_k, Tensor? block_indices, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, int block_size, float softmax_scale, float index_softmax_scale, Tensor? fragment_documents=None, Tensor? fragment_starts=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)""",
        )

    def test_indexer_kl_backward(self):
        self.assertExpectedInline(
            str(torch.ops.msa.indexer_kl_backward.default._schema),
            """msa::indexer_kl_backward(Tensor grad_loss, Tensor index_q, Tensor index_k, Tensor index_lse, Tensor teacher_mass, Tensor teacher_index_keys, Tensor teacher_index_queries, Tensor? block_indices, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, int block_size, float index_softmax_scale, Tensor? fragment_documents=None, Tensor? fragment_starts=None) -> (Tensor, Tensor)""",
        )

    def test_forward_with_index_loss(self):
        self.assertExpectedInline(
            str(torch.ops.msa.forward_with_index_loss.default._schema),
            """msa::forward_with_index_loss(Tensor q, Tensor k, Tensor v, Tensor index_q, Tensor index_k, Tensor block_indices, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, int block_size, float softmax_scale, float index_softmax_scale, Tensor loss_value, Tensor? plan=None, Tensor? fragment_documents=None, Tensor? fragment_starts=None) -> (Tensor, Tensor, Tensor)""",
        )

    def test_backward_with_index_loss(self):
        self.assertExpectedInline(
            str(torch.ops.msa.backward_with_index_loss.default._schema),
            """msa::backward_with_index_loss(Tensor grad_out, Tensor grad_loss, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor index_q, Tensor index_k, Tensor block_indices, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, int block_size, float softmax_scale, float index_softmax_scale, Tensor? grad_lse=None, Tensor? plan=None, Tensor? fragment_documents=None, Tensor? fragment_starts=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)""",
        )

    def test_registered_schemas_are_the_source_strings(self):
        for name, schema in SCHEMAS.items():
            op = getattr(torch.ops.msa, name).default
            self.assertEqual(str(op._schema), str(torch._C.parse_schema(f"msa::{schema}")))
            self.assertIn(torch.Tag.pt2_compliant_tag, op.tags)
