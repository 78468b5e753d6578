"""One eager MiniMax-M3 training step (`msa_attention` forward and the gradients of q, k, v) on the
`sm90` backend: how many kernels it launches, and that no launch converts a tensor in Python.

Every CuTe DSL kernel is called with torch tensors through the TVM-FFI calling convention
(`torch_msa/cute_dsl/cute_io.py`); what remains around the kernels is a handful of fills and
casts. The plan build sorts and scans in its own kernels. The CPU side of the same path, with
the compile replaced: `tests/sm90/test_host_path.py`. Skipped without a compute capability 9.0
GPU or the CuTe DSL.
"""

import pytest
import torch

import torch_msa
from tests.support.sm90 import SM90_MARKS
from torch_msa.settings import QUERY_OUTER_ENV

pytestmark = SM90_MARKS

TOKENS = 8192  # one document, within one query window (12098 M3 queries): the forward runs once
HQ, HKV, D, TOPK, BLOCK = 64, 4, 128, 16, 128

# The launches of the step, by design:
OWN_LAUNCHES = {
    "select_blocks": 3,  # the -1 fill of the selection, the located queries, the selection kernel
    "plan": 5,  # the Triton plan kernels: count, the column scan, the scan, place, items
    "forward": 4,  # bucket key counts, the -inf fill of the partial lse, the CuTe kernel, the combine
    "backward": 7,  # one zero fill of the accumulators, delta, bucket key counts, the CuTe kernel, three casts
}
# The forward's query-outer part, by design: the groups (a copy of the selection, two kernels), the
# plan restricted to the KV-outer part (four kernels) and the CuTe groups kernel; its `done` flags
# share the partials' lse fill.
QUERY_OUTER_LAUNCHES = 8


# The step with the index loss: the plain step's launches and 15 of the index loss's own, 37 as
# `python -m benchmarks.overhead` counted them on the H200 less the three the loss's kernels took
# over (the mean's scale, the gradient's coefficient and one of its zero fills).
INDEX_LOSS_STEP_LAUNCHES = 34


def _device_activities(fn) -> list[str]:
    """The names of the kernels, fills and copies `fn()` runs on the GPU (torch.profiler)."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as profile:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.parametrize("query_outer", ["0", "1"], ids=["kv-outer", "query-outer"])
def test_an_eager_step_launches_few_kernels_and_converts_no_tensor_in_python(query_outer, monkeypatch):
    import cutlass.cute.runtime as runtime
    import tvm_ffi  # noqa: F401  (installs torch's DLPack exchange API where torch lacks it natively)

    # The C path apache-tvm-ffi takes for torch tensors (no Python DLPack capsule per argument).
    assert hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
    conversions = []
    real_from_dlpack = runtime.from_dlpack

    def from_dlpack(*args, **kwargs):
        conversions.append(args)
        return real_from_dlpack(*args, **kwargs)

    monkeypatch.setattr(runtime, "from_dlpack", from_dlpack)
    monkeypatch.setenv(QUERY_OUTER_ENV, query_outer)
    generator = torch.Generator(device="cuda").manual_seed(0)

    def normal(*shape, grad=False):
        return torch.randn(*shape, generator=generator, device="cuda").to(torch.bfloat16).requires_grad_(grad)

    q, k, v = normal(TOKENS, HQ, D, grad=True), normal(TOKENS, HKV, D, grad=True), normal(TOKENS, HKV, D, grad=True)
    index_q, index_k, grad_out = normal(TOKENS, HKV, D), normal(TOKENS, 1, D), normal(TOKENS, HQ, D)
    more = QUERY_OUTER_LAUNCHES if query_outer == "1" else 0
    cu = torch.tensor([0, TOKENS], dtype=torch.int32, device="cuda")

    def step():
        out = torch_msa.msa_attention(q, k, v, index_q, index_k, cu, cu, TOKENS, TOKENS)
        return torch.autograd.grad(out, (q, k, v), grad_out)

    assert {op: torch_msa.resolve(op, q.device).name for op in ("forward", "backward")} == {"forward": "sm90",
                                                                                           "backward": "sm90"}
    step()  # compiles the kernels
    conversions.clear()
    launches = _device_activities(step)
    assert not conversions, f"{len(conversions)} tensors converted by cutlass.cute.runtime.from_dlpack"
    bound = sum(OWN_LAUNCHES.values()) + more
    assert len(launches) <= bound, f"{len(launches)} launches, expected at most {bound}: {sorted(launches)}"

    # The same step training the index branch: the fused backward and the index loss's own kernels.
    index_q.requires_grad_(), index_k.requires_grad_()

    def step_with_index_loss():
        out, kl, _ = torch_msa.msa_attention(q, k, v, index_q, index_k, cu, cu, TOKENS, TOKENS, index_loss=True)
        return torch.autograd.grad((out, kl), (q, k, v, index_q, index_k), (grad_out, torch.ones_like(kl)))

    step_with_index_loss()
    conversions.clear()
    launches = _device_activities(step_with_index_loss)
    assert not conversions, f"{len(conversions)} tensors converted by cutlass.cute.runtime.from_dlpack"
    assert len(launches) <= INDEX_LOSS_STEP_LAUNCHES + more, (
        f"{len(launches)} launches, expected at most {INDEX_LOSS_STEP_LAUNCHES + more}: {sorted(launches)}")


@pytest.mark.parametrize("query_outer", ["0", "1"], ids=["kv-outer", "query-outer"])
def test_a_step_with_the_fused_index_loss_builds_one_plan_and_no_sort_over_query_windows(query_outer, monkeypatch):
    """One plan per step: the forward's query windows (their KV-outer part restricted from it when
    the query-outer part runs), the backward and the fused index loss all walk the plan
    `msa_attention` builds, and nothing in the step runs torch's sort (the plan sorts in its own
    kernels)."""
    from torch_msa import query_windows
    from torch_msa.plan import kernels as plan_kernels

    builds = []
    real_plan = plan_kernels.plan

    def counted_plan(*args):
        builds.append(tuple(args[0].shape))
        return real_plan(*args)

    monkeypatch.setattr(plan_kernels, "plan", counted_plan)
    monkeypatch.setenv(QUERY_OUTER_ENV, query_outer)
    per_query = query_windows.partial_bytes_per_query(HQ, TOPK, D, torch.bfloat16)
    monkeypatch.setattr(query_windows, "PARTIAL_BYTES", 3000 * per_query)  # three windows of 8192 queries
    generator = torch.Generator(device="cuda").manual_seed(0)

    def normal(*shape, grad=False):
        return torch.randn(*shape, generator=generator, device="cuda").to(torch.bfloat16).requires_grad_(grad)

    q, k, v = normal(TOKENS, HQ, D, grad=True), normal(TOKENS, HKV, D, grad=True), normal(TOKENS, HKV, D, grad=True)
    index_q, index_k = normal(TOKENS, HKV, D, grad=True), normal(TOKENS, 1, D, grad=True)
    cu = torch.tensor([0, TOKENS], dtype=torch.int32, device="cuda")

    def step():
        out, kl, _ = torch_msa.msa_attention(q, k, v, index_q, index_k, cu, cu, TOKENS, TOKENS, index_loss=True)
        torch.autograd.backward((out, kl), (torch.ones_like(out), torch.ones_like(kl)))

    step()  # compiles the kernels
    builds.clear()
    launches = _device_activities(step)
    assert builds == [(HKV, TOKENS, TOPK)], builds
    sorts = [name for name in launches if "sort" in name.lower() and "radix" in name.lower()]
    assert not sorts, f"torch's sort in the step: {sorts}"
