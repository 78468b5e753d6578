// Schema-only stub of the `msa::` operators.
//
// An exported program or AOTInductor package that calls torch.ops.msa.* names the ops by schema.
// A process that loads such an artifact without having imported torch_msa would otherwise fail
// with an opaque "could not find schema" while deserialising; loading this library first makes
// deserialisation succeed and turns any later call into an error that says what to do.
//
// The kernels stay in Python on purpose: `import torch_msa` afterwards finds these schemas,
// checks they match `torch_msa/_schemas.py`, and registers its own kernel, fake kernels and
// autograd on them, replacing the CompositeExplicitAutograd kernel below.
//
// Each schema string is kept on one line, byte-identical to `torch_msa/_schemas.py`, so that
// tests/core/test_stub.py can find it verbatim in this file.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <string>

namespace {

struct StubOp {
  const char* name;
  const char* schema;
  // Set by TORCH_LIBRARY below, read by TORCH_LIBRARY_IMPL: static initialisers of one file run
  // in order, so the flags are final before any kernel is registered.
  bool defined_here;
};

StubOp stub_ops[] = {
    {"select_blocks", "select_blocks(Tensor index_q, Tensor index_k, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, int topk, int block_size, Tensor? fragment_documents=None, Tensor? fragment_starts=None) -> Tensor", false},
    {"plan", "plan(Tensor block_indices, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, SymInt num_keys, int block_size, int entries_per_item, Tensor? fragment_documents=None, Tensor? fragment_starts=None) -> Tensor", false},
    {"forward", "forward(Tensor q, Tensor k, Tensor v, Tensor block_indices, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, int block_size, float softmax_scale, Tensor? plan=None, Tensor? fragment_documents=None, Tensor? fragment_starts=None) -> (Tensor, Tensor)", false},
    {"backward", "backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor block_indices, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, int block_size, float softmax_scale, Tensor? grad_lse=None, Tensor? plan=None, Tensor? fragment_documents=None, Tensor? fragment_starts=None) -> (Tensor, Tensor, Tensor)", false},
    {"indexer_kl", "indexer_kl(Tensor q, Tensor k, Tensor? lse, Tensor index_q, Tensor index_k, Tensor? block_indices, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, int block_size, float softmax_scale, float index_softmax_scale, Tensor? fragment_documents=None, Tensor? fragment_starts=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)", false},
    {"indexer_kl_backward", "indexer_kl_backward(Tensor grad_loss, Tensor index_q, Tensor index_k, Tensor index_lse, Tensor teacher_mass, Tensor teacher_index_keys, Tensor teacher_index_queries, Tensor? block_indices, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, int block_size, float index_softmax_scale, Tensor? fragment_documents=None, Tensor? fragment_starts=None) -> (Tensor, Tensor)", false},
    {"forward_with_index_loss", "forward_with_index_loss(Tensor q, Tensor k, Tensor v, Tensor index_q, Tensor index_k, Tensor block_indices, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, int block_size, float softmax_scale, float index_softmax_scale, Tensor loss_value, Tensor? plan=None, Tensor? fragment_documents=None, Tensor? fragment_starts=None) -> (Tensor, Tensor, Tensor)", false},
    {"backward_with_index_loss", "backward_with_index_loss(Tensor grad_out, Tensor grad_loss, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor index_q, Tensor index_k, Tensor block_indices, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, int block_size, float softmax_scale, float index_softmax_scale, Tensor? grad_lse=None, Tensor? plan=None, Tensor? fragment_documents=None, Tensor? fragment_starts=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)", false},
};

// One boxed kernel serves every op: it never reads the arguments, and boxing spares
// restating each schema as a C++ signature.
void requires_torch_msa(const c10::OperatorHandle& op, torch::jit::Stack* /*stack*/) {
  TORCH_CHECK(
      false,
      op.schema().name(),
      ": the msa kernels live in the Python package torch_msa; run `import torch_msa` in this "
      "process (it has loaded only the msa schema stub, csrc_stub/msa_stub.cpp, which declares "
      "the ops but has no kernels).");
}

}  // namespace

TORCH_LIBRARY(msa, m) {
  for (auto& op : stub_ops) {
    // Loaded after `import torch_msa`, the schemas exist already: a second def() would throw
    // from this static initialiser and abort the process, and the stub has nothing to add.
    if (c10::Dispatcher::singleton().findSchema({std::string("msa::") + op.name, ""}).has_value()) {
      continue;
    }
    // m.def, unlike torch.library.custom_op, does not add pt2_compliant_tag by itself.
    m.def(op.schema, {at::Tag::pt2_compliant_tag});
    op.defined_here = true;
  }
}

// CompositeExplicitAutograd is the key torch_msa registers its Python kernel under, so that
// registration replaces this one rather than being shadowed by it. Only ops defined above get
// the error kernel: on ops torch_msa already serves, a newer kernel here would win.
// No fake kernel: torch_msa registers the fakes.
TORCH_LIBRARY_IMPL(msa, CompositeExplicitAutograd, m) {
  for (const auto& op : stub_ops) {
    if (op.defined_here) {
      m.impl(op.name, torch::CppFunction::makeFromBoxedFunction<&requires_torch_msa>());
    }
  }
}
