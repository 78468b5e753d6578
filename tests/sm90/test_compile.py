"""The SM90 kernels (`torch_msa/sm90/forward_kernel.py`, `backward_kernel.py`) on a host without a GPU.

CI proves, with the oldest and the newest served CuTe DSL release (`.ci/run` runs this file with
both), that the kernels *lower* for `sm_90a`: the CuTe DSL traces them, NVVM emits PTX and
ptxas assembles a cubin, and the machine code holds what the design says (the forward: a producer
and two consumer warpgroups with their register split, wgmma from shared memory for `Q K^T` and
from registers for `P V`, kept asynchronous, TMA loads and stores; the backward: five
wgmma GEMMs, dQ by bulk reduce-add, dK/dV by vector atomics; neither spills to local memory).
Also on any host: the modules import without the CuTe DSL and the backend declines
configurations it does not serve; what each launch passes is `tests/sm90/test_host_path.py`'s.
Whether the kernels compute the right result is checked on a compute capability 9.0 GPU
(`tests/sm90/test_forward.py`, `tests/sm90/test_backward.py`).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.cute_dsl import assert_imports_without, requires_cute, skip_without_nvdisasm
from torch_msa.backends import UnsupportedInputs

REPO_ROOT = Path(__file__).resolve().parents[2]

K_STEPS = 128 // 16  # K = 128 (dims for Q K^T, keys for P V) in steps of the 16-bit wgmma's K = 16
# The forward issues each GEMM at two sites: Q K^T for an item's first tile and with the pending
# tile's P V; P V there and for the item's last tile.
FORWARD_GEMM_SITES = 2
# TMA loads in the compiled loop: K and V tiles (two 64-column boxes each) once per item, and a
# Q tile of 4 tokens (two boxes each) per tile.
TMA_LOADS = 2 * 2 + 4 * 2
# TMA stores: a warp's token (two boxes), where a pending tile's output is written and where the
# item's last is.
TMA_STORES = 2 * 2
# wgmma waits: after an item's first Q K^T; after the pending tile's P V and after the next Q K^T;
# after the item's last P V. ptxas keeps the wgmmas asynchronous only when it can prove that
# every accumulator read follows its wait; otherwise it waits after every wgmma.
FORWARD_WGMMA_WAITS = 4
# The producer warpgroup gives registers to the two consumer warpgroups.
PRODUCER_REGISTERS, CONSUMER_REGISTERS = 24, 240


# The backward per tile: S^T = K Q^T and dP^T = V dO^T (64 x 64 per warpgroup, K = 128 dims),
# dV and dK (64 x 128, K = 64 rows, A from registers), dQ = dS K (64 x 64, K = 128 keys).
BACKWARD_SS_STEPS = 3 * K_STEPS
BACKWARD_RS_STEPS = 2 * (64 // 16)
# TMA loads: K and V once per item (two boxes each); Q and dO of 4 tokens (two boxes each) at the
# item's start and for the next tile.
BACKWARD_TMA_LOADS = 2 * 2 + 2 * 2 * 4 * 2
# dQ: one bulk reduce-add per warp (its token's 16 heads x 64 dims); dK and dV: a thread's 2 key
# rows x 32 dims of each, two dims per atomic.
BACKWARD_BULK_REDUCES = 1
BACKWARD_VECTOR_ATOMICS = 2 * 2 * 32 // 2
# dS^T: a thread's 64 keys x 64 rows share (32 values) as four x4 transposing matrix stores.
DS_MATRIX_STORES = 4


def _build(tmp_path_factory, module: str, options: str = "", function: str = "compile_blocks_kernel"):
    """Compile `module`'s blocks kernel once for sm_90a (bf16, Hkv = 4, keyword `options`) with the
    cubin, PTX and SASS kept; returns the dump folder. The CuTe DSL writes SASS only for the
    architecture named by `CUTE_DSL_ARCH` when it is imported, so the compile runs in a fresh
    interpreter with it set (and with this interpreter's module path, which may put another
    CuTe DSL release first). A deprecated CuTe DSL name used by the kernel fails the compile."""
    skip_without_nvdisasm()
    dump_dir = tmp_path_factory.mktemp(module)
    code = (
        "import sys, torch\n"
        "from tests.support.cute_dsl import deprecated_dsl_use_is_an_error\n"
        f"from torch_msa.sm90.{module} import {function}\n"
        "with deprecated_dsl_use_is_an_error():\n"
        f"    {function}(torch.bfloat16, 4, 'sm_90a', sys.argv[1], listings=True, {options})\n"
    )
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    environment = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "PYTHONPATH": path}
    result = subprocess.run(
        [sys.executable, "-c", code, str(dump_dir)], capture_output=True, text=True, timeout=300, env=environment
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return dump_dir


@pytest.fixture(scope="module")
def sm90_build(tmp_path_factory):
    return _build(tmp_path_factory, "forward_host")


@pytest.fixture(scope="module")
def sm90_groups_build(tmp_path_factory):
    return _build(tmp_path_factory, "forward_host", function="compile_groups_kernel")


@pytest.fixture(scope="module")
def sm90_backward_build(tmp_path_factory):
    return _build(tmp_path_factory, "backward_host")


@pytest.fixture(scope="module")
def sm90_deterministic_build(tmp_path_factory):
    return _build(tmp_path_factory, "backward_host", "deterministic=True")


@pytest.fixture(scope="module")
def sm90_teacher_build(tmp_path_factory):
    return _build(tmp_path_factory, "backward_host", "emit_teacher=True")


def _listing(dump_dir: Path, suffix: str) -> str:
    (path,) = dump_dir.glob(f"*{suffix}")
    return path.read_text()


@requires_cute
def test_blocks_kernel_lowers_to_an_sm90a_cubin(sm90_build):
    dump_dir = sm90_build
    (cubin,) = dump_dir.glob("*.sm_90a.cubin")
    assert cubin.read_bytes()[:4] == b"\x7fELF"
    assert ".target sm_90a" in _listing(dump_dir, ".ptx")


@requires_cute
def test_ptx_has_both_wgmmas_and_the_tma_copies(sm90_build):
    dump_dir = sm90_build
    ptx = _listing(dump_dir, ".ptx")
    qk = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16 \{[^}]*\}, %rd\d+, %rd\d+,", ptx)
    pv = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16 \{[^}]*\}, \{[^}]*\}, %rd\d+,", ptx)
    assert len(qk) == FORWARD_GEMM_SITES * K_STEPS, "Q K^T: both operands from shared memory"
    assert len(pv) == FORWARD_GEMM_SITES * K_STEPS, "P V: P from registers"
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global", ptx)) == TMA_LOADS
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta", ptx)) == TMA_STORES
    # V rows past a document's end are zeroed by ordinary stores that the tensor cores read next.
    assert "fence.proxy.async.shared::cta" in ptx


@pytest.mark.parametrize(
    "build, kv_stages, tile_stages, arm_sites, release_sites",
    [("sm90_build", 2, 4, 2, 3), ("sm90_backward_build", 1, 2, 3, 2)],
)
@requires_cute
def test_loads_run_on_two_pipelines_with_full_and_empty_barriers(
    build, kv_stages, tile_stages, arm_sites, release_sites, request
):
    """`sm90/pipeline.py`: K/V and the token tiles, each stage with a full and an empty barrier; the
    producer arms a full barrier with the TMA's bytes (the forward: K/V and each tile; the
    backward: K/V, an item's first tile and the next tile) and every consumer warp releases a stage
    by a plain arrive on its empty barrier (the forward: a tile's Q stage at its two `Q K^T` sites
    and the item's K/V; the backward: the tile's stage and the item's K/V)."""
    ptx = _listing(request.getfixturevalue(build), ".ptx")
    assert ptx.count("mbarrier.init.shared.b64") == 2 * (kv_stages + tile_stages)
    assert ptx.count("mbarrier.arrive.expect_tx.shared.b64") == arm_sites
    assert ptx.count("mbarrier.arrive.shared.b64") == release_sites


@requires_cute
def test_forward_is_warp_specialised_with_asynchronous_wgmmas(sm90_build):
    """Three warpgroups: the producer gives up registers, the consumers take them; the wgmmas are
    waited for only where the code waits (no serialisation by ptxas)."""
    ptx, sass = _listing(sm90_build, ".ptx"), _listing(sm90_build, ".sass")
    assert ".reqntid 384, 1, 1" in ptx
    assert re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+)", ptx) == [str(PRODUCER_REGISTERS)]
    assert re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)", ptx) == [str(CONSUMER_REGISTERS)]
    assert len(re.findall(r"\bWARPGROUP\.DEPBAR\b", sass)) == FORWARD_WGMMA_WAITS


@requires_cute
def test_sass_has_hgmma_and_no_spills(sm90_build):
    sass = _listing(sm90_build, ".sass")
    assert len(re.findall(r"\bHGMMA\.64x128x16\.F32\.BF16\b", sass)) == 2 * FORWARD_GEMM_SITES * K_STEPS
    assert len(re.findall(r"\bUTMALDG\.[23]D\b", sass)) == TMA_LOADS
    assert len(re.findall(r"\bUTMASTG\.[23]D\b", sass)) == TMA_STORES
    assert not re.findall(r"\b(STL|LDL)\b", sass)


@requires_cute
def test_backward_ptx_has_its_gemms_bulk_reduces_and_atomics(sm90_backward_build):
    ptx = _listing(sm90_backward_build, ".ptx")
    assert ".target sm_90a" in ptx
    ss = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.bf16\.bf16 \{[^}]*\}, %rd\d+, %rd\d+,", ptx)
    rs = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16 \{[^}]*\}, \{[^}]*\}, %rd\d+,", ptx)
    assert len(ss) == BACKWARD_SS_STEPS, "S^T, dP^T and dQ: both operands from shared memory"
    assert len(rs) == BACKWARD_RS_STEPS, "dV and dK: P^T and dS^T from registers"
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global", ptx)) == BACKWARD_TMA_LOADS
    bulk = "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32"
    assert ptx.count(bulk) == BACKWARD_BULK_REDUCES
    assert ptx.count("red.global.add.v2.f32") == BACKWARD_VECTOR_ATOMICS
    # dS^T leaves the accumulators by transposing matrix stores, not 32 scalar 16-bit stores.
    assert ptx.count("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16") == DS_MATRIX_STORES
    # No scalar atomics: dQ leaves by the bulk reduce only.
    assert not re.findall(r"\b(atom|red)\.global(\.\w+)*\.add\.f32\b", ptx)


@requires_cute
def test_backward_sass_has_hgmma_and_no_spills(sm90_backward_build):
    sass = _listing(sm90_backward_build, ".sass")
    assert len(re.findall(r"\bHGMMA\.64x64x16\.F32\.BF16\b", sass)) == BACKWARD_SS_STEPS
    assert len(re.findall(r"\bHGMMA\.64x128x16\.F32\.BF16\b", sass)) == BACKWARD_RS_STEPS
    assert len(re.findall(r"\bUBLKRED\.G\.S\.ADD\.F32\b", sass)) == BACKWARD_BULK_REDUCES
    assert not re.findall(r"\b(STL|LDL)\b", sass)


# The deterministic variant rounds each of a thread's dQ values to an integer: its warpgroup's
# 64 x 64 share over 128 threads (2 rows x 16 dims each).
DQ_ROUNDINGS = 64 * 64 // 128


@requires_cute
def test_deterministic_backward_adds_dq_in_fixed_point_and_stores_dk_dv(sm90_deterministic_build):
    """The variant that serves deterministic mode: the default's five GEMMs; dQ rounded to int32
    (round to nearest) and added by the integer bulk reduce, whose sums do not depend on the
    order; dK/dV stored, never added."""
    ptx = _listing(sm90_deterministic_build, ".ptx")
    ss = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.bf16\.bf16 \{[^}]*\}, %rd\d+, %rd\d+,", ptx)
    rs = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16 \{[^}]*\}, \{[^}]*\}, %rd\d+,", ptx)
    assert (len(ss), len(rs)) == (BACKWARD_SS_STEPS, BACKWARD_RS_STEPS)
    assert ptx.count("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.u32") == BACKWARD_BULK_REDUCES
    assert ptx.count("cp.reduce.async.bulk") == BACKWARD_BULK_REDUCES
    assert ptx.count("cvt.rni.s32.f32") == DQ_ROUNDINGS
    assert not re.findall(r"\b(atom|red)\.", ptx)
    sass = _listing(sm90_deterministic_build, ".sass")
    # The integer add is the instruction's unsuffixed form.
    assert re.findall(r"\bUBLKRED\.G\.S\.ADD[.\w]*", sass) == ["UBLKRED.G.S.ADD"] * BACKWARD_BULK_REDUCES
    assert not re.findall(r"\b(STL|LDL)\b", sass)


# The teacher per tile: each thread's 2 key rows x 4 tokens, each a quad sum of two butterfly
# shuffles; a thread stores its own token's sums, one fp16 store per key row.
TEACHER_SHUFFLES = 2 * 4 * 2
TEACHER_STORES = 2


@requires_cute
def test_teacher_variant_adds_its_shuffles_and_fp16_stores_and_no_gemm(sm90_backward_build, sm90_teacher_build):
    """`emit_teacher=True`: the default backward plus the teacher's reduction (quad shuffles) and
    its 2-byte global stores; the same GEMMs, bulk reduces and atomics, and no spills."""
    plain, teacher = _listing(sm90_backward_build, ".ptx"), _listing(sm90_teacher_build, ".ptx")
    for pattern in (r"wgmma\.mma_async", r"cp\.reduce\.async\.bulk", r"red\.global\.add\.v2\.f32"):
        assert len(re.findall(pattern, teacher)) == len(re.findall(pattern, plain)), pattern
    shuffles = r"shfl\.sync\.bfly\.b32"
    assert len(re.findall(shuffles, teacher)) - len(re.findall(shuffles, plain)) == TEACHER_SHUFFLES
    b16_stores = r"st\.global\.(\w+\.)?b16"
    assert len(re.findall(b16_stores, teacher)) - len(re.findall(b16_stores, plain)) == TEACHER_STORES
    assert not re.findall(r"\b(STL|LDL)\b", _listing(sm90_teacher_build, ".sass"))


def test_query_rows_beyond_32_bit_indices_are_declined():
    from torch_msa.sm90.backward_host import check_query_rows

    check_query_rows(2**25 - 1, 64)
    with pytest.raises(UnsupportedInputs, match="32-bit integers: 33554432 queries x 64 heads"):
        check_query_rows(2**25, 64)


def test_module_imports_without_the_cute_dsl():
    # The package registers the backend and imports neither; its host modules run the Triton stages.
    assert_imports_without("import torch_msa.sm90", ("cutlass", "triton"))
    assert_imports_without("import torch_msa.sm90.common, torch_msa.sm90.forward_host, torch_msa.sm90.backward_host",
                           ("cutlass",))


@pytest.mark.parametrize(
    "q_shape, kv_shape, dtype, block_size, message",
    [
        ((8, 32, 128), (8, 4, 128), torch.bfloat16, 128, "16 query heads per KV head"),
        ((8, 64, 64), (8, 4, 64), torch.bfloat16, 128, "D=128"),
        ((8, 64, 128), (8, 4, 128), torch.bfloat16, 64, "block_size=128"),
        ((8, 64, 128), (8, 4, 128), torch.float32, 128, "bf16 or all fp16"),
    ],
)
def test_unserved_inputs_are_declined(q_shape, kv_shape, dtype, block_size, message):
    from torch_msa.sm90.common import check_served

    q, k = torch.zeros(q_shape, dtype=dtype), torch.zeros(kv_shape, dtype=dtype)
    with pytest.raises(UnsupportedInputs, match=message):
        check_served(q, k, k, block_size)


def test_mixed_dtypes_are_declined():
    from torch_msa.sm90.common import check_served

    q, k = torch.zeros(8, 64, 128, dtype=torch.bfloat16), torch.zeros(8, 4, 128, dtype=torch.float16)
    with pytest.raises(UnsupportedInputs, match="bf16 or all fp16"):
        check_served(q, k, k, 128)


def test_partial_rows_beyond_32_bit_indices_are_declined():
    """The partial outputs move by TMA (64-bit addresses), so 16K queries and more are served; only
    their rows are indexed with 32-bit integers: 2**31 of them at 2M queries for M3."""
    from torch_msa.sm90.forward_host import check_rows

    check_rows(2**21 - 1, 4, 16)
    with pytest.raises(UnsupportedInputs, match="32-bit integers: 2097152 queries"):
        check_rows(2**21, 4, 16)


def test_backend_is_unavailable_off_sm90():
    from torch_msa import sm90

    assert not sm90.available(torch.device("cpu"))
    assert set(sm90.BACKEND.ops) == {"forward", "backward", "backward_with_index_loss"}


# The query-outer groups kernel per listed block: Q K^T and P V once each; its TMA loads: K and V
# (two boxes each) and the Q tiles of both consumers (4 tokens, two boxes each); one token's output.
GROUPS_TMA_LOADS = 2 * 2 + 2 * 4 * 2
GROUPS_WGMMA_WAITS = 2


@requires_cute
def test_groups_kernel_is_warp_specialised_with_wgmmas_tma_and_no_spills(sm90_groups_build):
    """`sm90/groups_kernel.py`: the forward's three warpgroups and register split, `Q K^T` from
    shared memory and `P V` from registers once per block, its TMA loads and stores, no spills."""
    ptx, sass = _listing(sm90_groups_build, ".ptx"), _listing(sm90_groups_build, ".sass")
    assert ".target sm_90a" in ptx and ".reqntid 384, 1, 1" in ptx
    qk = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16 \{[^}]*\}, %rd\d+, %rd\d+,", ptx)
    pv = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16 \{[^}]*\}, \{[^}]*\}, %rd\d+,", ptx)
    assert (len(qk), len(pv)) == (K_STEPS, K_STEPS)
    assert re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+)", ptx) == [str(PRODUCER_REGISTERS)]
    assert re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)", ptx) == [str(CONSUMER_REGISTERS)]
    assert len(re.findall(r"\bUTMALDG\.[23]D\b", sass)) == GROUPS_TMA_LOADS
    # A warp's token (two boxes) at two sites: into its partial slot, or straight into the output.
    assert len(re.findall(r"\bUTMASTG\.[23]D\b", sass)) == TMA_STORES
    assert len(re.findall(r"\bWARPGROUP\.DEPBAR\b", sass)) == GROUPS_WGMMA_WAITS
    assert not re.findall(r"\b(STL|LDL)\b", sass)


def _most_loads_within(sass: str, window: int) -> int:
    """The most global loads (`LDG`) among any `window` consecutive instructions of `sass`."""
    loads = [bool(re.search(r"\bLDG\b", line)) for line in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]{4,}\*/", line)]
    return max(sum(loads[i:i + window]) for i in range(max(1, len(loads) - window + 1)))


@requires_cute
def test_groups_kernel_reads_a_selection_row_in_one_batch(sm90_groups_build):
    """A unit's query reads its selection row and its KV-outer part (`first_listed_slot`) with the
    loads in flight together, 16 slots of each at a time, not one slot's loads after another's."""
    from torch_msa.sm90.groups_kernel import SLOT_UNROLL

    sass = _listing(sm90_groups_build, ".sass")
    assert _most_loads_within(sass, 2 * SLOT_UNROLL + 8) >= 2 * SLOT_UNROLL
