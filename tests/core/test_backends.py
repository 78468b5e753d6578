"""The backend registry: default choice, TORCH_MSA_BACKEND, fallback on unsupported inputs."""

import contextlib
import importlib.util
import re
import warnings

import pytest
import torch

import torch_msa
import torch_msa.triton as triton_backend
from tests.support import install
from tests.support.documents import Documents, backend_arguments
from torch_msa import __main__ as self_check
from torch_msa import backends, cute_dsl, sm90, sm100, testing


@pytest.fixture
def stand_in():
    """Register stand-in backends for one test and remove them afterwards."""
    names = []

    def register(backend):
        torch_msa.register_backend(backend)
        names.append(backend.name)
        return backend

    yield register
    for name in names:
        backends.unregister_backend(name)


def _inputs():
    q, k, v = torch.randn(80, 2, 64), torch.randn(80, 1, 64), torch.randn(80, 1, 64)
    return q, k, v, torch.zeros(1, 80, 1, dtype=torch.int32)


def test_reference_serves_every_op_on_cpu():
    for op in backends.OPS:
        assert torch_msa.resolve(op, torch.device("cpu")).name == "reference"


def test_the_registry_asks_the_backends_once_per_op_and_device_until_it_changes(stand_in, monkeypatch):
    asked = []

    def available(device):
        asked.append(device.type)
        return True

    monkeypatch.delenv(torch_msa.BACKEND_ENV, raising=False)
    forward = backends._BACKENDS["reference"].ops["forward"]
    stand_in(torch_msa.Backend("counted", {"forward": forward}, priority=50, available=available))
    cpu = torch.device("cpu")
    assert [torch_msa.resolve("forward", cpu).name for _ in range(3)] == ["counted"] * 3
    assert asked == ["cpu"]
    stand_in(torch_msa.Backend("better", {"forward": forward}, priority=60))  # the registry changed
    assert torch_msa.resolve("forward", cpu).name == "better" and asked == ["cpu"] * 2
    monkeypatch.setenv(torch_msa.BACKEND_ENV, "counted")  # another forced name: asked anew
    assert torch_msa.resolve("forward", cpu).name == "counted" and len(asked) == 4
    backends.unregister_backend("better")
    monkeypatch.delenv(torch_msa.BACKEND_ENV)
    assert torch_msa.resolve("forward", cpu).name == "counted" and len(asked) == 5
    # `cuda` without an index is whichever device is current at the call: asked every time.
    for _ in range(2):
        torch_msa.resolve("forward", torch.device("cuda"))
    assert asked[5:] == ["cuda", "cuda"]


def test_a_forced_backend_without_a_plan_op_gets_the_best_plan(stand_in, monkeypatch):
    stand_in(torch_msa.Backend("no_plan", {"forward": backends._BACKENDS["reference"].ops["forward"]}))
    monkeypatch.setenv(torch_msa.BACKEND_ENV, "no_plan")
    assert torch_msa.resolve("plan", torch.device("cpu")).name == "reference"
    assert torch_msa.resolve("forward", torch.device("cpu")).name == "no_plan"
    torch_msa.sparse_attention(*_inputs(), block_size=64)


def test_higher_priority_backend_wins_and_env_forces(stand_in, monkeypatch):
    calls = []

    def fast_forward(*args):
        calls.append("fast")
        return backends._BACKENDS["reference"].ops["forward"](*args)

    stand_in(torch_msa.Backend("fast", {"forward": fast_forward}, priority=10, device_types=("cpu",)))
    torch_msa.sparse_attention(*_inputs(), block_size=64)
    assert calls == ["fast"]
    assert torch_msa.resolve("backward", torch.device("cpu")).name == "reference"  # fast has no backward
    monkeypatch.setenv(torch_msa.BACKEND_ENV, "reference")
    torch_msa.sparse_attention(*_inputs(), block_size=64)
    assert calls == ["fast"]


def test_forcing_an_unknown_or_unable_backend_errors_clearly(stand_in, monkeypatch):
    stand_in(torch_msa.Backend("gpu_only", {"forward": lambda *a: None}, device_types=("cuda",)))
    monkeypatch.setenv(torch_msa.BACKEND_ENV, "nonsense")
    with pytest.raises(torch_msa.BackendError, match="'nonsense' names no backend; registered: .*reference"):
        torch_msa.sparse_attention(*_inputs(), block_size=64)
    monkeypatch.setenv(torch_msa.BACKEND_ENV, "gpu_only")
    with pytest.raises(torch_msa.BackendError, match="cannot serve msa::forward on cpu: it serves cuda devices only, "
                                                     "not cpu; backends that can: reference"):
        torch_msa.sparse_attention(*_inputs(), block_size=64)


def test_unsupported_inputs_fall_back_with_one_warning(stand_in):
    def picky_forward(*args):
        raise torch_msa.UnsupportedInputs("only D = 128")

    stand_in(torch_msa.Backend("picky", {"forward": picky_forward}, priority=5))
    with pytest.warns(UserWarning, match="falling back"):
        expected = torch_msa.sparse_attention(*_inputs(), block_size=64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise here
        again = torch_msa.sparse_attention(*_inputs(), block_size=64)
    assert again.shape == expected.shape


def test_fallback_warning_names_backend_and_reason(stand_in):
    def picky_forward(*args):
        raise torch_msa.UnsupportedInputs("needs topk == 16")

    stand_in(torch_msa.Backend("picky2", {"forward": picky_forward}, priority=5))
    with pytest.warns(UserWarning, match="'picky2' does not serve these msa::forward inputs \\(needs topk == 16\\); "
                                         "falling back to 'reference'"):
        torch_msa.sparse_attention(*_inputs(), block_size=64)


def test_availability_is_consulted_lazily(stand_in):
    asked = []

    def available(device):
        asked.append(device.type)
        return False

    stand_in(torch_msa.Backend("lazy", {"forward": lambda *a: None}, priority=9, available=available))
    assert asked == []
    assert torch_msa.resolve("forward", torch.device("cpu")).name == "reference"
    assert asked == ["cpu"]


def test_register_rejects_unknown_ops():
    with pytest.raises(ValueError, match="unknown ops \\['fwd'\\]"):
        torch_msa.register_backend(torch_msa.Backend("typo", {"fwd": lambda *a: None}))


# --- forced backends, the reasons a backend cannot serve, opt-in and slow-path notes -------------


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA host on this machine: `fake_cuda(capability, extras=..., triton=...)` sets what the
    backends see of cuda:0. Memoized device facts and warnings are reset around the test."""

    def caches_clear():
        cute_dsl._capability_of.cache_clear()
        sm100._extras_installed.cache_clear()
        sm90._extras_installed.cache_clear()
        triton_backend._capability.cache_clear()
        triton_backend._triton_installed.cache_clear()
        backends.forget_resolutions()

    def fake(capability=(9, 0), extras=True, triton=True, cuda=True):
        caches_clear()
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
        present = {name: extras for name in sm100._REQUIRED_MODULES + sm90._REQUIRED_MODULES} | {"triton": triton}
        real_find_spec = importlib.util.find_spec

        def find_spec(name, package=None):
            if name in present:
                return object() if present[name] else None
            return real_find_spec(name, package)

        monkeypatch.setattr(importlib.util, "find_spec", find_spec)
        return torch.device("cuda", 0)

    monkeypatch.setattr(backends, "_warned", set())
    monkeypatch.delenv(torch_msa.BACKEND_ENV, raising=False)
    yield fake
    caches_clear()


def test_a_forced_backend_serves_only_the_ops_it_implements(stand_in, monkeypatch):
    stand_in(torch_msa.Backend("forward_only", {"forward": backends._BACKENDS["reference"].ops["forward"]},
                               device_types=("cpu",)))
    monkeypatch.setenv(torch_msa.BACKEND_ENV, "forward_only")
    cpu = torch.device("cpu")
    expected = dict.fromkeys(backends.OPS, "reference") | {"forward": "forward_only"}
    assert {op: torch_msa.resolve(op, cpu).name for op in backends.OPS} == expected
    assert self_check.resolve_ops(cpu) == expected


def test_forcing_sm100_elsewhere_is_an_error_for_its_ops_only(fake_cuda, monkeypatch):
    hopper = fake_cuda(capability=(9, 0))
    monkeypatch.setenv(torch_msa.BACKEND_ENV, "sm100")
    assert torch_msa.resolve("select_blocks", hopper).name == "triton"
    for op in ("forward", "backward"):
        with pytest.raises(torch_msa.BackendError,
                           match=f"'sm100' cannot serve msa::{op} on cuda:0: cuda:0 has compute "
                                 "capability 9.0; the SM100 kernels need 10.0"):
            torch_msa.resolve(op, hopper)


@pytest.mark.parametrize(
    ("backend", "host", "why"),
    [
        ("sm100", dict(cuda=False), "no CUDA device is available"),
        ("sm100", dict(capability=(12, 0)), "cuda:0 has compute capability 12.0; the SM100 kernels need 10.0"),
        ("sm100", dict(capability=(10, 0), extras=False),
         'cannot find fmha_sm100, cutlass, .*install: pip install ".\\[cute\\]" in the torch_msa checkout .*'
         'then the official MSA kernels .*pip install "fmha-sm100 @ git\\+https://github.com/MiniMax-AI/MSA.git@'),
        ("triton", dict(cuda=False), "no CUDA device is available"),
        ("triton", dict(capability=(7, 5)), "cuda:0 has compute capability 7.5 < 8.0"),
        ("triton", dict(triton=False), "triton is not installed \\(pip install triton"),
    ],
)
def test_a_forced_backend_that_cannot_serve_says_why(fake_cuda, monkeypatch, backend, host, why):
    device = fake_cuda(**host)
    monkeypatch.setenv(torch_msa.BACKEND_ENV, backend)
    with pytest.raises(torch_msa.BackendError, match=f"{backend}' cannot serve msa::forward on cuda:0: {why}"):
        torch_msa.resolve("forward", device)


def test_self_check_with_a_forced_backend_names_the_op_and_the_reason(monkeypatch, capsys):
    monkeypatch.setenv(torch_msa.BACKEND_ENV, "")  # restored after the test; main() sets it
    assert self_check.main(["--backend", "sm100", "--device", "cpu"]) == 1
    captured = capsys.readouterr()
    assert "'sm100' cannot serve msa::forward on cpu: it serves cuda devices only, not cpu" in captured.err
    assert "select_blocks" not in captured.err
    assert "self-check: FAIL" in captured.out


def test_sm100_is_opt_in_with_a_one_time_note(fake_cuda, monkeypatch):
    blackwell = fake_cuda(capability=(10, 0))
    assert sm100.available(blackwell)
    with pytest.warns(UserWarning, match="sm100 backend .* is opt-in .*enable it with TORCH_MSA_BACKEND=sm100$"):
        assert torch_msa.resolve("forward", blackwell).name == "triton"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the note is printed once
        assert [torch_msa.resolve(op, blackwell).name for op in backends.OPS] == ["triton"] * len(backends.OPS)
    monkeypatch.setenv(torch_msa.BACKEND_ENV, "sm100")
    assert {op: torch_msa.resolve(op, blackwell).name for op in backends.OPS} == (
        dict.fromkeys(backends.OPS, "triton") | {"forward": "sm100", "backward": "sm100", "backward_with_index_loss": "sm100"})


def test_the_sm100_note_says_what_to_install_and_appears_only_on_sm100(fake_cuda):
    with pytest.warns(UserWarning, match='after installing what it needs \\(pip install ".\\[cute\\]" in the torch_msa checkout'):
        torch_msa.resolve("forward", fake_cuda(capability=(10, 0), extras=False))
    backends._warned.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch_msa.resolve("forward", fake_cuda(capability=(9, 0)))


def _cpu_inputs():
    q, k, v, block_indices = _inputs()
    return (q, k, v, block_indices, *testing.cu_seqlens([80]), 80, 80, 64, 0.125)


def test_a_cuda_call_served_by_the_reference_warns_once_naming_why(fake_cuda):
    # The registry decides by the device it is given; the reference then runs on CPU tensors.
    device = fake_cuda(triton=False)
    with pytest.warns(UserWarning, match="msa::forward on cuda:0 runs on the reference backend, the slow path: "
                                         "sm90: cannot find triton; .*; triton: triton is not installed"):
        backends.call("forward", device, *backend_arguments("forward", *_cpu_inputs()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        backends.call("forward", device, *backend_arguments("forward", *_cpu_inputs()))


def test_a_cuda_fallback_to_the_reference_says_it_is_the_slow_path(fake_cuda, stand_in):
    device = fake_cuda(triton=False)

    def picky_forward(*args):
        raise torch_msa.UnsupportedInputs("only D = 128")

    stand_in(torch_msa.Backend("picky_cuda", {"forward": picky_forward}, priority=5, device_types=("cuda",)))
    with pytest.warns(UserWarning, match="'picky_cuda' does not serve these msa::forward inputs \\(only D = 128\\); "
                                         "falling back to 'reference' \\(the slow path\\)"):
        backends.call("forward", device, *backend_arguments("forward", *_cpu_inputs()))


def test_inputs_a_forced_backend_declines_fall_back_with_a_warning(stand_in, monkeypatch):
    def picky_forward(*args):
        raise torch_msa.UnsupportedInputs("only bf16")

    stand_in(torch_msa.Backend("picky_forced", {"forward": picky_forward}, device_types=("cpu",)))
    monkeypatch.setenv(torch_msa.BACKEND_ENV, "picky_forced")
    monkeypatch.setattr(backends, "_warned", set())
    with pytest.warns(UserWarning, match="'picky_forced' does not serve these msa::forward inputs \\(only bf16\\); "
                                         "falling back to 'reference'$"):
        torch_msa.sparse_attention(*_inputs(), block_size=64)


def test_deterministic_mode_serves_the_deterministic_backward(monkeypatch):
    """The backend picks the kernel per call from `torch.are_deterministic_algorithms_enabled()`."""
    pytest.importorskip("triton", reason=install.TRITON)
    from torch_msa.triton import backward as backward_kernel
    from torch_msa.triton import backward_deterministic
    from torch_msa.triton import interface as triton_interface

    calls = []
    monkeypatch.setattr(backward_deterministic, "backward", lambda *args: calls.append("deterministic"))
    monkeypatch.setattr(backward_kernel, "backward", lambda *args: calls.append("atomic"))
    q, k = torch.zeros(1, 2, 64), torch.zeros(1, 1, 64)
    for enabled in (True, False):
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda enabled=enabled: enabled)
        triton_interface.backward(q, q, k, k, q, None, None, Documents(None, None, 1, 1), 64, 1.0)
    assert calls == ["deterministic", "atomic"]


def test_sm90_serves_forward_and_backward_by_default_and_says_why_it_cannot_serve(fake_cuda, monkeypatch):
    hopper = fake_cuda(capability=(9, 0))
    assert sm90.available(hopper)
    expected = dict.fromkeys(backends.OPS, "triton") | {"forward": "sm90", "backward": "sm90", "backward_with_index_loss": "sm90"}
    assert {op: torch_msa.resolve(op, hopper).name for op in backends.OPS} == expected
    monkeypatch.setenv(torch_msa.BACKEND_ENV, "sm90")
    assert {op: torch_msa.resolve(op, hopper).name for op in backends.OPS} == expected
    monkeypatch.setenv(torch_msa.BACKEND_ENV, "triton")
    assert torch_msa.resolve("forward", hopper).name == "triton"
    assert torch_msa.resolve("backward", hopper).name == "triton"
    monkeypatch.delenv(torch_msa.BACKEND_ENV)
    assert torch_msa.resolve("forward", fake_cuda(capability=(9, 0), extras=False)).name == "triton"
    monkeypatch.setenv(torch_msa.BACKEND_ENV, "sm90")
    blackwell = fake_cuda(capability=(10, 0))
    with pytest.raises(torch_msa.BackendError, match="cuda:0 has compute capability 10.0; the SM90 kernel needs 9.0"):
        torch_msa.resolve("forward", blackwell)
    without_extra = fake_cuda(capability=(9, 0), extras=False)
    with pytest.raises(torch_msa.BackendError, match=re.escape(f"install the CuTe DSL: {cute_dsl.INSTALL_COMMAND}")) as caught:
        torch_msa.resolve("forward", without_extra)
    assert "tvm_ffi" in str(caught.value), "apache-tvm-ffi is named among what is missing"


def test_sm90_serves_deterministic_mode_with_its_deterministic_variant(monkeypatch):
    """The SM90 backward kernel adds with atomics, so under deterministic algorithms the backend
    calls its bitwise-reproducible variant instead; otherwise the kernel."""
    pytest.importorskip("triton", reason=install.TRITON)
    from torch_msa.sm90 import backward_deterministic, backward_host
    from torch_msa.sm90 import interface as sm90_interface

    calls = []
    monkeypatch.setattr(backward_deterministic, "backward", lambda *args: calls.append("deterministic"))
    monkeypatch.setattr(backward_host, "backward", lambda *args: calls.append("atomic"))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())  # a CPU host
    q, k = torch.zeros(1, 16, 128), torch.zeros(1, 1, 128)
    for enabled in (True, False):
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda enabled=enabled: enabled)
        sm90_interface.backward(q, q, k, k, q, None, None, Documents(None, None, 1, 1), 128, 1.0)
    assert calls == ["deterministic", "atomic"]


@pytest.mark.parametrize("given", [True, False], ids=["plan", "no_plan"])
def test_the_composed_index_loss_hands_the_step_plan_to_loss_ops_that_take_one(stand_in, given):
    """Without a fused op the backward runs, then the registry's loss ops: the step's plan goes to
    a loss implementation that takes a `plan` keyword (which then builds none) and not to one that
    does not, and the result is the reference's."""
    from torch_msa import reference_index_loss

    received = {}

    def indexer_kl(*args, plan=None):
        received["indexer_kl"] = plan
        return reference_index_loss.indexer_kl(*args)

    def indexer_kl_backward(*args):
        received["indexer_kl_backward"] = len(args)
        return reference_index_loss.indexer_kl_backward(*args)

    reference_ops = backends._BACKENDS["reference"].ops
    generator = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 50, 130], dtype=torch.int32)
    q, index_q = torch.randn(130, 4, 64, generator=generator), torch.randn(130, 2, 16, generator=generator)
    k, v = torch.randn(130, 2, 64, generator=generator), torch.randn(130, 2, 64, generator=generator)
    index_k = torch.randn(130, 1, 16, generator=generator)
    block_indices = testing.random_block_indices(cu, cu, 2, 2, 64)
    docs = (cu, cu, 80, 80)
    plan = torch_msa.build_plan(block_indices, *docs, num_keys=130, num_heads=4, block_size=64) if given else None
    out, lse = torch.ops.msa.forward(q, k, v, block_indices, *docs, 64, 0.125, plan)
    grad_out = torch.randn(out.shape, generator=generator)
    args = (grad_out, torch.tensor(0.7), q, k, v, out, lse, index_q, index_k, block_indices, *docs, 64, 0.125, 0.25,
            None, plan)
    expected = torch.ops.msa.backward_with_index_loss(*args)
    stand_in(torch_msa.Backend("loss_walking_plans", {"backward": reference_ops["backward"], "indexer_kl": indexer_kl,
                                                      "indexer_kl_backward": indexer_kl_backward},
                               priority=1_000, device_types=("cpu",)))
    got = torch.ops.msa.backward_with_index_loss(*args)
    assert received["indexer_kl_backward"] == 11  # the op's arguments in the backends' form, no plan
    if given:
        assert received["indexer_kl"] is not None and torch.equal(received["indexer_kl"], plan)
    else:
        assert received["indexer_kl"] is None
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)
