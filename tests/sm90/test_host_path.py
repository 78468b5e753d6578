"""The per-call host path of the SM90 forward and backward (`torch_msa/sm90/forward_host.py`,
`backward_host.py`), on CPU.

The CuTe compile is replaced by a recorder and the Triton stages by stand-ins, so what runs is
the host code itself: each launch must pass the torch tensors the kernel was compiled for
(dtype, inner extents, contiguous, aligned), in the compiled order and unconverted (no
`cutlass.cute.runtime.from_dlpack`), plain Python scalars, and no stream (the compiled function
takes torch's current one); and the host work around the launch must stay a few ATen calls, each
of which costs a host-side launch in eager mode. On a GPU the whole step is counted by
`tests/sm90/test_launches.py`.
"""

import contextlib
import dataclasses

import pytest
import torch

from tests.support import install
from tests.support.cute_dsl import forbid_python_conversions, requires_cute
from tests.support.documents import backend_arguments, documents_of
from tests.support.host_calls import CountOps
from torch_msa import testing
from torch_msa.cute_dsl.cute_io import row_alignment
from torch_msa.plan.schedule import bucket_key_count, build_schedule, entries_per_item, pack, unpack, with_items

pytest.importorskip("triton", reason=f"the SM90 hosts import the Triton stages: {install.TRITON}")

TOKENS, HEADS, KV_HEADS, DIM, TOPK, BLOCK = 300, 64, 4, 128, 16, 128


class RecordedKernel:
    """What the stand-in `cute.compile` returns: the compile's arguments and, as its TVM-FFI
    function, a launcher that checks every call against them and records it."""

    def __init__(self, kernel, args, options):
        self.kernel, self.args, self.options = kernel, args, options
        self.calls = []

    def __tvm_ffi_object__(self):
        return self.launch

    def launch(self, *args):
        check_call(self.args, args)
        self.calls.append(args)


def check_call(compiled_args, call_args) -> None:
    """A call matches what was compiled as TVM-FFI would check it, and passes nothing converted."""
    import cutlass
    from cutlass.cute.runtime import _FakeStream, _FakeTensor

    torch_dtypes = {cutlass.BFloat16: torch.bfloat16, cutlass.Float16: torch.float16, cutlass.Float32: torch.float32,
                    cutlass.Int32: torch.int32, cutlass.Int64: torch.int64}
    *parameters, stream = compiled_args
    assert isinstance(stream, _FakeStream) and stream.use_tvm_ffi_env_stream, "the stream comes from the environment"
    assert len(call_args) == len(parameters), "every parameter but the stream is passed"
    for position, (parameter, arg) in enumerate(zip(parameters, call_args)):
        where = f"argument #{position}"
        if isinstance(parameter, _FakeTensor):
            assert type(arg) is torch.Tensor, f"{where}: a torch tensor, unconverted, got {type(arg).__name__}"
            dtype, inner = torch_dtypes[parameter.element_type], tuple(parameter.shape[1:])
            assert (arg.dtype, tuple(arg.shape[1:])) == (dtype, inner), f"{where}: {arg.dtype} {list(arg.shape)}"
            assert all(size == 1 or got == want for size, got, want in zip(arg.shape, arg.stride(), parameter.stride)), \
                f"{where}: strides {arg.stride()}, compiled {parameter.stride}"
            assert arg.data_ptr() % row_alignment(dtype, inner) == 0, f"{where}: misaligned"
        elif parameter is None:
            assert arg is None, where
        else:
            assert type(arg) in (int, float), f"{where}: a Python number, got {type(arg).__name__}"


@dataclasses.dataclass
class Recorder:
    """The compiles (`kernels`), the stand-in Triton stages called (`stages`) and the arguments of
    the last call of each (`stage_args`), and the key counts the `bucket_key_count` stage returns,
    by the data pointer of its `bucket_key_row`."""

    kernels: list = dataclasses.field(default_factory=list)
    stages: list = dataclasses.field(default_factory=list)
    stage_args: dict = dataclasses.field(default_factory=dict)
    key_count: dict = dataclasses.field(default_factory=dict)


@pytest.fixture
def recorded(monkeypatch):
    """A `Recorder` of the stand-in compile and stages, with `from_dlpack` made to fail and a
    132-SM device."""
    import cutlass.cute as cute

    from torch_msa.sm90 import backward_deterministic, backward_host, common, forward_host

    recorder = Recorder()

    def compile(kernel, *args, options=""):
        recorder.kernels.append(RecordedKernel(kernel, args, options))
        return recorder.kernels[-1]

    monkeypatch.setattr(cute, "compile", compile)
    forbid_python_conversions(monkeypatch)
    for module in (forward_host, backward_host):
        monkeypatch.setattr(module, "sm_count", lambda device: 132)
        module._compiled.cache_clear()

    def stand_in(name, result=None):
        def stage(*args):
            recorder.stages.append(name)
            recorder.stage_args[name] = args
            return result(*args) if result else None
        # Each host module holds the stage under its own name.
        for module in (common, forward_host, backward_host, backward_deterministic):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, stage)

    stand_in("bucket_key_count", lambda rows, cu, block_size: recorder.key_count[rows.data_ptr()])
    stand_in("combine")
    stand_in("compute_delta")
    stand_in("ungroup_dq")
    yield recorder
    for module in (forward_host, backward_host):
        module._compiled.cache_clear()


def _inputs(key_count):
    cu_q, cu_k = testing.cu_seqlens([TOKENS], [TOKENS])
    block_indices = testing.random_block_indices(cu_q, cu_k, KV_HEADS, TOPK, BLOCK)
    plan = pack(build_schedule(block_indices, documents_of(cu_q, cu_k), TOKENS, BLOCK, entries_per_item(HEADS, KV_HEADS)))
    schedule = unpack(plan, block_indices, TOKENS, 1, BLOCK)
    # The key counts are computed here, so that the stand-in stage adds no ATen call to the count.
    key_count[schedule.bucket_key_row.data_ptr()] = bucket_key_count(schedule.bucket_key_row, cu_k, BLOCK)
    q = torch.randn(TOKENS, HEADS, DIM).to(torch.bfloat16)
    k, v = (torch.randn(TOKENS, KV_HEADS, DIM).to(torch.bfloat16) for _ in range(2))
    return q, k, v, block_indices, cu_q, cu_k, plan, schedule


def _assert_schedule_passed(call, first, schedule, key_count, names):
    """The schedule operands after the kernel's own ones: the plan's views, in `SCHEDULE_OPERANDS` order."""
    for offset, name in enumerate(names):
        want = key_count if name == "bucket_key_count" else getattr(schedule, name)
        got = call[first + offset]
        assert (got.data_ptr(), got.shape) == (want.data_ptr(), want.shape), name


@requires_cute
def test_forward_with_a_plan_launches_its_tensors_unconverted_after_five_aten_calls(recorded):
    from torch_msa.sm90 import forward_host
    from torch_msa.sm90.common import SCHEDULE_OPERANDS

    q, k, v, block_indices, cu_q, cu_k, plan, schedule = _inputs(recorded.key_count)
    args = (q, k, v, block_indices, cu_q, cu_k, TOKENS, TOKENS, BLOCK, DIM**-0.5, plan)
    forward_host.forward(*backend_arguments("forward", *args))  # the first call compiles
    (kernel,) = recorded.kernels
    assert "--enable-tvm-ffi" in kernel.options
    with CountOps() as counted:
        forward_host.forward(*backend_arguments("forward", *args))
    assert len(kernel.calls) == 2 and recorded.stages == ["bucket_key_count", "combine"] * 2
    call = kernel.calls[-1]
    assert call[0] is q and call[1] is k and call[2] is v
    key_count = recorded.key_count[schedule.bucket_key_row.data_ptr()]
    _assert_schedule_passed(call, 5, schedule, key_count, [name for name, _, _ in SCHEDULE_OPERANDS])
    grid = min(schedule.item_start.numel(), 132)  # one CTA per SM, no more than the items
    assert call[-3:] == (TOPK, pytest.approx(DIM**-0.5 * 1.4426950408889634), grid)
    # out, lse, the partial outputs and their -inf lse, the plan's views: nothing else.
    names = [str(op) for op in counted.calls]
    assert names == ["aten.empty.memory_format"] * 3 + ["aten.full.default", "aten.split_with_sizes.default"], names


@requires_cute
def test_backward_with_a_plan_launches_its_tensors_unconverted_after_a_few_aten_calls(recorded):
    from torch_msa.sm90 import backward_host
    from torch_msa.sm90.common import SCHEDULE_OPERANDS

    q, k, v, block_indices, cu_q, cu_k, plan, schedule = _inputs(recorded.key_count)
    grad_out, out = torch.randn(2, *q.shape).to(torch.bfloat16).unbind(0)
    lse = torch.randn(TOKENS, HEADS)
    args = (grad_out, q, k, v, out, lse, block_indices, cu_q, cu_k, TOKENS, TOKENS, BLOCK, DIM**-0.5, None, plan)
    backward_host.backward(*backend_arguments("backward", *args))
    (kernel,) = recorded.kernels
    with CountOps() as counted:
        dq, dk, dv = backward_host.backward(*backend_arguments("backward", *args))
    assert len(kernel.calls) == 2 and recorded.stages == ["compute_delta", "bucket_key_count", "ungroup_dq"] * 2
    call = kernel.calls[-1]
    assert call[0] is q and call[3] is grad_out and call[4] is lse
    dq_acc, dk_acc, dv_acc = call[6:9]
    assert dq_acc.shape == q.shape and dk_acc.shape == dv_acc.shape == k.shape
    key_count = recorded.key_count[schedule.bucket_key_row.data_ptr()]
    teacher = call[9]  # not written by this variant: one row, for the launch's signature
    assert teacher.shape == (1, BLOCK) and teacher.dtype == torch.float16
    assert call[10] is lse  # the fixed-point row scales' stand-in, unread by this variant
    _assert_schedule_passed(call, 11, schedule, key_count, [name for name, _, _ in SCHEDULE_OPERANDS])
    grid = min(schedule.item_start.numel(), 132)
    assert call[-5:] == (TOPK, pytest.approx(DIM**-0.5 * 1.4426950408889634), pytest.approx(DIM**-0.5),
                         2.0**30 / TOPK, grid)
    assert (dq.dtype, dk.dtype, dv.dtype) == (torch.bfloat16,) * 3
    # dQ leaves the kernel's dim-grouped accumulator through the ungrouping cast.
    ungroup_acc, ungroup_dq, block_heads, width, _ = recorded.stage_args["ungroup_dq"]
    assert ungroup_acc is dq_acc and ungroup_dq is dq and (block_heads, width) == (16, 8)
    # One zero fill for the three accumulators, delta, the plan's views, the unwritten teacher row,
    # dq and the two casts of dK and dV.
    names = [str(op) for op in counted.calls]
    assert names == ["aten.zeros.default", "aten.split_with_sizes.default", *["aten.view.default"] * 3,
                     "aten.empty.memory_format", "aten.split_with_sizes.default", "aten.empty.memory_format",
                     "aten.view.default", "aten.empty.memory_format", *["aten._to_copy.default"] * 2], names


@requires_cute
def test_the_deterministic_variant_launches_its_fixed_point_dq_and_workspace_rows(recorded):
    from torch_msa.sm90 import backward_host

    q, k, v, block_indices, cu_q, cu_k, plan, schedule = _inputs(recorded.key_count)
    items = schedule.item_start.numel()
    workspace = torch.zeros(2, items * BLOCK, DIM).unbind(0)
    lse, delta, dq_scale = torch.zeros(3, TOKENS, HEADS).unbind(0)
    dq_acc = torch.zeros(TOKENS, HEADS, DIM, dtype=torch.int32)
    key_count = recorded.key_count[schedule.bucket_key_row.data_ptr()]
    backward_host.launch_blocks(q, k, v, q, lse, delta, dq_acc, *workspace, schedule, key_count, TOPK, DIM**-0.5,
                                dq_scale=dq_scale)
    (kernel,) = recorded.kernels
    assert kernel.kernel.deterministic and len(kernel.calls) == 1
    call = kernel.calls[0]
    assert call[6] is dq_acc and call[7] is workspace[0] and call[10] is dq_scale


@requires_cute
def test_a_step_with_the_fused_index_loss_builds_one_plan_over_several_query_windows(recorded, monkeypatch):
    """The step's one plan (the one `msa_attention` builds) serves the forward's query windows,
    the backward and the index loss: no stage builds another."""
    from torch_msa import query_windows
    from torch_msa.index_loss import sparse
    from torch_msa.plan import kernels as plan_kernels
    from torch_msa.sm90 import interface

    builds = []

    def build(block_indices, documents, num_keys, block_size, item_size):
        builds.append(tuple(block_indices.shape))
        return pack(build_schedule(block_indices, documents, num_keys, block_size, item_size))

    monkeypatch.setattr(plan_kernels, "plan", build)
    monkeypatch.setattr(sparse, "with_items", with_items)  # the reference's, on CPU
    for launch in ("launch_forward_from_teacher", "launch_backward"):  # the loss's Triton kernels
        monkeypatch.setattr(sparse, launch, lambda *args, **kwargs: None)
    monkeypatch.setattr(sparse, "finish_forward", lambda partials, dtype: (torch.zeros((), dtype=dtype),) + tuple(
        torch.zeros(partials.max.shape[1::-1], dtype=dtype) for _ in range(2)))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())  # a CPU host
    per_query = query_windows.partial_bytes_per_query(HEADS, TOPK, DIM, torch.bfloat16)
    monkeypatch.setattr(query_windows, "PARTIAL_BYTES", 128 * per_query)  # windows of 128 queries: three

    q, k, v, block_indices, cu_q, cu_k, _, _ = _inputs(recorded.key_count)
    documents = documents_of(cu_q, cu_k)
    plan = build(block_indices, documents, TOKENS, BLOCK, entries_per_item(HEADS, KV_HEADS))
    schedule = unpack(plan, block_indices, TOKENS, 1, BLOCK)
    recorded.key_count[schedule.bucket_key_row.data_ptr()] = bucket_key_count(schedule.bucket_key_row, cu_k, BLOCK)
    out, lse = interface.forward(q, k, v, block_indices, documents, BLOCK, DIM**-0.5, plan)
    index_q, index_k = torch.randn(TOKENS, KV_HEADS, DIM).bfloat16(), torch.randn(TOKENS, 1, DIM).bfloat16()
    interface.backward_with_index_loss(torch.randn_like(q), torch.tensor(1.0), q, k, v, out, lse, index_q, index_k,
                                       block_indices, documents, BLOCK, DIM**-0.5, DIM**-0.5, None, plan)
    forward_kernel, backward_kernel = recorded.kernels
    assert len(forward_kernel.calls) == 3 and len(backward_kernel.calls) == 1
    # The last window's combine writes its rows of the call's output: no copy after.
    _, _, window_out, window_lse, *_ = recorded.stage_args["combine"]
    assert (window_out.data_ptr(), window_lse.data_ptr()) == (out[256:].data_ptr(), lse[256:].data_ptr())
    assert builds == [(KV_HEADS, TOKENS, TOPK)], "the step's plan is its only build"


def test_the_sm90_forward_declines_before_building_the_query_groups(monkeypatch):
    """With `TORCH_MSA_QUERY_OUTER=1`, inputs the SM90 kernels do not serve raise `UnsupportedInputs`
    before any group is built (the fallback builds its own); by default, at 64 queries, none is built at all."""
    import torch_msa
    from torch_msa.settings import QUERY_OUTER_ENV
    from torch_msa.sm90 import interface
    from torch_msa.stages import query_outer

    built = []
    monkeypatch.setattr(query_outer, "for_call", lambda *args: built.append(args))
    monkeypatch.setattr(interface, "forward_in_windows", lambda *args, **kwargs: None)
    cu = torch.tensor([0, 64], dtype=torch.int32)
    block_indices = torch.zeros((KV_HEADS, 64, TOPK), dtype=torch.int32)
    unserved = [torch.zeros(64, heads, 64) for heads in (HEADS, KV_HEADS, KV_HEADS)]  # fp32, D 64: declined
    args = backend_arguments("forward", *unserved, block_indices, cu, cu, 64, 64, BLOCK, DIM**-0.5)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    interface.forward(*args)
    assert built == []
    monkeypatch.setenv(QUERY_OUTER_ENV, "1")
    with pytest.raises(torch_msa.UnsupportedInputs):
        interface.forward(*args)
    assert built == []


@pytest.mark.parametrize(("setting", "heads", "max_seqlen", "measured", "least"), [
    (None, (HEADS, KV_HEADS), 8192, True, 8192), ("auto", (HEADS, KV_HEADS), 40000, True, 8192),
    (None, (HEADS, KV_HEADS), 8191, True, None), (None, (16, 1), 65536, True, None),
    (None, (128, 8), 8192, True, 8192), (None, (HEADS, KV_HEADS), 65536, False, None),
    ("0", (HEADS, KV_HEADS), 65536, True, None), ("off", (HEADS, KV_HEADS), 65536, True, None),
    ("1", (HEADS, KV_HEADS), 64, True, 0), ("yes", (16, 1), 64, False, 0),
])
def test_by_default_the_sm90_forward_runs_query_outer_in_long_documents_at_m3_heads(monkeypatch, setting, heads,
                                                                                     max_seqlen, measured, least):
    """Unset or `auto`, the setting runs the query-outer part where the default's rule admits it
    (`torch_msa.plan.groups.default_min_queries`), on a GPU it was measured on (`measured`): the
    call builds groups, bounded to documents of 8192 queries, only when its longest may be that
    long; `1` builds them for every document on any GPU, `0` never. The Triton forward builds none
    unless asked."""
    from torch_msa.settings import QUERY_OUTER_ENV
    from torch_msa.sm90 import interface
    from torch_msa.stages import query_outer
    from torch_msa.triton import interface as triton_interface

    built = []
    for module in (interface, triton_interface):
        monkeypatch.setattr(module, "forward_in_windows", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(interface, "runs_query_outer_by_default", lambda device: measured)
    if setting is None:
        monkeypatch.delenv(QUERY_OUTER_ENV, raising=False)
    else:
        monkeypatch.setenv(QUERY_OUTER_ENV, setting)
    num_heads, num_kv_heads = heads
    cu = torch.tensor([0, 64], dtype=torch.int32)
    block_indices = torch.zeros((num_kv_heads, 64, TOPK), dtype=torch.int32)
    q, k, v = (torch.zeros(64, h, DIM, dtype=torch.bfloat16) for h in (num_heads, num_kv_heads, num_kv_heads))
    args = backend_arguments("forward", q, k, v, block_indices, cu, cu, max_seqlen, max_seqlen, BLOCK, DIM**-0.5)

    class Built(Exception):
        """Stops the call once it has built its groups: no kernel runs on CPU."""

    def record(*args):
        built.append(args[-1])  # the least queries of a document that may run query-outer
        raise Built

    monkeypatch.setattr(query_outer, "for_call", record)
    with contextlib.suppress(Built):
        interface.forward(*args)
    assert built == ([] if least is None else [least])
    built.clear()
    with contextlib.suppress(Built):
        triton_interface.forward(*args)
    assert built == ([0] if least == 0 else [])


@pytest.mark.parametrize(("name", "expected"), [
    ("NVIDIA H100 80GB HBM3", True), ("NVIDIA H100 PCIe", True), ("NVIDIA H200", False), ("NVIDIA GH200 480GB", False),
])
def test_the_default_runs_the_query_outer_part_on_the_gpus_it_was_measured_on(name, expected, monkeypatch):
    from torch_msa.sm90 import common

    common._measured_device.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: name)
    try:
        assert common.runs_query_outer_by_default(torch.device("cuda", 0)) == expected
        assert not common.runs_query_outer_by_default(torch.device("cpu"))
    finally:
        common._measured_device.cache_clear()


def test_an_unknown_query_outer_setting_is_refused_by_name(monkeypatch):
    from torch_msa.settings import QUERY_OUTER_ENV
    from torch_msa.sm90 import interface

    monkeypatch.setenv(QUERY_OUTER_ENV, "sometimes")
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    cu = torch.tensor([0, 64], dtype=torch.int32)
    q, k, v = (torch.zeros(64, h, DIM, dtype=torch.bfloat16) for h in (HEADS, KV_HEADS, KV_HEADS))
    args = backend_arguments("forward", q, k, v, torch.zeros((KV_HEADS, 64, TOPK), dtype=torch.int32), cu, cu, 64,
                             64, BLOCK, DIM**-0.5)
    with pytest.raises(ValueError, match=r"TORCH_MSA_QUERY_OUTER: expected auto, 1 \(true, yes, on\) or 0 "
                                         r"\(false, no, off\), got 'sometimes'"):
        interface.forward(*args)


@requires_cute
@pytest.mark.parametrize("restricted_by_forward", [False, True])
def test_the_query_outer_part_launches_the_groups_kernel_on_its_window(recorded, monkeypatch, restricted_by_forward):
    """With a `QueryOuter` part the forward launches the CuTe groups kernel on the call's flat
    tables (checked against what was compiled, unconverted), its group ids and scalars, then the
    blocks kernel on the KV-outer part's plan, then the combine. Given the call's plan to restrict
    (`QueryOuter.call_plan`), it restricts it between the two kernels."""
    from torch_msa.plan.groups import build_query_groups, group_tokens
    from torch_msa.sm90 import forward_host
    from torch_msa.sm90.common import SCHEDULE_OPERANDS
    from torch_msa.stages import query_outer
    from torch_msa.stages.query_outer import QueryOuter

    forward_host._compiled_groups.cache_clear()
    q, k, v, block_indices, cu_q, cu_k, plan, schedule = _inputs(recorded.key_count)
    documents = documents_of(cu_q, cu_k)
    groups = build_query_groups(block_indices, documents, TOKENS, BLOCK, group_tokens(HEADS, KV_HEADS))
    work = QueryOuter(groups, block_indices, documents, 0, TOKENS)
    kv_outer = groups.kv_outer_indices
    kv_plan = pack(build_schedule(kv_outer, documents, TOKENS, BLOCK, entries_per_item(HEADS, KV_HEADS)))
    kv_schedule = unpack(kv_plan, kv_outer, TOKENS, 1, BLOCK)
    recorded.key_count[kv_schedule.bucket_key_row.data_ptr()] = bucket_key_count(kv_schedule.bucket_key_row, cu_k,
                                                                                  BLOCK)
    restrictions = []
    if restricted_by_forward:
        work = dataclasses.replace(work, call_plan=plan)

        def restricted_plan(given_work, num_keys, block_size, num_heads, call_plan):
            assert (given_work, num_keys, block_size, num_heads, call_plan) == (work, TOKENS, BLOCK, HEADS, plan)
            restrictions.append([len(kernel.calls) for kernel in recorded.kernels])
            return kv_schedule

        monkeypatch.setattr(query_outer, "restricted_plan", restricted_plan)
    args = backend_arguments("forward", q, k, v, kv_outer, cu_q, cu_k, TOKENS, TOKENS, BLOCK, DIM**-0.5,
                             None if restricted_by_forward else kv_plan)
    out, lse = forward_host.forward(*args, query_outer=work)
    # Compiled on first call: the groups kernel is queued first.
    groups_kernel, blocks = recorded.kernels
    assert type(groups_kernel.kernel).__name__ == "Sm90GroupsKernel"
    assert type(blocks.kernel).__name__ == "Sm90ForwardKernel"
    assert len(blocks.calls) == len(groups_kernel.calls) == 1 and recorded.stages[-1] == "combine"
    # Restricted once, after the groups kernel's launch and before the blocks kernel was compiled.
    assert restrictions == ([[1]] if restricted_by_forward else [])
    _assert_schedule_passed(blocks.calls[0], 5, kv_schedule,
                            recorded.key_count[kv_schedule.bucket_key_row.data_ptr()],
                            [name for name, _, _ in SCHEDULE_OPERANDS])
    call = groups_kernel.calls[0]
    # The output rows the KV-outer part holds no entry of go straight into the call's output, and
    # the combine skips the rows the done flags mark.
    done = call[7]
    assert call[5].data_ptr() == out.data_ptr() and call[6].data_ptr() == lse.data_ptr()
    # One fill: the flags are the -inf bits behind the partials' lse, which read as "not done".
    partial_lse = call[4]
    assert done.dtype == torch.int32 and done.shape == (TOKENS * KV_HEADS,) and (done < 0).all()
    assert done.data_ptr() == partial_lse.data_ptr() + partial_lse.numel() * 4
    assert recorded.stage_args["combine"][-1] is done
    assert torch.equal(call[8], block_indices.reshape(-1)) and torch.equal(call[9], groups.kv_outer_indices.reshape(-1))
    assert call[10] is groups.group_start and call[11] is groups.group_end
    assert torch.equal(call[12], groups.group_blocks.reshape(-1)) and torch.equal(call[13], groups.group_union.reshape(-1))
    assert call[14] is groups.group_key_start and call[15] is groups.group_position
    assert call[16] is groups.units and call[17] is groups.units_before
    # Every group id (0 to 299 // 8 + 1 = 38): the listed units of groups 0 to 38, at most one CTA
    # per (group, KV head).
    num_ids, most = groups.group_blocks.shape[1:]
    assert call[18] == TOPK and call[19] == pytest.approx(DIM**-0.5 * 1.4426950408889634)
    assert call[20:] == (most, num_ids, TOKENS, 0, 38, 0, TOKENS, min(132, 39 * KV_HEADS))
    forward_host._compiled_groups.cache_clear()
