"""`import torch_msa` works on a CPU-only host and pulls in no optional backend."""

import subprocess
import sys
import typing


def test_import_is_light():
    # torch itself may load cuda.bindings; torch_msa must add nothing of the kind on top.
    code = (
        "import sys, torch\n"
        "before = set(sys.modules)\n"
        "import torch_msa\n"
        "optional = ('triton', 'cutlass', 'cuda', 'fmha_sm100')\n"
        "added = sorted(m for m in set(sys.modules) - before if m.split('.')[0] in optional)\n"
        "assert not added, added\n"
        "assert 'triton' not in sys.modules and 'cutlass' not in sys.modules\n"
        "assert 'transformers' not in sys.modules  # nor HF, unless its modeling code was imported first\n"
        "assert hasattr(torch.ops.msa, 'forward')\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_importing_twice_in_one_process_is_harmless():
    code = (
        "import gc, importlib, torch, torch_msa, torch_msa.ops\n"
        "importlib.reload(torch_msa.ops); gc.collect()\n"
        "q = torch.randn(70, 2, 64, requires_grad=True); k = torch.randn(70, 1, 64)\n"
        "blocks = torch.zeros(1, 70, 1, dtype=torch.int32)\n"
        "torch_msa.sparse_attention(q, k, k, blocks, block_size=64).sum().backward()\n"
        "assert q.grad.shape == q.shape\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_public_names_resolve():
    import torch_msa

    missing = [name for name in torch_msa.__all__ if not hasattr(torch_msa, name)]
    assert not missing, missing
    results = typing.get_args(torch_msa.MSAResult)
    assert {"AttentionOutput", "MSAResult", *(t.__name__ for t in results)} <= set(torch_msa.__all__)
    # The fields are the contract, by name and by position.
    assert torch_msa.AttentionOutput._fields == ("out", "lse")
    assert torch_msa.MSAAttentionOutput._fields == ("out", "lse", "block_indices", "kl", "kl_value")
    assert len(results) == 7 and all(t._fields[0] == "out" for t in results)
