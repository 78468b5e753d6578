"""Sample inputs on which every `msa::` op must pass `torch.library.opcheck`.

Each sample is one op call: GQA ratios, head dims, block sizes, dtypes, varlen packs with empty
and one-token documents, queries that are a strict suffix of their keys, with and without
`requires_grad`, and query fragments that share their documents' keys (every op, one
configuration). `msa::plan` (integer inputs only) runs without; forward and backward run
without a plan, and with one from `msa::plan` where inputs require grad.
`tests/core/test_opcheck.py` runs the whole matrix (`tests/core/test_ops_cuda.py` on CUDA), and

    python -m tests.support.opcheck_samples [--device cpu|cuda] [-k pattern]

(from the repository root) runs it and prints one line per sample with its result.
"""

import argparse
import dataclasses
import sys
import time

import torch

import torch_msa  # noqa: F401  (registers torch.ops.msa.*)
from torch_msa.plan.schedule import entries_per_item
from torch_msa.testing import cu_seqlens, fragments, random_block_indices

# opcheck's four utilities; test_autograd_registration needs an autograd kernel where inputs
# require grad, test_aot_dispatch_dynamic traces fake kernels with dynamic shapes.
CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]


LAYOUTS = (
    Layout("one_doc", (150,), (150,)),
    Layout("varlen", (40, 0, 1, 90), (40, 0, 1, 90)),
    Layout("suffix", (30, 0, 70), (140, 5, 70)),
)


# msa::backward is not differentiable (double backward raises NotImplementedError on purpose,
# rather than dropping a gradient penalty silently), so with grad-requiring inputs its
# aot_dispatch check, which backpropagates through the op, is replaced by a test that the
# clear error is raised (tests/core/test_opcheck.py).
NO_DOUBLE_BACKWARD_CHECKS = CHECKS[:3]


@dataclasses.dataclass
class Sample:
    name: str
    op: str
    args: tuple
    checks: tuple[str, ...] = CHECKS

    @property
    def overload(self):
        return getattr(torch.ops.msa, self.op).default


def _attention_inputs(layout: Layout, num_heads, num_kv_heads, dim, block_size, topk, dtype, requires_grad, device):
    cu_q, cu_k = cu_seqlens(layout.q_lens, layout.k_lens, device=device)
    num_queries, num_keys = sum(layout.q_lens), sum(layout.k_lens)

    def tensor(*shape):
        return torch.randn(*shape, dtype=dtype, device=device).requires_grad_(requires_grad)

    q = tensor(num_queries, num_heads, dim)
    k, v = tensor(num_keys, num_kv_heads, dim), tensor(num_keys, num_kv_heads, dim)
    block_indices = random_block_indices(cu_q, cu_k, num_kv_heads, topk, block_size)
    docs = (cu_q, cu_k, max(layout.q_lens), max(layout.k_lens))
    return q, k, v, block_indices, docs


def samples(device: str = "cpu") -> list[Sample]:
    """The matrix, built with a fixed seed."""
    torch.manual_seed(0)
    result = []
    # Hq, Hkv, D, block_size, topk, dtype
    configs = (
        (4, 4, 64, 64, 2, torch.float32),
        (8, 2, 128, 64, 3, torch.float32),
        (16, 1, 64, 128, 1, torch.float32),
        (4, 2, 64, 64, 16, torch.bfloat16),
    )
    for layout in LAYOUTS:
        for num_heads, num_kv_heads, dim, block_size, topk, dtype in configs:
            for requires_grad in (False, True):
                tag = (f"{layout.name}-hq{num_heads}-hkv{num_kv_heads}-d{dim}-bs{block_size}-top{topk}"
                       f"-{str(dtype)[6:]}-{'grad' if requires_grad else 'nograd'}")
                q, k, v, block_indices, docs = _attention_inputs(
                    layout, num_heads, num_kv_heads, dim, block_size, topk, dtype, requires_grad, device)
                scale = dim**-0.5
                plan_args = (block_indices, *docs, k.shape[0], block_size, entries_per_item(num_heads, num_kv_heads))
                if not requires_grad:
                    result.append(Sample(f"plan-{tag}", "plan", plan_args))
                plan = (torch.ops.msa.plan(*plan_args),) if requires_grad else ()
                result.append(Sample(f"forward-{tag}", "forward",
                                     (q, k, v, block_indices, *docs, block_size, scale, *plan)))
                with torch.no_grad():
                    out, lse = torch.ops.msa.forward(q, k, v, block_indices, *docs, block_size, scale)
                grad_out = torch.randn_like(out).requires_grad_(requires_grad)
                grad_lse = torch.randn_like(lse) if requires_grad else None
                result.append(Sample(f"backward-{tag}", "backward",
                                     (grad_out, q, k, v, out, lse, block_indices, *docs, block_size, scale, grad_lse,
                                      *plan),
                                     NO_DOUBLE_BACKWARD_CHECKS if requires_grad else CHECKS))
                index_q = torch.randn(q.shape[0], num_kv_heads, 32, dtype=dtype, device=device)
                index_q.requires_grad_(requires_grad)
                index_k = torch.randn(k.shape[0], 1, 32, dtype=dtype, device=device).requires_grad_(requires_grad)
                result.append(Sample(f"select_blocks-{tag}", "select_blocks",
                                     (index_q, index_k, *docs, topk, block_size)))
                if (num_heads, dtype) == KL_CONFIGS[0] or (
                        (num_heads, dtype) == KL_CONFIGS[1] and layout.name == KL_BF16_LAYOUT):
                    result.extend(_indexer_kl_samples(tag, q, k, lse, index_q, index_k, block_indices, docs,
                                                      block_size, scale, requires_grad))
                    if layout.name == KL_BF16_LAYOUT or (num_heads, dtype) != KL_CONFIGS[0]:
                        continue
                    result.extend(_index_loss_samples(tag, (q, k, v, out, lse, grad_out), index_q, index_k,
                                                      block_indices, docs, (), block_size, scale, requires_grad))
    result.extend(_fragment_samples(device))
    return result


# Query fragments sharing their documents' keys (`torch_msa/documents.py`): out of order, several
# per document, an empty and a 1-token document; every op once, on one configuration.
FRAGMENT_LENGTHS = (150, 0, 1, 90)
FRAGMENT_PIECES = ((3, 40, 50), (0, 0, 60), (2, 0, 1), (0, 60, 90), (3, 0, 40))


def _fragment_samples(device) -> list[Sample]:
    num_heads, num_kv_heads, dim, block_size, topk, dtype = 8, 2, 64, 64, 3, torch.float32
    frag = fragments(FRAGMENT_LENGTHS, FRAGMENT_PIECES, device)
    docs, extra = frag.op_args, frag.tensors
    num_queries, num_keys = int(frag.cu_seqlens_q[-1]), int(frag.cu_seqlens_k[-1])
    block_indices = random_block_indices(frag.cu_seqlens_q, frag.cu_seqlens_k, num_kv_heads, topk, block_size, None,
                                         *extra)
    scale, index_scale = dim**-0.5, 32**-0.5
    plan_args = (block_indices, *docs, num_keys, block_size, entries_per_item(num_heads, num_kv_heads), *extra)
    plan = torch.ops.msa.plan(*plan_args)
    result = [Sample("plan-fragments", "plan", plan_args)]
    for requires_grad in (False, True):
        tag = f"fragments-{'grad' if requires_grad else 'nograd'}"

        def tensor(*shape, requires_grad=requires_grad):
            return torch.randn(*shape, dtype=dtype, device=device).requires_grad_(requires_grad)

        q = tensor(num_queries, num_heads, dim)
        k, v = tensor(num_keys, num_kv_heads, dim), tensor(num_keys, num_kv_heads, dim)
        index_q, index_k = tensor(num_queries, num_kv_heads, 32), tensor(num_keys, 1, 32)
        result.append(Sample(f"select_blocks-{tag}", "select_blocks",
                             (index_q, index_k, *docs, topk, block_size, *extra)))
        result.append(Sample(f"forward-{tag}", "forward",
                             (q, k, v, block_indices, *docs, block_size, scale, plan, *extra)))
        with torch.no_grad():
            out, lse = torch.ops.msa.forward(q, k, v, block_indices, *docs, block_size, scale, plan, *extra)
        grad_out = torch.randn_like(out).requires_grad_(requires_grad)
        result.append(Sample(f"backward-{tag}", "backward",
                             (grad_out, q, k, v, out, lse, block_indices, *docs, block_size, scale, None, plan, *extra),
                             NO_DOUBLE_BACKWARD_CHECKS if requires_grad else CHECKS))
        sparse = (q, k, lse, index_q, index_k, block_indices, *docs, block_size, scale, index_scale, *extra)
        result.append(Sample(f"indexer_kl-{tag}", "indexer_kl", sparse))
        with torch.no_grad():
            _, _, index_lse, *teacher_terms = torch.ops.msa.indexer_kl(*sparse)
        grad_loss = torch.ones((), dtype=index_lse.dtype, device=device).requires_grad_(requires_grad)
        result.append(Sample(f"indexer_kl_backward-{tag}", "indexer_kl_backward",
                             (grad_loss, index_q, index_k, index_lse, *teacher_terms, block_indices, *docs,
                              block_size, index_scale, *extra),
                             NO_DOUBLE_BACKWARD_CHECKS if requires_grad else CHECKS))
        result.extend(_index_loss_samples(tag, (q, k, v, out, lse, grad_out), index_q, index_k, block_indices, docs,
                                          extra, block_size, scale, requires_grad, plan))
    return result


def _index_loss_samples(tag, attention, index_q, index_k, block_indices, docs, extra, block_size, scale, requires_grad,
                        plan=None):
    """The attention and the KL loss as one node (`msa::forward_with_index_loss`) and its backward."""
    q, k, v, out, lse, grad_out = attention
    index_scale = index_q.shape[-1] ** -0.5
    loss_value = torch.zeros((), dtype=lse.dtype, device=q.device)
    grad_loss = torch.ones((), dtype=lse.dtype, device=q.device).requires_grad_(requires_grad)
    return [
        Sample(f"forward_with_index_loss-{tag}", "forward_with_index_loss",
               (q, k, v, index_q, index_k, block_indices, *docs, block_size, scale, index_scale, loss_value, plan,
                *extra)),
        Sample(f"backward_with_index_loss-{tag}", "backward_with_index_loss",
               (grad_out, grad_loss, q, k, v, out, lse, index_q, index_k, block_indices, *docs, block_size, scale,
                index_scale, None, plan, *extra),
               NO_DOUBLE_BACKWARD_CHECKS if requires_grad else CHECKS),
    ]


# The loss's samples (each is seconds of CI): the GQA fp32 configuration on every layout, with the
# sparse and the dense support; bf16 (fp32 loss from bf16 inputs) on the varlen pack, sparse only.
KL_CONFIGS = ((8, torch.float32), (4, torch.bfloat16))
KL_DENSE_CONFIG = KL_CONFIGS[0]
KL_BF16_LAYOUT = "varlen"


def _indexer_kl_samples(tag, q, k, lse, index_q, index_k, block_indices, docs, block_size, scale, requires_grad):
    """Sparse support with the attention's lse, dense support with its own normaliser, and the backward."""
    index_scale = index_q.shape[-1] ** -0.5
    sparse = (q, k, lse, index_q, index_k, block_indices, *docs, block_size, scale, index_scale)
    dense = (q, k, None, index_q, index_k, None, *docs, block_size, scale, index_scale)
    samples = [Sample(f"indexer_kl-sparse-{tag}", "indexer_kl", sparse)]
    if (q.shape[1], q.dtype) == KL_DENSE_CONFIG:
        samples.append(Sample(f"indexer_kl-dense-{tag}", "indexer_kl", dense))
    with torch.no_grad():
        _, _, index_lse, *teacher_terms = torch.ops.msa.indexer_kl(*sparse)
    grad_loss = torch.ones((), dtype=index_lse.dtype, device=q.device).requires_grad_(requires_grad)
    samples.append(Sample(f"indexer_kl_backward-{tag}", "indexer_kl_backward",
                          (grad_loss, index_q, index_k, index_lse, *teacher_terms, block_indices, *docs,
                           block_size, index_scale),
                          NO_DOUBLE_BACKWARD_CHECKS if requires_grad else CHECKS))
    return samples


def run(sample: Sample) -> None:
    """Raise if opcheck finds a problem with `sample`."""
    torch.library.opcheck(sample.overload, sample.args, test_utils=sample.checks)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.opcheck_samples",
                                     description="Run torch.library.opcheck over the sample matrix and print one line"
                                                 " per sample with its result.")
    parser.add_argument("--device", default="cpu", help="device of the sample tensors (default: cpu)")
    parser.add_argument("-k", dest="pattern", default="", help="only samples whose name contains this text")
    args = parser.parse_args()
    matrix = [s for s in samples(args.device) if args.pattern in s.name]
    print(f"opcheck {', '.join(CHECKS)} on {len(matrix)} samples ({args.device})", flush=True)
    failed = 0
    for index, sample in enumerate(matrix, 1):
        start = time.perf_counter()
        try:
            run(sample)
            verdict = "ok"
        except Exception as error:  # report every failure, then exit non-zero
            failed += 1
            verdict = f"FAIL {type(error).__name__}: {str(error).splitlines()[0]}"
        checks = "all" if sample.checks == CHECKS else "+".join(c[5:] for c in sample.checks)
        seconds = time.perf_counter() - start
        print(f"[{index:3d}/{len(matrix)}] {sample.name:<66} {checks:<30} {verdict} ({seconds:.1f} s)", flush=True)
    print(f"{len(matrix) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
