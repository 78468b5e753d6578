"""The backend registry: default choice, TORCH_MSA_BACKEND, fallback on unsupported inputs."""

import warnings

import pytest
import torch

import torch_msa
from torch_msa import backends


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
    with pytest.raises(torch_msa.BackendError, match="cannot serve msa::forward on cpu; backends that can: reference"):
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
    with pytest.warns(UserWarning, match="'picky2' does not serve these msa::forward inputs \\(needs topk == 16\\); falling back to 'reference'"):
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
