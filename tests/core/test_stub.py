"""The C++ schema stub (`csrc_stub/msa_stub.cpp`).

The stub is compiled once per session; every test then runs a fresh Python process, because a
loaded library (and an imported torch_msa) cannot be unloaded from the test process.
"""

import json
import os
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.support import install
from torch_msa._schemas import NAMESPACE, SCHEMAS

STUB_SOURCE = Path(__file__).resolve().parents[2] / "csrc_stub" / "msa_stub.cpp"

_SUBPROCESS_TIMEOUT_S = 300


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter; `args` arrive as `sys.argv[1:]`."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
        capture_output=True, text=True, timeout=_SUBPROCESS_TIMEOUT_S,
    )


def _ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"subprocess failed (rc={proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _last_json(stdout: str):
    return json.loads(stdout.strip().splitlines()[-1])


def build_stub(build_dir: Path) -> Path:
    """Build the stub into `build_dir` in a subprocess (this process never loads it) and return
    the library's path. Skips, naming the install command, when the compiler torch builds with
    ($CXX, else c++) or ninja is missing; any other failure fails, whatever the build log says."""
    from torch.utils.cpp_extension import get_cxx_compiler, is_ninja_available

    compiler = get_cxx_compiler()
    if shutil.which(shlex.split(compiler)[0]) is None:
        pytest.skip(f"C++ stub tests need a C++ compiler: {compiler!r} ($CXX, else c++) is not on PATH; install one, "
                    f"e.g. with: sudo apt-get install g++")
    if not is_ninja_available():
        pytest.skip(f"C++ stub tests: {install.NINJA}")
    proc = _python(
        """
        import sys
        from torch.utils.cpp_extension import load
        path = load(name="msa_stub", sources=[sys.argv[1]], is_python_module=False,
                    build_directory=sys.argv[2], verbose=False)
        print(path)
        """,
        STUB_SOURCE, build_dir,
    )
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        pytest.fail(f"building csrc_stub/msa_stub.cpp with {compiler!r} failed:\n{log[-4000:]}")
    path = Path(proc.stdout.strip().splitlines()[-1])
    assert path.is_file(), log
    return path


@pytest.fixture(scope="session")
def stub_library(tmp_path_factory) -> Path:
    """Path of the compiled stub."""
    # The xdist workers of one run share the build: torch's load() takes a lock in its build
    # directory, so the second worker waits and then finds the library built.
    shared = "PYTEST_XDIST_WORKER" in os.environ
    build_dir = (tmp_path_factory.getbasetemp().parent if shared else tmp_path_factory.getbasetemp()) / "msa_stub_build"
    build_dir.mkdir(exist_ok=True)
    return build_stub(build_dir)


def test_a_missing_compiler_skips_naming_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    with pytest.raises(pytest.skip.Exception, match=r"is not on PATH; install one, e\.g\. with: sudo apt-get install g\+\+"):
        build_stub(tmp_path)


def test_a_failing_build_fails_whatever_its_log_says(tmp_path, monkeypatch):
    """A compiler that is there but fails is a broken toolchain or stub, not a missing one, even
    when its log reads like one ("command not found")."""
    real = shutil.which("c++")
    if real is None:
        pytest.skip("needs a C++ compiler, c++, to stand in for; install one, e.g. with: sudo apt-get install g++")
    compiler = tmp_path / "c++"  # answers torch's version checks, then fails to compile with a "missing tool" log
    compiler.write_text(f'#!/bin/sh\nfor arg; do [ "$arg" = -c ] && {{ echo "cc1plus: command not found" >&2; exit 1; }}; done\n'
                        f'exec {real} "$@"\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    (tmp_path / "build").mkdir()
    with pytest.raises(pytest.fail.Exception, match="command not found"):
        build_stub(tmp_path / "build")


def test_stub_source_repeats_schemas_verbatim():
    text = STUB_SOURCE.read_text()
    for name, schema in SCHEMAS.items():
        assert f'{{"{name}", "{schema}",' in text, (
            f"{name}: schema string of _schemas.py not found verbatim in {STUB_SOURCE.name}")
    assert "{at::Tag::pt2_compliant_tag}" in text


def test_stub_schemas_match_python(stub_library):
    out = _ok(_python(
        """
        import json, sys
        import torch
        torch.ops.load_library(sys.argv[1])
        ops = {}
        for name in sys.argv[2:]:
            op = getattr(torch.ops.msa, name).default
            ops[name] = {"schema": str(op._schema), "tags": [t.name for t in op.tags]}
        assert "torch_msa" not in sys.modules
        print(json.dumps(ops))
        """,
        stub_library, *SCHEMAS,
    ))
    ops = _last_json(out)
    for name, schema in SCHEMAS.items():
        assert ops[name]["schema"] == str(torch._C.parse_schema(f"{NAMESPACE}::{schema}"))
        assert "pt2_compliant_tag" in ops[name]["tags"], ops[name]["tags"]


def test_stub_only_raises_import_hint(stub_library):
    out = _ok(_python(
        """
        import json, sys
        import torch
        torch.ops.load_library(sys.argv[1])
        t = torch.zeros(1)
        calls = {
            "select_blocks": lambda: torch.ops.msa.select_blocks(t, t, t, t, 1, 1, 1, 64),
            "plan": lambda: torch.ops.msa.plan(t, t, t, 1, 1, 1, 64, 1),
            "forward": lambda: torch.ops.msa.forward(t, t, t, t, t, t, 1, 1, 64, 1.0),
            "backward": lambda: torch.ops.msa.backward(t, t, t, t, t, t, t, t, t, 1, 1, 64, 1.0),
            "indexer_kl": lambda: torch.ops.msa.indexer_kl(t, t, t, t, t, t, t, t, 1, 1, 64, 1.0, 1.0),
            "indexer_kl_backward": lambda: torch.ops.msa.indexer_kl_backward(
                t, t, t, t, t, t, t, t, t, t, 1, 1, 64, 1.0),
            "forward_with_index_loss": lambda: torch.ops.msa.forward_with_index_loss(
                t, t, t, t, t, t, t, t, 1, 1, 64, 1.0, 1.0, t),
            "backward_with_index_loss": lambda: torch.ops.msa.backward_with_index_loss(
                t, t, t, t, t, t, t, t, t, t, t, t, 1, 1, 64, 1.0, 1.0),
        }
        errors = {}
        for name, call in calls.items():
            try:
                call()
                errors[name] = None
            except Exception as e:
                errors[name] = [type(e).__name__, str(e)]
        print(json.dumps(errors))
        """,
        stub_library,
    ))
    errors = _last_json(out)
    assert set(errors) == set(SCHEMAS)
    for name, error in errors.items():
        assert error is not None, f"msa::{name} ran with only the stub loaded"
        kind, message = error
        assert kind == "RuntimeError", error
        assert "import torch_msa" in message and f"msa::{name}" in message, message


# Small forward + backward of both public entry points; the results go to argv[2].
_COMPUTE = """
    import sys
    import torch
    if sys.argv[1] != "-":
        torch.ops.load_library(sys.argv[1])
    import torch_msa
    g = torch.Generator().manual_seed(0)
    Tq = Tk = 200
    q = torch.randn(Tq, 4, 64, generator=g, requires_grad=True)
    k = torch.randn(Tk, 2, 64, generator=g, requires_grad=True)
    v = torch.randn(Tk, 2, 64, generator=g, requires_grad=True)
    index_q = torch.randn(Tq, 2, 32, generator=g)
    index_k = torch.randn(Tk, 1, 32, generator=g)
    weight = torch.randn(Tq, 4, 64, generator=g)
    res = {}
    out = torch_msa.msa_attention(q, k, v, index_q, index_k, topk=2, block_size=64)
    res["out"] = out.detach()
    res["dq"], res["dk"], res["dv"] = torch.autograd.grad((out * weight).sum(), (q, k, v))
    blocks = torch_msa.select_blocks(index_q, index_k, topk=2, block_size=64)
    out2, lse = torch_msa.sparse_attention(q, k, v, blocks, block_size=64, return_lse=True)
    res["blocks"], res["out2"], res["lse"] = blocks, out2.detach(), lse.detach()
    res["dq2"], res["dk2"], res["dv2"] = torch.autograd.grad((out2 * weight).sum() + lse.sum(), (q, k, v))
    torch.save(res, sys.argv[2])
"""


def test_stub_then_torch_msa_runs(stub_library, tmp_path):
    with_stub, without_stub = tmp_path / "with_stub.pt", tmp_path / "without_stub.pt"
    _ok(_python(_COMPUTE, stub_library, with_stub))
    _ok(_python(_COMPUTE, "-", without_stub))
    got, expected = torch.load(with_stub), torch.load(without_stub)
    assert set(got) == set(expected)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], msg=lambda m, key=key: f"{key}: {m}")
    # An invariant that does not depend on a second run: the local block (the highest id) is selected.
    assert (got["blocks"].amax(-1) == torch.arange(200).div(64, rounding_mode="floor").int()).all()
    assert torch.isfinite(got["dq"]).all() and got["dq"].abs().sum() > 0


def test_exported_program_with_stub(stub_library, tmp_path):
    program, data = tmp_path / "msa.pt2", tmp_path / "data.pt"
    _ok(_python(
        """
        import sys
        import torch
        import torch_msa

        class Attention(torch.nn.Module):
            def forward(self, q, k, v, index_q, index_k):
                return torch_msa.msa_attention(q, k, v, index_q, index_k, topk=2, block_size=64)

        def inputs(t, seed):
            g = torch.Generator().manual_seed(seed)
            shapes = [(t, 4, 64), (t, 2, 64), (t, 2, 64), (t, 2, 32), (t, 1, 32)]
            return tuple(torch.randn(s, generator=g) for s in shapes)

        tokens = torch.export.Dim("tokens", min=130, max=1000)
        exported = torch.export.export(Attention(), inputs(200, 0), dynamic_shapes=tuple({0: tokens} for _ in range(5)))
        torch.export.save(exported, sys.argv[1])
        x = inputs(330, 1)
        torch.save({"inputs": x, "expected": Attention()(*x)}, sys.argv[2])
        """,
        program, data,
    ))
    out = _ok(_python(
        """
        import json, sys
        import torch
        torch.ops.load_library(sys.argv[1])
        program = torch.export.load(sys.argv[2])
        data = torch.load(sys.argv[3])
        module = program.module()
        result = {"targets": sorted({str(n.target) for n in program.graph.nodes if "msa" in str(n.target)})}
        try:
            module(*data["inputs"])
            result["stub_error"] = None
        except Exception as e:
            result["stub_error"] = [type(e).__name__, str(e)]
        import torch_msa
        got = module(*data["inputs"])
        torch.testing.assert_close(got, data["expected"])
        result["after_import"] = "ok"
        print(json.dumps(result))
        """,
        stub_library, program, data,
    ))
    result = _last_json(out)
    assert result["targets"] == ["msa.forward.default", "msa.plan.default", "msa.select_blocks.default"]
    assert result["stub_error"] is not None, "the exported program ran with only the stub loaded"
    kind, message = result["stub_error"]
    assert kind == "RuntimeError" and "import torch_msa" in message, result["stub_error"]
    assert result["after_import"] == "ok"


def test_stub_after_torch_msa_is_a_no_op(stub_library):
    """Loaded after `import torch_msa`, the stub neither aborts nor shadows the Python kernels."""
    out = _ok(_python(
        """
        import sys
        import torch
        import torch_msa
        torch.ops.load_library(sys.argv[1])
        g = torch.Generator().manual_seed(0)
        blocks = torch_msa.select_blocks(torch.randn(130, 2, 32, generator=g), torch.randn(130, 1, 32, generator=g),
                                         topk=2, block_size=64)
        print(list(blocks.shape))
        """,
        stub_library,
    ))
    assert out.strip().splitlines()[-1] == "[2, 130, 2]"


@pytest.mark.slow
def test_aoti_package_with_stub(stub_library, tmp_path):
    """The stub's purpose end to end: an AOTInductor package loaded where torch_msa was not
    imported says what to do; without the stub the same load/run names no remedy."""
    package, data = tmp_path / "msa_aoti.pt2", tmp_path / "data.pt"
    _ok(_python(
        """
        import sys
        import torch
        import torch_msa

        class Attention(torch.nn.Module):
            def forward(self, q, k, v, index_q, index_k):
                return torch_msa.msa_attention(q, k, v, index_q, index_k, topk=2, block_size=64)

        g = torch.Generator().manual_seed(0)
        shapes = [(200, 4, 64), (200, 2, 64), (200, 2, 64), (200, 2, 32), (200, 1, 32)]
        x = tuple(torch.randn(s, generator=g) for s in shapes)
        torch._inductor.aoti_compile_and_package(torch.export.export(Attention(), x), package_path=sys.argv[1])
        torch.save({"inputs": x, "expected": Attention()(*x)}, sys.argv[2])
        """,
        package, data,
    ))
    run_package = """
        import json, sys
        import torch
        if sys.argv[1] != "-":
            torch.ops.load_library(sys.argv[1])
        data = torch.load(sys.argv[3])
        result = {}
        try:
            model = torch._inductor.aoti_load_package(sys.argv[2])
            model(*data["inputs"])
            result["error"] = None
        except Exception as e:
            result["error"] = str(e)
        if sys.argv[1] != "-":
            import torch_msa
            torch.testing.assert_close(model(*data["inputs"]), data["expected"])
            result["after_import"] = "ok"
        print(json.dumps(result))
        """
    with_stub = _last_json(_ok(_python(run_package, stub_library, package, data)))
    assert with_stub["error"] is not None and "import torch_msa" in with_stub["error"], with_stub
    assert with_stub["after_import"] == "ok"
    without_stub = _last_json(_ok(_python(run_package, "-", package, data)))
    assert without_stub["error"] is not None and "import torch_msa" not in without_stub["error"], without_stub
