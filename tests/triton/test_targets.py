"""Every Triton kernel fits the shared memory of every architecture the backend serves.

Without a GPU: each kernel is compiled for sm_80, sm_86, sm_90, sm_100 and sm_120 (and sm_89,
whose 16-bit code and shared memory are sm_86's: one kernel's PTX checks that) with Triton's own
compiler at the M3 configuration (bf16, Hq=64, Hkv=4, D=128, block 128, topk 16, Hi=4, Di=128),
walking its launch configurations in the order the backend tries them at run time
(`torch_msa/triton_utils/launch.py`). One of them must fit the architecture's limit of shared memory
per block, and on sm_90 the tuned first one must. The one exception is pinned too: the KL
forward, default and deterministic (the block's keys and index keys, the latter in two operand
layouts, plus the per-item key sums), fits none of the 99 KB architectures, where the loss runs
on the reference.

A kernel's shared memory is fixed when Triton lowers it to LLVM IR, so only sm_90 goes on through
PTX and the ptxas Triton ships (which checks that the code assembles); the other targets stop
after the LLVM IR, which saves three fifths of each compile (one kernel checks that both ways
agree).

The launch-time fallback itself (a configuration refused with `OutOfResources`, then the next,
then the reference) is tested without compiling anything.

The plan's counting and placing passes are checked for registers on sm_90: each of their programs
walks its tiles one after another, a chain of dependent loads per tile, so they want many programs
per SM.
"""

import re
import subprocess
import warnings

import pytest
import torch

from tests.support import install

triton = pytest.importorskip("triton", reason=install.TRITON)

import torch_msa  # noqa: E402
from torch_msa import backends  # noqa: E402
from torch_msa.index_loss import dense as kl_dense_kernel  # noqa: E402
from torch_msa.index_loss import sparse as kl_kernel  # noqa: E402
from torch_msa.plan import kernels as plan_kernels  # noqa: E402
from torch_msa.plan.groups import group_tokens, max_group_blocks  # noqa: E402
from torch_msa.stages import combine, delta, fixed_point_dq, query_outer  # noqa: E402
from torch_msa.stages import deterministic as backward_deterministic_kernel  # noqa: E402
from torch_msa.stages import dq as dq_stage  # noqa: E402
from torch_msa.triton import backward as backward_kernel  # noqa: E402
from torch_msa.triton import forward as forward_kernel  # noqa: E402
from torch_msa.triton import select as select_kernel  # noqa: E402
from torch_msa.triton_utils import common, launch  # noqa: E402

# Shared memory per block (opt-in maximum) of each architecture, from the CUDA C++ Programming
# Guide's table of compute capabilities.
TARGETS = {
    "sm_80": (80, 166_912),
    "sm_86": (86, 101_376),
    "sm_89": (89, 101_376),
    "sm_90": (90, 232_448),
    "sm_100": (100, 232_448),
    "sm_120": (120, 101_376),
}
TUNED_TARGET = "sm_90"
# Ada compiles 16-bit dots as Ampere does and has sm_86's shared memory, so its fit is sm_86's.
SAME_AS = {"sm_89": "sm_86"}
COMPILED_TARGETS = [target for target in TARGETS if target not in SAME_AS]

M3 = dict(num_heads=64, num_kv_heads=4, dim=128, block_size=128, topk=16, index_heads=4, index_dim=128)
GROUP = M3["num_heads"] // M3["num_kv_heads"]
SCHEDULE_TABLES = ("entry_query", "item_bucket", "item_start", "item_end", "bucket_head", "bucket_key_row",
                   "bucket_block", "position")


def _forward_blocks(config):
    tokens, group_p2 = common.tile_shape(M3["num_heads"], M3["num_kv_heads"], config.rows)
    types = dict.fromkeys(("q", "k", "v", "partial_out"), "*bf16") | dict.fromkeys(SCHEDULE_TABLES, "*i32")
    types |= {"partial_lse": "*fp32", "qk_scale": "fp32"}
    constants = dict(NUM_KV_HEADS=M3["num_kv_heads"], GROUP=GROUP, GROUP_P2=group_p2, TOKENS=tokens, TOPK=M3["topk"],
                     BLOCK=M3["block_size"], DIM=M3["dim"], PRECISION="tf32")
    return forward_kernel.msa_fwd_blocks_kernel, types, constants


def _forward_groups(config):
    most = max_group_blocks(M3["topk"], group_tokens(M3["num_heads"], M3["num_kv_heads"]))
    types = dict.fromkeys(("q", "k", "v", "partial_out"), "*bf16") | {"partial_lse": "*fp32", "qk_scale": "fp32"}
    types |= DOCUMENT_TABLES | dict.fromkeys(("block_indices", "kv_outer_indices", "group_start", "group_end",
                                              "group_blocks"), "*i32")
    tokens, parts = query_outer.program_tokens(M3["num_heads"], M3["num_kv_heads"], config.rows)
    constants = dict(NUM_KV_HEADS=M3["num_kv_heads"], GROUP=GROUP, GROUP_P2=GROUP, TOKENS=tokens,
                     TOPK=M3["topk"], TOPK_P2=M3["topk"], MOST=most, MOST_P2=triton.next_power_of_2(most),
                     BLOCK=M3["block_size"], DIM=M3["dim"], PRECISION="tf32", FRAGMENTS=False,
                     PARTS=parts)
    return query_outer.msa_fwd_groups_kernel, types, constants


def _forward_combine(config):
    types = {"partial_out": "*bf16", "partial_lse": "*fp32", "out": "*bf16", "lse": "*fp32", "done": "*i32"}
    constants = dict(NUM_KV_HEADS=M3["num_kv_heads"], GROUP=GROUP, GROUP_P2=GROUP, TOPK=M3["topk"], DIM=M3["dim"],
                     SKIP_DONE=False)
    return combine.msa_fwd_combine_kernel, types, constants


def _backward_delta(config):
    types = {"grad_out": "*bf16", "out": "*bf16", "grad_lse": "*fp32", "delta": "*fp32"}
    constants = dict(NUM_HEADS=M3["num_heads"], DIM=M3["dim"], ROWS=config.rows, HAS_GRAD_LSE=True)
    return delta.msa_bwd_delta_kernel, types, constants


def _backward_ungroup_dq(config):
    types = {"dq_acc": "*fp32", "dq": "*bf16", "row_scale": "*fp32", "row_redo": "*i8", "softmax_scale": "fp32",
             "redo_below": "i32", "clamp_scale": "fp32"}
    constants = dict(HEADS=GROUP, GROUPS=M3["dim"] // 8, WIDTH=8, FIXED_POINT=False)
    return dq_stage.msa_bwd_ungroup_dq_kernel, types, constants


def _fixed_point_ungroup_dq(config):
    fn, types, constants = _backward_ungroup_dq(config)
    return fn, types | {"dq_acc": "*i32"}, constants | {"FIXED_POINT": True}


def _key_maxima(config):
    types = {"k": "*bf16", "v": "*bf16", "cu_seqlens_k": "*i32", "maxima": "*i32"}
    constants = dict(NUM_KV_HEADS=M3["num_kv_heads"], DIM=M3["dim"], BLOCK=M3["block_size"], ROWS=config.rows)
    return fixed_point_dq.msa_bwd_key_maxima_kernel, types, constants


def _dq_scale(config):
    types = {"grad_out": "*bf16", "delta": "*fp32", "maxima": "*i32", "block_indices": "*i32", "dq_scale": "*fp32"}
    types |= {name: "*i32" for name in ("cu_seqlens_q", "cu_seqlens_k", "fragment_documents", "fragment_starts")}
    constants = dict(NUM_HEADS=M3["num_heads"], NUM_KV_HEADS=M3["num_kv_heads"], DIM=M3["dim"], BLOCK=M3["block_size"],
                     TOPK=M3["topk"], TOPK_P2=M3["topk"], ROWS=config.rows, BOUND_BITS=26,
                     MAX_EXPONENT=fixed_point_dq.MAX_EXPONENT, FRAGMENTS=True)
    return fixed_point_dq.msa_bwd_dq_scale_kernel, types, constants


def _backward_blocks(config):
    tokens, group_p2 = common.tile_shape(M3["num_heads"], M3["num_kv_heads"], config.rows)
    types = dict.fromkeys(("q", "k", "v", "grad_out"), "*bf16") | dict.fromkeys(SCHEDULE_TABLES, "*i32")
    types |= dict.fromkeys(("lse", "delta", "dq_acc", "dk_acc", "dv_acc"), "*fp32")
    types |= {"softmax_scale": "fp32", "qk_scale": "fp32"}
    constants = dict(NUM_KV_HEADS=M3["num_kv_heads"], GROUP=GROUP, GROUP_P2=group_p2, TOKENS=tokens, TOPK=M3["topk"],
                     BLOCK=M3["block_size"], BLOCK_N=config.block_n, DIM=M3["dim"], PRECISION="tf32",
                     DETERMINISTIC=False)
    return backward_kernel.msa_bwd_blocks_kernel, types, constants


def _deterministic_key_blocks(config):
    fn, types, constants = _backward_blocks(config)
    return fn, types, constants | {"DETERMINISTIC": True}


def _deterministic_key_reduce(config):
    types = dict.fromkeys(("dk_part", "dv_part"), "*fp32") | dict.fromkeys(("dk", "dv"), "*bf16")
    types |= dict.fromkeys(("entry_query", "item_end", "bucket_ptr", "bucket_first_item", "bucket_head",
                            "bucket_key_row", "bucket_block", "position"), "*i32")
    constants = dict(TOPK=M3["topk"], BLOCK=M3["block_size"], BLOCK_N=config.block_n, DIM=M3["dim"])
    return backward_deterministic_kernel.msa_bwd_key_reduce_kernel, types, constants


def _kl_key_reduce(config):
    """The reduction as the deterministic KL kernels launch it: one fp32 workspace into fp32 per-head sums."""
    fn, types, constants = _deterministic_key_reduce(config)
    types |= dict.fromkeys(("dk", "dv"), "*fp32")
    return fn, types, constants | {"DIM": M3["index_dim"], "PAIR": False}


def _deterministic_query(config):
    types = dict.fromkeys(("q", "k", "v", "grad_out", "dq"), "*bf16") | dict.fromkeys(("lse", "delta"), "*fp32")
    types |= {"row_redo": "*i8", "block_indices": "*i32", "key_start": "*i64", "position": "*i64",
              "softmax_scale": "fp32", "qk_scale": "fp32"}
    constants = dict(NUM_KV_HEADS=M3["num_kv_heads"], GROUP=GROUP, GROUP_P2=GROUP, TOPK=M3["topk"],
                     TOPK_P2=M3["topk"], BLOCK=M3["block_size"], BLOCK_N=config.block_n, DIM=M3["dim"],
                     PRECISION="tf32", REDO_ONLY=False)
    return backward_deterministic_kernel.msa_bwd_dq_kernel, types, constants


def _recompute_query(config):
    """The query-outer dQ kernel recomputing the rows the fixed-point cast flags."""
    fn, types, constants = _deterministic_query(config)
    return fn, types, constants | {"REDO_ONLY": True}


def _select(config):
    heads_p2 = triton.next_power_of_2(M3["index_heads"])
    types = {"index_q": "*bf16", "index_k": "*bf16", "cu_seqlens_q": "*i32", "key_start": "*i64",
             "position": "*i64", "block_indices": "*i32", "scale": "fp32"}
    constants = dict(NUM_HEADS=M3["index_heads"], HEADS_P2=heads_p2, TOKENS=config.rows // heads_p2,
                     DIM=M3["index_dim"], DIM_P2=M3["index_dim"], BLOCK=M3["block_size"], TOPK=M3["topk"],
                     KEEP_P2=M3["topk"], PRECISION="tf32")
    return select_kernel.msa_select_kernel, types, constants


def _kl_forward(config):
    tokens, heads_per_pass = kl_kernel.index_loss_tile_shape(M3["num_heads"], M3["num_kv_heads"], config.rows)
    types = dict.fromkeys(("q", "k", "index_q", "index_k"), "*bf16") | dict.fromkeys(SCHEDULE_TABLES, "*i32")
    types |= dict.fromkeys(("lse", "part_max", "part_sum", "part_weighted", "part_mass", "teacher_index_keys",
                            "teacher_index_queries"), "*fp32")
    types |= {"qk_scale": "fp32", "index_scale": "fp32"}
    constants = dict(NUM_KV_HEADS=M3["num_kv_heads"], GROUP=GROUP, HEADS_PER_PASS=heads_per_pass, TOKENS=tokens,
                     TOPK=M3["topk"], BLOCK=M3["block_size"], DIM=M3["dim"], INDEX_DIM=M3["index_dim"],
                     PRECISION="tf32", INDEX_PRECISION="tf32", SPLIT=True, DETERMINISTIC=False)
    return kl_kernel.msa_kl_fwd_kernel, types, constants


def _kl_backward(config):
    types = dict.fromkeys(("index_q", "index_k"), "*bf16") | dict.fromkeys(SCHEDULE_TABLES, "*i32")
    types |= dict.fromkeys(("index_lse", "teacher_mass", "grad_loss", "d_index_q", "d_index_k"), "*fp32")
    types |= {"index_scale": "fp32", "coefficient_scale": "fp32"}
    constants = dict(NUM_KV_HEADS=M3["index_heads"], TOKENS=config.rows, TOPK=M3["topk"], BLOCK=M3["block_size"],
                     INDEX_DIM=M3["index_dim"], INDEX_PRECISION="tf32", SPLIT=True, DETERMINISTIC=False, teacher=None)
    return kl_kernel.msa_kl_bwd_kernel, types, constants


def _kl_backward_from_teacher(config):
    """The backward that subtracts a given (fp16) teacher."""
    fn, types, constants = _kl_backward(config)
    del constants["teacher"]
    return fn, types | {"teacher": "*fp16"}, constants


def _kl_forward_from_teacher(config):
    types = dict.fromkeys(("index_q", "index_k"), "*bf16") | dict.fromkeys(SCHEDULE_TABLES, "*i32")
    types |= dict.fromkeys(("part_max", "part_sum", "part_weighted", "part_mass"), "*fp32")
    types |= {"teacher": "*fp16", "index_scale": "fp32"}
    constants = dict(NUM_KV_HEADS=M3["index_heads"], TOKENS=config.rows, TOPK=M3["topk"], BLOCK=M3["block_size"],
                     INDEX_DIM=M3["index_dim"], INDEX_PRECISION="tf32")
    return kl_kernel.msa_kl_fwd_from_teacher_kernel, types, constants


def _deterministic(kernel_spec):
    def deterministic_spec(config):
        fn, types, constants = kernel_spec(config)
        return fn, types, constants | {"DETERMINISTIC": True}

    return deterministic_spec


DOCUMENT_TABLES = {"key_start": "*i64", "position": "*i64", "cu_seqlens_q": "*i32", "cu_seqlens_k": "*i32",
                   "fragment_documents": "*i32", "fragment_starts": "*i32"}


def _kl_dense_teacher_lse(config):
    types = {"q": "*bf16", "k": "*bf16", "teacher_lse": "*fp32", "qk_scale": "fp32"} | DOCUMENT_TABLES
    constants = dict(NUM_HEADS=M3["num_heads"], GROUP=GROUP, TOKENS=config.rows, BLOCK_N=config.block_n,
                     DIM=M3["dim"], PRECISION="tf32")
    return kl_dense_kernel.msa_kl_dense_teacher_lse_kernel, types, constants


def _kl_dense_loss(config):
    types = dict.fromkeys(("q", "k", "index_q", "index_k"), "*bf16") | DOCUMENT_TABLES
    types |= dict.fromkeys(("teacher_lse", "weighted", "mass", "index_lse", "teacher_index_keys",
                            "teacher_index_queries"), "*fp32")
    types |= {"qk_scale": "fp32", "index_scale": "fp32"}
    constants = dict(NUM_HEADS=M3["num_heads"], NUM_KV_HEADS=M3["num_kv_heads"], GROUP=GROUP, TOKENS=config.rows,
                     BLOCK_N=config.block_n, DIM=M3["dim"], INDEX_DIM=M3["index_dim"], PRECISION="tf32",
                     INDEX_PRECISION="tf32", SPLIT=True, DETERMINISTIC=False)
    return kl_dense_kernel.msa_kl_dense_loss_kernel, types, constants


def _kl_dense_teacher_queries(config):
    types = dict.fromkeys(("q", "k", "index_q"), "*bf16") | DOCUMENT_TABLES
    types |= {"teacher_lse": "*fp32", "teacher_index_queries": "*fp32", "qk_scale": "fp32"}
    constants = dict(NUM_HEADS=M3["num_heads"], NUM_KV_HEADS=M3["num_kv_heads"], GROUP=GROUP, TOKENS=config.rows,
                     BLOCK_N=config.block_n, DIM=M3["dim"], INDEX_DIM=M3["index_dim"], PRECISION="tf32",
                     INDEX_PRECISION="tf32", SPLIT=True, FRAGMENTS=True)
    return kl_dense_kernel.msa_kl_dense_teacher_queries_kernel, types, constants


def _kl_dense_grad(kernel):
    def kernel_spec(config):
        types = dict.fromkeys(("index_q", "index_k", "d_index_q", "d_index_k"), "*bf16") | DOCUMENT_TABLES
        types |= dict.fromkeys(("index_lse", "teacher_mass", "teacher_index_keys", "teacher_index_queries",
                                "coefficient"), "*fp32")
        types |= {"index_scale": "fp32"}
        constants = dict(NUM_KV_HEADS=M3["index_heads"], TOKENS=config.rows, BLOCK_N=config.block_n,
                         INDEX_DIM=M3["index_dim"], INDEX_PRECISION="tf32")
        if "FRAGMENTS" in kernel.arg_names:  # the key-tile-outer kernel; its fragment loop costs the most
            constants["FRAGMENTS"] = True
        return kernel, types, constants

    return kernel_spec


KERNELS = {
    "msa_fwd_blocks_kernel": (_forward_blocks, forward_kernel.BLOCKS_CONFIGS),
    "msa_fwd_groups_kernel": (_forward_groups, query_outer.GROUPS_CONFIGS),
    "msa_fwd_combine_kernel": (_forward_combine, combine.COMBINE_CONFIGS),
    "msa_bwd_delta_kernel": (_backward_delta, delta.DELTA_CONFIGS),
    "msa_bwd_ungroup_dq_kernel": (_backward_ungroup_dq, dq_stage.UNGROUP_CONFIGS),
    "msa_bwd_ungroup_dq_kernel (fixed point)": (_fixed_point_ungroup_dq, dq_stage.UNGROUP_CONFIGS),
    "msa_bwd_key_maxima_kernel": (_key_maxima, fixed_point_dq.MAXIMA_CONFIGS),
    "msa_bwd_dq_scale_kernel": (_dq_scale, fixed_point_dq.SCALE_CONFIGS),
    "msa_bwd_blocks_kernel": (_backward_blocks, backward_kernel.BLOCKS_CONFIGS),
    "msa_bwd_blocks_kernel (deterministic)": (_deterministic_key_blocks, backward_kernel.DETERMINISTIC_BLOCKS_CONFIGS),
    "msa_bwd_key_reduce_kernel": (_deterministic_key_reduce, backward_deterministic_kernel.KEY_REDUCE_CONFIGS),
    "msa_bwd_dq_kernel": (_deterministic_query, backward_deterministic_kernel.QUERY_CONFIGS),
    "msa_bwd_dq_kernel (flagged rows)": (_recompute_query, backward_deterministic_kernel.QUERY_CONFIGS),
    "msa_select_kernel": (_select, select_kernel.CONFIGS),
    "msa_kl_dense_teacher_lse_kernel": (_kl_dense_teacher_lse, kl_dense_kernel.TEACHER_LSE_CONFIGS),
    "msa_kl_dense_loss_kernel": (_kl_dense_loss, kl_dense_kernel.LOSS_CONFIGS),
    "msa_kl_dense_loss_kernel (deterministic)": (_deterministic(_kl_dense_loss), kl_dense_kernel.LOSS_CONFIGS),
    "msa_kl_dense_teacher_queries_kernel": (_kl_dense_teacher_queries, kl_dense_kernel.TEACHER_QUERIES_CONFIGS),
    "msa_kl_dense_query_grad_kernel": (_kl_dense_grad(kl_dense_kernel.msa_kl_dense_query_grad_kernel),
                                       kl_dense_kernel.QUERY_GRAD_CONFIGS),
    "msa_kl_dense_key_grad_kernel": (_kl_dense_grad(kl_dense_kernel.msa_kl_dense_key_grad_kernel),
                                     kl_dense_kernel.KEY_GRAD_CONFIGS),
    "msa_kl_fwd_kernel": (_kl_forward, kl_kernel.FORWARD_CONFIGS),
    "msa_kl_bwd_kernel": (_kl_backward, kl_kernel.BACKWARD_CONFIGS),
    "msa_kl_fwd_kernel (deterministic)": (_deterministic(_kl_forward), kl_kernel.FORWARD_CONFIGS),
    "msa_kl_bwd_kernel (deterministic)": (_deterministic(_kl_backward), kl_kernel.BACKWARD_CONFIGS),
    "msa_kl_fwd_from_teacher_kernel": (_kl_forward_from_teacher, kl_kernel.FROM_TEACHER_CONFIGS),
    "msa_kl_bwd_kernel (teacher given)": (_kl_backward_from_teacher, kl_kernel.BACKWARD_CONFIGS),
    "msa_kl_bwd_kernel (teacher given) (deterministic)": (_deterministic(_kl_backward_from_teacher),
                                                          kl_kernel.BACKWARD_CONFIGS),
    "msa_bwd_key_reduce_kernel (one workspace)": (_kl_key_reduce, backward_deterministic_kernel.KEY_REDUCE_CONFIGS),
}


def _shared_memory(kernel, config, capability, llvm_cache):
    """Bytes of shared memory the kernel needs with `config`, compiled for `capability`: through
    ptxas for the tuned target, up to the LLVM IR for the others."""
    if capability == TARGETS[TUNED_TARGET][0]:
        return _compile(kernel, config, capability).metadata.shared
    return _compile_to_llvm(kernel, config, capability, llvm_cache).metadata.shared


def _compile(kernel, config, capability):
    """The kernel compiled with `config` for `capability`."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, types, constants = KERNELS[kernel][0](config)
    fn = getattr(fn, "jit_function", fn)  # the `@triton.jit` function under its cached launches
    # Integer arguments not named in `types` are sizes and strides (i32); constexprs are given.
    signature = {name: "constexpr" if name in constants else types.get(name, "i32") for name in fn.arg_names}
    # A real launch specialises pointers and strides divisible by 16 (all of them, at M3 shapes),
    # which lets Triton pipeline the loads: without these hints the count of shared memory is low.
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
               if signature[name].startswith("*") or name.startswith("stride")}
    source = ASTSource(fn, signature, constexprs=constants, attrs=aligned)
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=config.options)


def _compile_to_llvm(kernel, config, capability, cache_dir):
    """`_compile` stopped after the LLVM IR: empty stand-ins take the PTX and cubin stages. Their
    results go to `cache_dir`, never to the cache a real launch reads."""
    name = KERNELS[kernel][0](config)[0].__name__

    def stand_in_ptx(module, metadata):
        metadata["name"] = name  # the PTX stage names the kernel
        return ""

    def stop_after_llvm(*args):
        if not args:  # newer Triton asks the hook for a key of the stages it changes
            return "stop-after-llvm", "stop-after-llvm"
        stages = args[1]
        stages["ptx"] = stand_in_ptx
        stages["cubin"] = lambda module, metadata: b""

    with triton.knobs.runtime.scope(), triton.knobs.cache.scope():
        triton.knobs.runtime.add_stages_inspection_hook = stop_after_llvm
        triton.knobs.cache.dir = str(cache_dir)
        return _compile(kernel, config, capability)


@pytest.fixture(scope="session")
def llvm_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("triton-llvm-only")


# (kernel, target) pairs no configuration fits: launch() declines there and the registry runs the reference.
UNSERVED = {(kernel, target) for kernel in ("msa_kl_fwd_kernel", "msa_kl_fwd_kernel (deterministic)")
            for target in ("sm_86", "sm_120")}


@pytest.mark.slow
@pytest.mark.parametrize("target", COMPILED_TARGETS)
@pytest.mark.parametrize("kernel", KERNELS)
def test_a_launch_configuration_fits_every_target(kernel, target, llvm_cache):
    capability, limit = TARGETS[target]
    tried = []
    for config in KERNELS[kernel][1]:
        shared = _shared_memory(kernel, config, capability, llvm_cache)
        tried.append(f"{config}: {shared} B")
        if shared <= limit:
            break
    else:
        if (kernel, target) in UNSERVED:
            return
        pytest.fail(f"{kernel} fits no configuration on {target} (limit {limit} B): {tried}")
    assert (kernel, target) not in UNSERVED, f"{kernel} now fits {target}: serve it there ({tried[-1]})"
    if target == TUNED_TARGET:
        assert len(tried) == 1, f"the tuned configuration of {kernel} no longer fits {target}: {tried}"


@pytest.mark.parametrize("target, same_as", SAME_AS.items())
def test_a_target_checked_as_another_compiles_to_its_code(target, same_as):
    """The attention forward's tuned configuration gives the same shared memory and, but for the
    target line, the same PTX for `target` as for the architecture whose fit stands for its."""
    config = KERNELS["msa_fwd_blocks_kernel"][1][0]
    assert TARGETS[target][1] == TARGETS[same_as][1]
    compiled = [_compile("msa_fwd_blocks_kernel", config, TARGETS[name][0]) for name in (target, same_as)]
    assert compiled[0].metadata.shared == compiled[1].metadata.shared
    ptx = [re.sub(r"^\.target sm_\d+a?$", "", c.asm["ptx"], flags=re.M) for c in compiled]
    assert ptx[0] == ptx[1]


def test_the_llvm_ir_fixes_the_shared_memory(llvm_cache):
    """Stopping after the LLVM IR counts the shared memory that the whole compile does."""
    config = KERNELS["msa_bwd_blocks_kernel"][1][0]
    whole = _compile("msa_bwd_blocks_kernel", config, TARGETS["sm_80"][0])
    stopped = _compile_to_llvm("msa_bwd_blocks_kernel", config, TARGETS["sm_80"][0], llvm_cache)
    assert len(whole.asm["cubin"]) > 0 and len(stopped.asm["cubin"]) == 0
    assert stopped.metadata.shared == whole.metadata.shared > 0


# --- the launch-time fallback ------------------------------------------------------------------


def _out_of_resources(required):
    from triton.runtime.errors import OutOfResources

    return OutOfResources(required, 101_376, "shared memory")


@pytest.fixture
def fresh_memo(monkeypatch):
    monkeypatch.setattr(launch, "_chosen", {})
    monkeypatch.setattr(backends, "_warned", set())


def test_launch_takes_the_first_configuration_that_fits_and_remembers_it(fresh_memo):
    configs = (launch.LaunchConfig(num_stages=3, rows=128), launch.LaunchConfig(num_stages=1, rows=64),
               launch.LaunchConfig(num_stages=1, rows=32))
    tried = []

    def launch_with(config):
        tried.append(config.rows)
        if config.rows > 64:
            raise _out_of_resources(133_120)

    launch.launch("kernel", ("cuda:0", torch.bfloat16), configs, launch_with)
    assert tried == [128, 64]
    launch.launch("kernel", ("cuda:0", torch.bfloat16), configs, launch_with)
    assert tried == [128, 64, 64]  # remembered: the refused configuration is not tried again
    launch.launch("kernel", ("cuda:1", torch.bfloat16), configs, launch_with)
    assert tried == [128, 64, 64, 128, 64]  # another device decides for itself


def test_launch_declines_when_nothing_fits(fresh_memo):
    def launch_with(config):
        raise _out_of_resources(263_680)

    with pytest.raises(torch_msa.UnsupportedInputs,
                       match="no launch configuration of the Triton kernel k fits .*263680"):
        launch.launch("k", "key", (launch.LaunchConfig(num_stages=1),), launch_with)


def test_pinned_launches_its_candidates_and_restores_the_kernels_own(fresh_memo):
    own = (launch.LaunchConfig(num_stages=3, rows=128),)
    pin = (launch.LaunchConfig(num_stages=1, rows=32), launch.LaunchConfig(num_stages=1, rows=16))
    tried = []

    def launch_with(config):
        tried.append(config.rows)
        if config.rows > 16 and config is not own[0]:
            raise _out_of_resources(133_120)

    launch.launch("kernel", "key", own, launch_with)
    launch.launch("other", "key", own, launch_with)
    with launch.pinned("kernel", *pin):
        assert ("kernel", "key") not in launch._chosen and ("other", "key") in launch._chosen
        launch.launch("kernel", "key", own, launch_with)
        launch.launch("kernel", "key", own, launch_with)
        with pytest.raises(ValueError, match="already pinned"):
            with launch.pinned("kernel", *pin):
                pass
    assert tried == [128, 128, 32, 16, 16]
    assert launch._pinned == {} and ("kernel", "key") not in launch._chosen and ("other", "key") in launch._chosen
    launch.launch("kernel", "key", own, launch_with)
    assert tried[-1] == 128
    with pytest.raises(ValueError, match="no launch configuration"):
        with launch.pinned("kernel"):
            pass


def test_a_kernel_that_fits_nothing_falls_back_to_the_reference_with_one_warning(fresh_memo, monkeypatch):
    """The Triton forward on a CPU stand-in device whose shared memory fits no configuration."""

    def refuse(config):
        raise _out_of_resources(263_680)

    def forward(*args):
        launch.launch("msa_fwd_blocks_kernel", "stand-in", forward_kernel.BLOCKS_CONFIGS, refuse)

    monkeypatch.setitem(backends._BACKENDS, "small_smem",
                        torch_msa.Backend("small_smem", {"forward": forward}, priority=15))
    q, k, v = torch.randn(70, 4, 64), torch.randn(70, 2, 64), torch.randn(70, 2, 64)
    block_indices = torch.zeros(2, 70, 2, dtype=torch.int32)
    with pytest.warns(UserWarning, match="'small_smem' does not serve .*shared memory.*falling back to 'reference'"):
        out = torch_msa.sparse_attention(q, k, v, block_indices, block_size=64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = torch_msa.sparse_attention(q, k, v, block_indices, block_size=64)
    assert torch.equal(out, again)


# Registers a thread of the plan's 128-thread counting and placing programs may take: at most 80
# leaves room for six programs in an SM's 64K registers.
PLAN_REGISTERS = 80


@pytest.mark.parametrize("fragments", [False, True], ids=["documents", "fragments"])
@pytest.mark.parametrize("place", [False, True], ids=["counting", "placing"])
def test_the_plan_passes_leave_room_for_many_programs_per_sm(place, fragments, tmp_path):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = plan_kernels.msa_plan_place_kernel.jit_function
    tokens, topk_p2 = plan_kernels.tile_shape(M3["topk"])
    # As a launch over contiguous `block_indices` specialises them: the slot stride 1, the other
    # strides and the pointers divisible by 16.
    constants = dict(TOPK=M3["topk"], TOPK_P2=topk_p2, TOKENS=tokens, FRAGMENTS=fragments, PLACE=place,
                     ZERO_LANES=1024, stride_slot=1)
    pointers = {"block_indices", "cu_seqlens_q", "cu_seqlens_k", "fragment_documents", "fragment_starts", "offsets",
                "slot_start", "entry_query", "slot_bucket", "bucket_ptr", "bucket_key_row", "bucket_block", "position"}
    signature = {name: "constexpr" if name in constants else "*i32" if name in pointers else "i32"
                 for name in kernel.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
               if name in pointers or name in ("stride_head", "stride_token")}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constants, attrs=aligned),
                              target=GPUTarget("cuda", TARGETS["sm_90"][0], 32), options={"num_warps": 4})
    usage = _resource_usage(compiled, tmp_path / "plan.cubin")
    registers = re.search(r"REG:(\d+)", usage)
    assert registers is not None, usage
    assert int(registers[1]) <= PLAN_REGISTERS, usage
    assert re.search(r"LOCAL:0\b", usage), usage  # nothing spilled


# Registers a thread of the query groups' one-warp programs (8 queries x 16 slots at M3) may take:
# sorting the lanes needs 72; comparing every pair of the 128 lanes at once would need about 200.
QUERY_GROUPS_REGISTERS = 96


@pytest.mark.parametrize("fragments", [False, True], ids=["documents", "fragments"])
def test_the_query_groups_kernel_sorts_a_group_in_one_warp_without_spills(fragments, tmp_path):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from torch_msa.plan.groups import Q_OUTER_COST

    kernel = plan_kernels.msa_plan_query_groups_kernel.jit_function
    tokens = group_tokens(M3["num_heads"], M3["num_kv_heads"])
    most = max_group_blocks(M3["topk"], tokens)
    constants = dict(TOPK=M3["topk"], TOPK_P2=triton.next_power_of_2(M3["topk"]), GROUP=tokens, MOST=most,
                     MOST_P2=triton.next_power_of_2(most), COST_NUMERATOR=Q_OUTER_COST[0],
                     COST_DENOMINATOR=Q_OUTER_COST[1], FRAGMENTS=fragments, stride_slot=1)
    integers = {"num_queries", "num_keys", "num_segments", "num_docs", "search_steps", "block_size", "num_ids",
                "min_segment_queries", "stride_head", "stride_token"}
    signature = {name: "constexpr" if name in constants else "i32" if name in integers else "*i32"
                 for name in kernel.arg_names}
    warps = plan_kernels.query_groups_warps(tokens, M3["topk"])
    assert warps == 1
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constants),
                              target=GPUTarget("cuda", TARGETS["sm_90"][0], 32), options={"num_warps": warps})
    usage = _resource_usage(compiled, tmp_path / "groups.cubin")
    registers = re.search(r"REG:(\d+)", usage)
    assert registers is not None, usage
    assert int(registers[1]) <= QUERY_GROUPS_REGISTERS, usage
    assert re.search(r"LOCAL:0\b", usage), usage


def _resource_usage(compiled, path) -> str:
    """cuobjdump's resource line of a compiled kernel (`REG:`, `LOCAL:`, ...)."""
    path.write_bytes(compiled.asm["cubin"])
    return subprocess.run([triton.knobs.nvidia.cuobjdump.path, "--dump-resource-usage", str(path)],
                          capture_output=True, text=True, check=True).stdout


def test_the_query_outer_forward_runs_wgmma_on_pipelined_loads_without_spills(tmp_path):
    """At M3 on sm_90 its tuned configuration multiplies with wgmma, loads K and V with cp.async
    two stages deep, and keeps its 128 rows' output in registers without spilling."""
    compiled = _compile("msa_fwd_groups_kernel", KERNELS["msa_fwd_groups_kernel"][1][0], TARGETS[TUNED_TARGET][0])
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async" in ptx
    usage = _resource_usage(compiled, tmp_path / "groups.cubin")
    assert re.search(r"LOCAL:0\b", usage), usage
