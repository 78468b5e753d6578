"""torch_msa's warnings share one category, and first compiles are logged on the torch_msa logger."""

import logging
import warnings

import torch

import torch_msa
from torch_msa import api
from torch_msa.diagnostics import TorchMSAWarning


def test_warnings_have_a_category_users_can_filter(monkeypatch):
    monkeypatch.setattr(api, "_warned_untrained_index", False)
    q, k = torch.randn(70, 2, 64), torch.randn(70, 1, 64)
    index_q, index_k = torch.randn(70, 1, 32, requires_grad=True), torch.randn(70, 1, 32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch_msa.msa_attention(q, k, k, index_q, index_k, topk=1, block_size=64)
    assert [w.category for w in caught] == [TorchMSAWarning]
    assert issubclass(TorchMSAWarning, UserWarning) and torch_msa.TorchMSAWarning is TorchMSAWarning
    monkeypatch.setattr(api, "_warned_untrained_index", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=TorchMSAWarning)
        torch_msa.msa_attention(q, k, k, index_q, index_k, topk=1, block_size=64)  # filtered as a group


def test_first_compiles_are_logged_at_info(caplog):
    from torch_msa.cute_dsl.cute_io import compile_options
    from torch_msa.triton_utils.launch import launch

    with caplog.at_level(logging.INFO, logger="torch_msa"):
        compile_options("sm_90a", None)
        launch("msa_test_kernel", ("cpu", 1), [object()], lambda config: None)
        launch("msa_test_kernel", ("cpu", 1), [object()], lambda config: None)  # remembered: no second line
    messages = [record.getMessage() for record in caplog.records if record.name == "torch_msa"]
    assert messages == ["compiling a CuTe DSL kernel for sm_90a (once per process and shape)",
                        "compiling the Triton kernel msa_test_kernel for ('cpu', 1) (once per process and shape)"]
