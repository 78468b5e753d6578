"""The SM100 main backward kernel (`torch_msa/sm100/backward_kernel.py`, launched by `backward_host.py`).

No SM100 GPU is reachable from CI, so what CI proves, with the oldest and the newest served CuTe
DSL release (`.ci/run` runs this file with both), is that the kernel *lowers* for `sm_100a` on a
CPU host: the CuTe DSL traces it, NVVM emits PTX and ptxas assembles a cubin, and the
machine code holds what the design says (tcgen05 MMAs and TMEM traffic, TMA loads, vector fp32
atomics). Also on any host: the module imports without the CuTe DSL, and the kernel is compiled
for the operand table its launch checks.

Whether the kernel computes the right gradients is checked only on a compute capability 10.0
GPU (`test_run_backward_matches_reference_on_sm100`, skipped everywhere else).
"""

import re
from pathlib import Path

import pytest
import torch

from tests.support.cute_dsl import (
    assert_imports_without,
    deprecated_dsl_use_is_an_error,
    requires_cute,
    skip_without_nvdisasm,
)
from tests.support.documents import backend_arguments
from torch_msa import reference
from torch_msa.testing import cu_seqlens, random_block_indices, skewed_block_indices

requires_sm100 = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (10, 0)),
    reason="needs a GPU of compute capability 10.0 (B200 / GB200)",
)

# What one compiled task loop must contain (the loop body is emitted once):
GEMMS = 5  # S^T, dP^T, dV, dK, dQ
K_STEPS = 128 // 16  # K = 128 in steps of the bf16 MMA's K = 16
TMA_BOXES = 2 + 2 + 8 * 2 + 8 * 2  # K, V tiles (two 64-column boxes each); 8 token slots of Q, dO
ATOMIC_VECTORS = 3 * 128 // 4  # one row of dQ, dV and dK per thread, 4 fp32 per red.v4


@pytest.fixture(scope="module")
def sm100_build(tmp_path_factory):
    """Compile once for sm_100a with the PTX and SASS listings kept; returns the kernel and the
    dump folder. A deprecated CuTe DSL name used by the kernel fails the compile."""
    from torch_msa.sm100.backward_host import compile_main_kernel

    skip_without_nvdisasm()
    dump_dir = tmp_path_factory.mktemp("sm100")
    with deprecated_dsl_use_is_an_error():
        kernel = compile_main_kernel("sm_100a", str(dump_dir), listings=True)
    return kernel, dump_dir


def _listing(dump_dir: Path, suffix: str) -> str:
    (path,) = dump_dir.glob(f"*{suffix}")
    return path.read_text()


@requires_cute
def test_main_kernel_lowers_to_an_sm100a_cubin(sm100_build):
    kernel, dump_dir = sm100_build
    cubin = kernel.artifacts.CUBIN
    assert isinstance(cubin, bytes) and cubin[:4] == b"\x7fELF"
    assert ".target sm_100a" in _listing(dump_dir, ".ptx")


@requires_cute
def test_ptx_has_the_five_tcgen05_gemms_tmem_and_atomics(sm100_build):
    _, dump_dir = sm100_build
    ptx = _listing(dump_dir, ".ptx")
    assert len(re.findall(r"tcgen05\.mma\.cta_group::1\.kind::f16", ptx)) == GEMMS * K_STEPS
    for instruction in ("tcgen05.alloc", "tcgen05.dealloc", "tcgen05.ld", "tcgen05.st", "tcgen05.commit"):
        assert instruction in ptx, instruction
    assert ptx.count("cp.async.bulk.tensor") == TMA_BOXES
    assert ptx.count("red.global.add.v4.f32") == ATOMIC_VECTORS
    # Warp specialisation: the MMA/load warpgroup gives registers to the math warpgroups.
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx


@requires_cute
def test_sass_issues_tensor_core_mmas_from_tmem(sm100_build):
    _, dump_dir = sm100_build
    sass = _listing(dump_dir, ".sass")
    assert len(re.findall(r"\bUTCHMMA\b", sass)) == GEMMS * K_STEPS
    assert len(re.findall(r"\bUTMALDG\.[23]D\b", sass)) == TMA_BOXES
    assert len(re.findall(r"\bREDG\.E\.ADD\.F32x4\b", sass)) == ATOMIC_VECTORS
    # The per-warpgroup register budgets leave ptxas nothing to spill to local memory, with the
    # oldest and the newest served CuTe DSL alike (their compilers place the MMA warp's hoisted
    # shared-memory descriptors differently; .ci/run compiles with both).
    assert not re.findall(r"\b(STL|LDL)\b", sass)


@requires_cute
def test_the_main_kernel_is_compiled_for_its_operand_table(monkeypatch):
    """`compile_main_kernel` compiles for `OPERANDS` in order (the table `launch_main` checks its
    tensors against and passes them by), its two scalars and the environment's stream, with the
    TVM-FFI calling convention: the compiled function takes the checked torch tensors as they are."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import _FakeStream

    from torch_msa.cute_dsl.cute_io import cutlass_dtype
    from torch_msa.sm100.backward_host import OPERANDS, compile_main_kernel

    compiles = []
    monkeypatch.setattr(cute, "compile", lambda kernel, *args, options="": compiles.append((args, options)))
    compile_main_kernel()
    ((*tensors, grid, scale, stream), options), = compiles
    assert [(t.element_type, tuple(t.shape[1:])) for t in tensors] == [
        (cutlass_dtype(dtype), inner) for _, dtype, _, inner in OPERANDS]
    assert (type(grid).__name__, type(scale).__name__) == ("Int32", "Float32")
    assert isinstance(stream, _FakeStream) and stream.use_tvm_ffi_env_stream
    assert "--enable-tvm-ffi" in options


def test_module_imports_without_the_cute_dsl():
    assert_imports_without("import torch_msa.sm100.backward_host as module\n"
                           "assert callable(module.run_backward) and callable(module.launch_main)", ("cutlass",))


def _launch_inputs(num_queries=8, max_tasks=3, rows=128):
    from torch_msa.sm100.task_tables import TaskTables

    def zeros(*shape, dtype=torch.float32):
        return torch.zeros(*shape, dtype=dtype)

    index = torch.int32
    fields = {
        "task_meta": zeros(max_tasks, 4, dtype=index), "task_qrows": zeros(max_tasks, 8, dtype=index),
        "task_qpos": zeros(max_tasks, 8, dtype=index), "num_tasks": zeros(1, dtype=index), "workspace_rows": rows,
    }
    # Fields launch_main does not read (document bookkeeping) get placeholders.
    tables = TaskTables(**{name: fields.get(name, 0) for name in TaskTables._fields})
    q = zeros(num_queries, 64, 128, dtype=torch.bfloat16)
    k_ws = zeros(rows, 4, 128, dtype=torch.bfloat16)
    return {
        "q": q, "k_ws": k_ws, "v_ws": k_ws.clone(), "grad_out": q.clone(), "lse": zeros(num_queries, 64),
        "delta": zeros(num_queries, 64), "tables": tables, "dq_accum": zeros(num_queries, 64, 128),
        "dk_accum": zeros(rows, 4, 128), "dv_accum": zeros(rows, 4, 128), "softmax_scale": 128**-0.5,
    }


@pytest.mark.parametrize(
    "name, bad, message",
    [
        ("lse", torch.zeros(8, 64, dtype=torch.float16), r"lse: expected torch.float32 \[8, 64\]"),
        ("k_ws", torch.zeros(256, 4, 128, dtype=torch.bfloat16), r"k_ws: expected torch.bfloat16 \[128, 4, 128\]"),
        ("dq_accum", torch.zeros(8, 128, 64).transpose(1, 2), "dq_accum: expected a contiguous tensor"),
        ("q", torch.zeros(8, 64, 128, dtype=torch.bfloat16), "q: expected q's CUDA device"),
    ],
)
def test_launch_main_names_the_bad_argument(name, bad, message):
    from torch_msa.sm100.backward_host import launch_main

    inputs = _launch_inputs()
    inputs[name] = bad
    with pytest.raises(ValueError, match=message):
        launch_main(**inputs)


@requires_cute
@pytest.mark.cuda
@requires_sm100
@pytest.mark.parametrize("selection", ["random", "skewed"])
def test_run_backward_matches_reference_on_sm100(selection):
    """M3 shapes (Hq=64, Hkv=4, D=128, block 128, top-16, bf16) against the fp32 reference, with
    grad_lse, partial blocks, a document with Lq < Lk and, for `skewed`, block 0 read by every
    query (its bucket is split over several CTAs, so segments of one bucket meet in the atomics)."""
    from torch_msa.sm100.backward_host import run_backward

    q_lens, k_lens = [1000, 3000, 77, 500], [1000, 3000, 77, 1300]
    cu_q, cu_k = cu_seqlens(q_lens, k_lens, device="cuda")
    make_blocks = random_block_indices if selection == "random" else skewed_block_indices
    block_indices = make_blocks(cu_q, cu_k, 4, 16, 128).cuda()
    generator = torch.Generator().manual_seed(2)

    def tensor(*shape):
        return torch.randn(*shape, generator=generator).to("cuda", torch.bfloat16)

    num_queries, num_keys = sum(q_lens), sum(k_lens)
    q, grad_out = tensor(num_queries, 64, 128), tensor(num_queries, 64, 128)
    k, v = tensor(num_keys, 4, 128), tensor(num_keys, 4, 128)
    grad_lse = torch.randn(num_queries, 64, generator=generator).cuda()
    docs = (cu_q, cu_k, max(q_lens), max(k_lens))
    scale = 128**-0.5
    out, lse = reference.forward(*backend_arguments("forward", q, k, v, block_indices, *docs, 128, scale))
    want = reference.backward(*backend_arguments("backward", grad_out.float(), q.float(), k.float(), v.float(), out.float(),
                                                 lse, block_indices, *docs, 128, scale, grad_lse))
    got = run_backward(q, k, v, grad_out, out, lse, block_indices, *docs, scale, grad_lse)
    for name, got_grad, want_grad in zip(("dq", "dk", "dv"), got, want):
        assert got_grad.dtype == torch.bfloat16 and got_grad.shape == want_grad.shape, name
        error = (got_grad.float() - want_grad).norm() / want_grad.norm()
        # P and dS enter the tensor cores as bf16: errors of about 2^-8 relative, not percents
        # (a key block missed or counted twice moves the gradient by percents).
        assert error < 1e-2, f"{name}: relative error {error:.2e}"
        torch.testing.assert_close(got_grad.float(), want_grad, atol=3e-2 * want_grad.abs().max().item(), rtol=5e-2)
