"""The architecture-neutral kernels of the SM100 backward: preprocess, task tables, K/V alignment
and postprocess (`torch_msa/sm100/{preprocess,task_tables,postprocess}.py`).

What runs where:
- CPU, always: the plain-torch construction of the task tables (the oracle of the CuTe kernel)
  against an independent pure-Python one, and the workspace geometry.
- CPU with the `cute` extra: every CuTe kernel compiles for sm_90a and sm_100a without a GPU
  (a kernel that fails to lower fails here), and a compiled kernel refuses arguments it cannot
  read before it launches.
- CPU with triton: the table-consuming Triton backward (`tests/support/triton_task_consumer.py`) under
  the Triton interpreter, fed by the plain-torch tables, against the reference gradients.
- CUDA (an H200 for the neutral kernels): the CuTe kernels against the torch equivalents (the
  tables exactly), and the consumer fed by the CuTe pipeline against the reference at M3 shapes.
"""

import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support import install
from tests.support.cute_dsl import deprecated_dsl_use_is_an_error, forbid_python_conversions, requires_cute
from tests.support.documents import backend_arguments, documents_of
from tests.support.schedule_oracle import build_schedule_python
from torch_msa import reference
from torch_msa.plan.schedule import build_schedule
from torch_msa.sm100.task_tables import (
    TOKENS_PER_TASK,
    WORKSPACE_ALIGNMENT,
    TaskTables,
    doc_aligned_starts,
    document_key_bounds,
    workspace_rows,
)
from torch_msa.testing import cu_seqlens, random_block_indices

ROOT = Path(__file__).resolve().parents[2]
ARCHES = ("sm_90a", "sm_100a")


# (q_lens, k_lens): a pack with empty and 1-token documents and partial blocks; queries that are
# a strict suffix of their keys (Lq < Lk) next to a document with keys but no queries.
LAYOUTS = {
    "pack": ([300, 0, 200, 1, 129], None),
    "suffix": ([50, 0, 130, 3, 0], [200, 10, 130, 260, 40]),
}


# ---------------------------------------------------------------------------------------------
# Plain-torch construction of the tables and outputs (the oracle of the CuTe kernels)
# ---------------------------------------------------------------------------------------------


def tables_torch(block_indices, cu_seqlens_q, cu_seqlens_k, num_keys, block_size=128) -> TaskTables:
    """`build_tasks` in torch ops, on any device."""
    num_docs = cu_seqlens_k.numel() - 1
    rows = workspace_rows(num_keys, num_docs)
    schedule = build_schedule(block_indices, documents_of(cu_seqlens_q, cu_seqlens_k), num_keys, block_size, TOKENS_PER_TASK)
    aligned_starts = doc_aligned_starts(cu_seqlens_k, num_keys, rows)
    # Clamped boundaries, B + 1 >= 1 of them, so the gathers below stay in range without documents.
    key_starts = cu_seqlens_k.long().clamp(0, num_keys)
    task = torch.arange(schedule.item_bucket.numel(), device=block_indices.device)
    bucket = schedule.item_bucket.long()
    count = (schedule.item_end - schedule.item_start).long()
    real = count > 0
    key_row = schedule.bucket_key_row.long()[bucket]
    document = (torch.searchsorted(key_starts[:-1], key_row, right=True) - 1).clamp(0, max(0, num_docs - 1))
    aligned_row = aligned_starts.long()[document] + key_row - key_starts[document]
    aligned_row = aligned_row.clamp(0, rows - WORKSPACE_ALIGNMENT)
    head, block = schedule.bucket_head.long()[bucket], schedule.bucket_block.long()[bucket]
    meta = torch.stack([head, aligned_row, block, count], 1)
    slot = torch.arange(TOKENS_PER_TASK, device=task.device)
    slot_ok = slot < count[:, None]
    # One padding element each keeps the gathers of unused slots in range (also with Tq = 0).
    entry_query = torch.cat([schedule.entry_query.long(), count.new_zeros(1)])
    position = torch.cat([schedule.position.long(), count.new_full((1,), -1)])
    entry = torch.where(slot_ok, schedule.item_start.long()[:, None] + slot, entry_query.numel() - 1)
    qrows = torch.where(slot_ok, entry_query[entry] // block_indices.shape[-1], -1)
    qpos = position[qrows]  # -1 rows read the padding -1
    bucket_task_ptr = schedule.num_items.long().expand(schedule.bucket_head.numel() + 1).clone()
    previous = torch.cat([bucket.new_full((1,), -1), bucket[:-1]])
    first = real & (previous != bucket)
    bucket_task_ptr[bucket[first]] = task[first]
    as_int32 = lambda x: x.to(torch.int32)  # noqa: E731
    return TaskTables(
        task_meta=as_int32(meta * real[:, None]), task_qrows=as_int32(qrows), task_qpos=as_int32(qpos),
        bucket_task_ptr=as_int32(bucket_task_ptr), num_tasks=schedule.num_items, workspace_rows=rows,
        doc_aligned_start=aligned_starts, num_keys=num_keys,
    )


def _workspace_rows_of_keys(cu_seqlens_k, tables):
    """int64 `[Tk]`: workspace row of every packed key, -1 for a key no document covers."""
    key_starts, lengths = document_key_bounds(cu_seqlens_k, tables.num_keys)
    rows = torch.full((tables.num_keys,), -1, dtype=torch.int64, device=cu_seqlens_k.device)
    for document in range(lengths.numel()):
        start, length = int(key_starts[document]), int(lengths[document])
        aligned = int(tables.doc_aligned_start[document])
        rows[start:start + length] = torch.arange(aligned, aligned + length, device=rows.device)
    return rows


def align_kv_torch(k, v, cu_seqlens_k, tables):
    rows = _workspace_rows_of_keys(cu_seqlens_k, tables)
    covered = rows >= 0
    aligned = []
    for x in (k, v):
        workspace = x.new_zeros(tables.workspace_rows, *x.shape[1:])
        workspace[rows[covered]] = x[covered]
        aligned.append(workspace)
    return tuple(aligned)


def delta_torch(out, grad_out, grad_lse=None):
    delta = (out.float() * grad_out.float()).sum(-1)
    return delta if grad_lse is None else delta - grad_lse.float()


def finish_torch(dq_accum, dk_accum, dv_accum, cu_seqlens_k, tables, dtype=torch.bfloat16):
    rows = _workspace_rows_of_keys(cu_seqlens_k, tables)
    unaligned = []
    for pool in (dk_accum, dv_accum):
        keys = pool.new_zeros(tables.num_keys, *pool.shape[1:])
        keys[rows >= 0] = pool[rows[rows >= 0]]
        unaligned.append(keys.to(dtype))
    return (dq_accum.to(dtype), *unaligned)


def tables_python(block_indices, cu_seqlens_q, cu_seqlens_k, num_keys, block_size):
    """The tasks from `build_schedule_python`, with plain loops: `(tasks, bucket_task_ptr, starts)`;
    a task is `(meta, qrows, qpos)` as lists."""
    schedule = build_schedule_python(block_indices, cu_seqlens_q, cu_seqlens_k, num_keys, block_size, TOKENS_PER_TASK)
    topk = block_indices.shape[-1]
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    num_docs = len(cu_k) - 1
    rows = WORKSPACE_ALIGNMENT * max(1, math.ceil(num_keys / WORKSPACE_ALIGNMENT) + num_docs)
    starts, offset = [], 0
    for document in range(num_docs):
        starts.append(offset)
        offset += math.ceil((cu_k[document + 1] - cu_k[document]) / WORKSPACE_ALIGNMENT) * WORKSPACE_ALIGNMENT
    starts.append(rows)
    position = {}
    for document in range(num_docs):
        length_q, length_k = cu_q[document + 1] - cu_q[document], cu_k[document + 1] - cu_k[document]
        for local in range(length_q):
            position[cu_q[document] + local] = length_k - length_q + local
    entries = [entry for bucket in schedule["buckets"] for entry in bucket[3]]
    tasks, bucket_task_ptr = [], []
    for index, (bucket, start, end) in enumerate(schedule["items"]):
        head, key_row, block, _ = schedule["buckets"][bucket]
        if len(bucket_task_ptr) == bucket:
            bucket_task_ptr.append(index)
        document = next(d for d in range(num_docs) if cu_k[d] <= key_row < cu_k[d + 1])
        tokens = [entries[e] // topk for e in range(start, end)]
        padding = [-1] * (TOKENS_PER_TASK - len(tokens))
        meta = [head, starts[document] + key_row - cu_k[document], block, len(tokens)]
        tasks.append((meta, tokens + padding, [position[t] for t in tokens] + padding))
    bucket_task_ptr.append(len(tasks))
    return tasks, bucket_task_ptr, starts


def _selection(layout, num_kv_heads, topk, block_size, device="cpu", out_of_contract=False, seed=0):
    q_lens, k_lens = LAYOUTS[layout] if isinstance(layout, str) else layout
    cu_q, cu_k = cu_seqlens(q_lens, k_lens)
    generator = torch.Generator().manual_seed(seed)
    block_indices = random_block_indices(cu_q, cu_k, num_kv_heads, topk, block_size, generator=generator)
    if out_of_contract:
        # Repeats, -1 slots and ids past the causal horizon: the schedule drops them.
        block_indices[..., -1] = block_indices[..., 0]
        block_indices[:, ::3, 1] = -1
        block_indices[:, ::5, 0] = 1000
    return block_indices.to(device), cu_q.to(device), cu_k.to(device), int(cu_k[-1])


def _assert_tables_equal(got: TaskTables, want: TaskTables):
    assert got.workspace_rows == want.workspace_rows and got.num_keys == want.num_keys
    for name in ("task_meta", "task_qrows", "task_qpos", "bucket_task_ptr", "num_tasks", "doc_aligned_start"):
        got_tensor, want_tensor = getattr(got, name), getattr(want, name)
        assert got_tensor.dtype == torch.int32 and got_tensor.shape == want_tensor.shape, name
        mismatch = (got_tensor.cpu() != want_tensor.cpu()).nonzero()
        assert mismatch.numel() == 0, f"{name}: {mismatch.shape[0]} entries differ, first at {mismatch[:4].tolist()}"


# ---------------------------------------------------------------------------------------------
# CPU: the oracle and the workspace geometry
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("block_size", [64, 128])
@pytest.mark.parametrize("out_of_contract", [False, True], ids=["contract", "bad_ids"])
def test_torch_tables_match_python_construction(layout, block_size, out_of_contract):
    inputs = _selection(layout, num_kv_heads=2, topk=3, block_size=block_size, out_of_contract=out_of_contract)
    tables = tables_torch(*inputs, block_size)
    tasks, bucket_task_ptr, starts = tables_python(*inputs, block_size)
    count = int(tables.num_tasks)
    assert count == len(tasks) > 0
    assert tables.doc_aligned_start.tolist() == starts
    assert tables.task_meta[:count].tolist() == [meta for meta, _, _ in tasks]
    assert tables.task_qrows[:count].tolist() == [qrows for _, qrows, _ in tasks]
    assert tables.task_qpos[:count].tolist() == [qpos for _, _, qpos in tasks]
    assert (tables.task_meta[count:] == 0).all() and (tables.task_qrows[count:] == -1).all()
    assert (tables.task_qpos[count:] == -1).all()
    padding = [count] * (tables.bucket_task_ptr.numel() - len(bucket_task_ptr))
    assert tables.bucket_task_ptr.tolist() == bucket_task_ptr + padding


def test_task_operands_are_schedule_and_table_tensors_by_name():
    from torch_msa.plan.schedule import Schedule
    from torch_msa.sm100.common import TaskOperands

    # `task_operands` looks each field up by name, so a renamed Schedule tensor must fail here, on a CPU.
    assert set(TaskOperands._fields) <= {*Schedule._fields, *TaskTables._fields, "cu_seqlens_k"}


def test_workspace_geometry():
    q_lens, k_lens = LAYOUTS["suffix"]
    _, cu_k = cu_seqlens(q_lens, k_lens)
    num_keys = int(cu_k[-1])
    rows = workspace_rows(num_keys, len(k_lens))
    starts = doc_aligned_starts(cu_k, num_keys, rows)
    padded = [math.ceil(length / 128) * 128 for length in k_lens]
    assert rows % WORKSPACE_ALIGNMENT == 0 and rows >= sum(padded)
    assert rows <= num_keys + WORKSPACE_ALIGNMENT * (len(k_lens) + 1)
    assert starts.tolist() == [sum(padded[:d]) for d in range(len(k_lens))] + [rows]
    assert workspace_rows(0, 0) == WORKSPACE_ALIGNMENT
    # Boundaries past the keys are clamped, so no document can overflow the workspace.
    wild = torch.tensor([0, 100, 900], dtype=torch.int32)
    assert doc_aligned_starts(wild, 300, workspace_rows(300, 2)).tolist() == [0, 128, workspace_rows(300, 2)]


def test_torch_align_and_finish_are_inverse():
    inputs = _selection("suffix", num_kv_heads=2, topk=3, block_size=64)
    tables = tables_torch(*inputs, 64)
    _, _, cu_k, num_keys = inputs
    k, v = torch.randn(2, num_keys, 2, 16).unbind(0)
    k_ws, v_ws = align_kv_torch(k, v, cu_k, tables)
    assert k_ws.shape == (tables.workspace_rows, 2, 16)
    starts = tables.doc_aligned_start.tolist()
    assert torch.equal(k_ws[starts[1]:starts[1] + 10], k[200:210])  # document 1 starts on row 256
    assert int((k_ws.abs().sum((1, 2)) > 0).sum()) == num_keys  # every other row is padding
    dq, dk, dv = finish_torch(torch.zeros(1, 1, 16), k_ws, v_ws, cu_k, tables, torch.float32)
    assert torch.equal(dk, k) and torch.equal(dv, v)


def test_bad_arguments_are_named():
    """Checked before anything is compiled or launched, so this runs on any host."""
    from torch_msa.sm100.postprocess import finish_gradients
    from torch_msa.sm100.preprocess import prepare_delta
    from torch_msa.sm100.task_tables import align_kv, build_tasks

    inputs = _selection("pack", num_kv_heads=2, topk=3, block_size=128)
    tables = tables_torch(*inputs)
    block_indices, cu_q, cu_k, num_keys = inputs
    with pytest.raises(ValueError, match="block_indices: expected a CUDA tensor"):
        build_tasks(block_indices, cu_q, cu_k, num_keys)
    with pytest.raises(TypeError, match="block_indices: expected an int32 tensor"):
        build_tasks(block_indices.long(), cu_q, cu_k, num_keys)
    with pytest.raises(ValueError, match="grad_out: expected the shape of out"):
        prepare_delta(torch.zeros(3, 4, 16), torch.zeros(3, 4, 8))
    with pytest.raises(TypeError, match="grad_out: expected out's dtype"):
        prepare_delta(torch.zeros(3, 4, 16), torch.zeros(3, 4, 16, dtype=torch.float64))
    k = torch.zeros(num_keys, 2, 16)
    with pytest.raises(ValueError, match="v: expected the shape of k"):
        align_kv(k, k[:, :1], cu_k, tables)
    pool = torch.zeros(tables.workspace_rows, 2, 16)
    with pytest.raises(TypeError, match="dk_accum: expected an fp32 tensor"):
        finish_gradients(torch.zeros(3, 4, 16), pool.double(), pool, cu_k, tables)


# ---------------------------------------------------------------------------------------------
# CPU with the CuTe DSL: compile checks and launch signatures
# ---------------------------------------------------------------------------------------------


def _cubin_sm(cubin: bytes) -> int:
    """The SM number a CUDA cubin is built for, from its ELF header.

    CUDA ELF ABI version 7 keeps the SM in the low byte of `e_flags` (90 for sm_90a); version 8
    (sm_100 onwards) in the second byte.
    """
    flags = struct.unpack_from("<I", cubin, 0x30)[0]
    return (flags >> 8) & 0xFF if cubin[8] >= 8 else flags & 0xFF


def _compile_all(arch: str, dump_dir: str) -> dict:
    from torch_msa.sm100 import postprocess, preprocess, task_tables

    return {
        **preprocess.compile_for_target(arch, dump_dir),
        **task_tables.compile_for_target(arch, dump_dir),
        **postprocess.compile_for_target(arch, dump_dir),
    }


@requires_cute
@pytest.mark.parametrize("arch", ARCHES)
def test_every_kernel_compiles_for(arch, tmp_path):
    with deprecated_dsl_use_is_an_error():
        compiled = _compile_all(arch, str(tmp_path))
    assert sorted(compiled) == ["align_kv", "cast_dq", "delta", "delta_grad_lse", "task_tables", "unalign_dk_dv"]
    for name, kernel in compiled.items():
        cubin = kernel.artifacts.CUBIN
        assert isinstance(cubin, bytes) and cubin[:4] == b"\x7fELF", name
        assert _cubin_sm(cubin) == int(arch[3:-1]), f"{name}: cubin is for sm_{_cubin_sm(cubin)}, not {arch}"


@requires_cute
def test_compiled_kernels_refuse_arguments_they_cannot_read():
    """The launches pass torch tensors as they are (`cute_io`): the compiled function itself
    refuses, before any launch and naming the argument, a tensor of another dtype, rank or inner
    extent, non-contiguous rows, a base less aligned than `row_alignment` assumes, a leading
    extent past int32, a tensor where `None` was compiled or the reverse, and integer scalars
    that are not int32."""
    from tests.support.cute_dsl import assert_refused, device_argument
    from torch_msa.cute_dsl.cute_io import launcher
    from torch_msa.sm100.postprocess import compile_finish_kernel
    from torch_msa.sm100.preprocess import compile_delta_kernel

    rows, bf16 = 37, torch.bfloat16
    delta = launcher(compile_delta_kernel(bf16, 128, True))
    good = [torch.zeros(rows, 128, dtype=bf16), torch.zeros(rows, 128, dtype=bf16), torch.zeros(rows), torch.zeros(rows)]
    huge = torch.zeros(1, 128, dtype=bf16, device="cuda" if torch.cuda.is_available() else "cpu").expand(2**31, 128)
    cases = [
        (0, torch.zeros(rows, 128, dtype=torch.float16), "expected dtype=bfloat16"),
        (0, torch.zeros(rows, 1, 128, dtype=bf16), "expected ndim=2"),
        (1, torch.zeros(rows, 64, dtype=bf16), "grad_out.shape[1] on argument #1"),
        (1, torch.zeros(rows, 256, dtype=bf16)[:, :128], "grad_out.strides[0] on argument #1"),
        (0, torch.zeros(rows * 128 + 1, dtype=bf16)[1:].view(rows, 128), "expected data alignment=16 bytes"),
        (0, huge, "int32 range"),
        (2, None, "expected Tensor"),
    ]
    for position, bad, message in cases:
        args = [device_argument(x) for x in good]
        args[position] = None if bad is None else device_argument(bad)
        assert_refused(delta, args, position, message)
    without_grad_lse = launcher(compile_delta_kernel(bf16, 128, False))
    assert_refused(without_grad_lse, [device_argument(x) for x in good], 2, "expected None")

    unalign = launcher(compile_finish_kernel(bf16, 512, True))
    pools = [torch.zeros(128, 512), torch.zeros(128, 512, dtype=bf16)] * 2
    documents = [torch.tensor([0, 100], dtype=torch.int32), torch.tensor([0, 128], dtype=torch.int32)]
    for num_keys, message in ((2**31, "int32 range"), (1.5, "Mismatched type")):
        assert_refused(unalign, [*(device_argument(x) for x in pools + documents), num_keys], 6, message)


# ---------------------------------------------------------------------------------------------
# The table-consuming Triton backward against the reference
# ---------------------------------------------------------------------------------------------


class TorchPipeline:
    """The neutral stages as plain torch (any device)."""

    build_tasks = staticmethod(tables_torch)
    align_kv = staticmethod(align_kv_torch)
    prepare_delta = staticmethod(delta_torch)
    finish_gradients = staticmethod(finish_torch)


class CutePipeline:
    """The neutral stages as the CuTe DSL kernels (CUDA)."""

    @staticmethod
    def build_tasks(*args):
        from torch_msa.sm100.task_tables import build_tasks

        return build_tasks(*args)

    @staticmethod
    def align_kv(*args):
        from torch_msa.sm100.task_tables import align_kv

        return align_kv(*args)

    @staticmethod
    def prepare_delta(*args):
        from torch_msa.sm100.preprocess import prepare_delta

        return prepare_delta(*args)

    @staticmethod
    def finish_gradients(*args):
        from torch_msa.sm100.postprocess import finish_gradients

        return finish_gradients(*args)


def check_consumer_against_reference(pipeline, layout, heads, dim, block_size, topk, dtype, device):
    """Run select -> forward (reference) -> the neutral stages of `pipeline` + the Triton task
    consumer, and compare dq, dk, dv with `reference.backward` on fp32 copies of the inputs.

    The consumer computes in fp32 (exact products of the 16-bit inputs, fp32 accumulation), so
    the fp32 results must agree with the fp32 reference to accumulation-order noise; the
    `dtype` results must be exactly their rounding.
    """
    from tests.support.triton_task_consumer import consume_tasks

    num_heads, num_kv_heads = heads
    block_indices, cu_q, cu_k, num_keys = _selection(layout, num_kv_heads, topk, block_size, device)
    num_queries = int(cu_q[-1])
    generator = torch.Generator().manual_seed(1)

    def tensor(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    q, grad_out = tensor(num_queries, num_heads, dim), tensor(num_queries, num_heads, dim)
    k, v = tensor(num_keys, num_kv_heads, dim), tensor(num_keys, num_kv_heads, dim)
    grad_lse = torch.randn(num_queries, num_heads, generator=generator).to(device)
    max_q, max_k = max(map(int, cu_q.diff())), max(map(int, cu_k.diff()))
    scale = dim**-0.5
    docs = (cu_q, cu_k, max_q, max_k)
    out, lse = reference.forward(*backend_arguments("forward", q, k, v, block_indices, *docs, block_size, scale))
    want = reference.backward(*backend_arguments("backward", grad_out.float(), q.float(), k.float(), v.float(), out.float(),
                                                 lse, block_indices, *docs, block_size, scale, grad_lse))

    tables = pipeline.build_tasks(block_indices, cu_q, cu_k, num_keys, block_size)
    k_ws, v_ws = pipeline.align_kv(k, v, cu_k, tables)
    delta = pipeline.prepare_delta(out, grad_out, grad_lse)
    pools = consume_tasks(q, k_ws, v_ws, grad_out, lse, delta, tables, scale, block_size)
    got = pipeline.finish_gradients(*pools, cu_k, tables, torch.float32)
    rounded = pipeline.finish_gradients(*pools, cu_k, tables, dtype)
    for name, got_grad, want_grad, rounded_grad in zip(("dq", "dk", "dv"), got, want, rounded):
        scale_of = want_grad.abs().max().item()
        # A key block missed or counted twice moves a gradient by percents of its scale.
        torch.testing.assert_close(got_grad, want_grad, atol=5e-5 * scale_of, rtol=1e-3,
                                   msg=lambda m, name=name: f"{name}: {m}")
        assert torch.equal(rounded_grad, got_grad.to(dtype)), f"{name}: the {dtype} result is not the rounded fp32 one"


# Small enough for the interpreter: G = 2 heads per KV head (16-row tiles), D = 16, 16-key blocks.
INTERPRETER_LAYOUT = ([40, 0, 23, 1], [40, 5, 50, 17])


def run_consumer_under_interpreter():
    """Entry point of the interpreter subprocess (TRITON_INTERPRET=1 must precede importing triton).

    fp16 stands in for bf16 to cover the 16-bit operand path: the Triton 3.8 interpreter keeps
    bf16 as raw uint16 and its `tl.dot` of bf16 operands returns garbage.
    """
    for dtype in (torch.float32, torch.float16):
        check_consumer_against_reference(TorchPipeline, INTERPRETER_LAYOUT, (4, 2), 16, 16, 3, dtype, "cpu")


def test_task_consumer_under_the_triton_interpreter():
    pytest.importorskip("triton", reason=install.TRITON)
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    script = "import tests.sm100.test_task_kernels as t; t.run_consumer_under_interpreter(); print('consumer ok')"
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0 and "consumer ok" in result.stdout, (result.stdout + result.stderr)[-4000:]


# ---------------------------------------------------------------------------------------------
# CUDA: the CuTe kernels on hardware (the neutral ones run on an H200 as sm_90a)
# ---------------------------------------------------------------------------------------------

M3_LAYOUT = ([1000, 3000, 77, 500], [1000, 3000, 77, 1300])  # the last document has Lq < Lk


@requires_cute
@pytest.mark.cuda
@pytest.mark.parametrize("with_grad_lse", [False, True], ids=["delta", "delta_grad_lse"])
def test_cute_delta_matches_torch(with_grad_lse, monkeypatch):
    from torch_msa.sm100.preprocess import prepare_delta

    forbid_python_conversions(monkeypatch)
    out, grad_out = torch.randn(2, 4577, 64, 128, device="cuda").to(torch.bfloat16).unbind(0)
    grad_lse = torch.randn(4577, 64, device="cuda") if with_grad_lse else None
    got = prepare_delta(out, grad_out, grad_lse)
    assert got.dtype == torch.float32 and got.shape == (4577, 64)
    torch.testing.assert_close(got, delta_torch(out, grad_out, grad_lse), atol=1e-4, rtol=1e-5)
    assert prepare_delta(out[:0], grad_out[:0]).shape == (0, 64)


@requires_cute
@pytest.mark.cuda
@pytest.mark.parametrize("case", ["m3", "pack64", "suffix_bad_ids", "no_documents"])
def test_cute_tables_align_and_finish_match_torch(case, monkeypatch):
    from torch_msa.sm100.postprocess import finish_gradients
    from torch_msa.sm100.task_tables import align_kv, build_tasks

    forbid_python_conversions(monkeypatch)
    layout, num_kv_heads, topk, block_size, bad = {
        "m3": (M3_LAYOUT, 4, 16, 128, False),
        "pack64": ("pack", 2, 3, 64, False),
        "suffix_bad_ids": ("suffix", 2, 5, 128, True),
        "no_documents": (([], []), 2, 3, 128, False),
    }[case]
    if case == "no_documents":
        block_indices = torch.empty(num_kv_heads, 0, topk, dtype=torch.int32, device="cuda")
        cu_q = cu_k = torch.zeros(1, dtype=torch.int32, device="cuda")
        num_keys = 0
    else:
        block_indices, cu_q, cu_k, num_keys = _selection(layout, num_kv_heads, topk, block_size, "cuda", bad)
    tables = build_tasks(block_indices, cu_q, cu_k, num_keys, block_size)
    _assert_tables_equal(tables, tables_torch(block_indices, cu_q, cu_k, num_keys, block_size))

    k, v = torch.randn(2, num_keys, num_kv_heads, 128, device="cuda").to(torch.bfloat16).unbind(0)
    k_ws, v_ws = align_kv(k, v, cu_k, tables)
    for got, want in zip((k_ws, v_ws), align_kv_torch(k, v, cu_k, tables)):
        assert torch.equal(got, want)

    num_queries = block_indices.shape[1]
    dq_accum = torch.randn(num_queries, 16, 128, device="cuda")
    dk_accum, dv_accum = torch.randn(2, tables.workspace_rows, num_kv_heads, 128, device="cuda").unbind(0)
    for dtype in (torch.bfloat16, torch.float32):
        got = finish_gradients(dq_accum, dk_accum, dv_accum, cu_k, tables, dtype)
        want = finish_torch(dq_accum, dk_accum, dv_accum, cu_k, tables, dtype)
        for name, got_grad, want_grad in zip(("dq", "dk", "dv"), got, want):
            assert got_grad.dtype == dtype and torch.equal(got_grad, want_grad), name


@requires_cute
@pytest.mark.cuda
def test_consumer_of_cute_tables_matches_reference_at_m3_shapes():
    """Hq=64, Hkv=4, D=128, block 128, top-16, bf16; documents of 1000, 3000, 77 tokens and one
    with 500 queries over 1300 keys."""
    check_consumer_against_reference(CutePipeline, M3_LAYOUT, (64, 4), 128, 128, 16, torch.bfloat16, "cuda")
