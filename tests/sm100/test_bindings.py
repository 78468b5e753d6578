"""The SM100 backend on a CPU host: lazy bindings, the two compatibility patches, the device gates
and the backend's dispatch contract.

The official package (`fmha_sm100`), MSA's CuTe DSL helper module (`src.common.utils`), the CuTe
DSL itself and our backward module are replaced by stand-in modules in `sys.modules`; monkeypatch
restores `sys.modules` after every test. The last test compiles the fmax patch for sm_100a with
the real CuTe DSL when a served release is installed (CI runs it with both ends of the range).
"""

import contextlib
import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

import torch_msa
from tests.support.documents import Documents, backend_arguments
from torch_msa import backends, cute_dsl, reference, sm100, testing
from torch_msa.backends import UnavailableError, UnsupportedInputs
from torch_msa.sm100 import bindings
from torch_msa.sm100 import common as sm100_common
from torch_msa.sm100.common import INSTALL_COMMAND

REPO_ROOT = Path(__file__).resolve().parents[2]
SM103A = "-gencode=arch=compute_103a,code=sm_103a"
SM100A = "-gencode=arch=compute_100a,code=sm_100a"

# `nvcc --version` as the CUDA 12.8, 12.9 and 13.0 toolkits print it.
NVCC_VERSION_OUTPUT = {
    (12, 8): """\
nvcc: NVIDIA (R) Cuda compiler driver
Copyright (c) 2005-2025 NVIDIA Corporation
Built on Fri_Feb_21_20:23:50_PST_2025
Cuda compilation tools, release 12.8, V12.8.93
Build cuda_12.8.r12.8/compiler.35583870_0
""",
    (12, 9): """\
nvcc: NVIDIA (R) Cuda compiler driver
Copyright (c) 2005-2025 NVIDIA Corporation
Built on Tue_May_27_02:21:03_PDT_2025
Cuda compilation tools, release 12.9, V12.9.86
Build cuda_12.9.r12.9/compiler.36037853_0
""",
    (13, 0): """\
nvcc: NVIDIA (R) Cuda compiler driver
Copyright (c) 2005-2025 NVIDIA Corporation
Built on Wed_Aug_20_01:58:59_PM_PDT_2025
Cuda compilation tools, release 13.0, V13.0.88
Build cuda_13.0.r13.0/compiler.36424714_0
""",
}


# --- stand-ins -------------------------------------------------------------------------------


class FakeFloat32:
    """Stands in for `cutlass.Float32`: wraps a value; `ir_value` returns a tagged tuple."""

    def __init__(self, value):
        self.value = value

    def ir_value(self, *, loc=None, ip=None):
        return ("ir", self.value, loc, ip)


class FakeNVVM:
    """Stands in for `cutlass._mlir.dialects.nvvm` with the served `fmax(a, b, *, c=None, ...)` binding."""

    def __init__(self):
        self.calls = []

    def fmax(self, a, b, *, c=None, loc=None, ip=None):
        self.calls.append({"a": a, "b": b, "c": c, "loc": loc, "ip": ip})
        return ("max", a, b, c)


def fake_dsl_user_op(function):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        return function(*args, **kwargs)

    wrapper.decorated_by_dsl_user_op = True
    return wrapper


def pinned_fmax(a, b, c=None, *, loc=None, ip=None):
    raise AssertionError("the pinned explicit-result helper must have been replaced")


def pinned_nvcc_flags(cache_dir, fmha=True):
    """The shape of `fmha_sm100.jit._get_nvcc_flags` at the pinned revision: one joined string."""
    flags = ["-O3", "-std=c++20", SM100A, SM103A, "-Xcudafe --diag_suppress=2908", f"-I{cache_dir}",
             "-Xptxas", "-O1" if fmha else "-O3"]
    return " ".join(flags)


def _module(name, file, **attributes):
    module = types.ModuleType(name)
    module.__file__ = str(file)
    module.__dict__.update(attributes)
    return module


def write_nvcc(cuda_home: Path, output: str) -> Path:
    """A `bin/nvcc` that prints `output` and logs each call to `<cuda_home>/calls`."""
    nvcc = cuda_home / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True, exist_ok=True)
    nvcc.write_text(f"#!/bin/sh\necho called >> '{cuda_home / 'calls'}'\ncat <<'EOF'\n{output}EOF\n")
    nvcc.chmod(0o755)
    return nvcc


def nvcc_calls(cuda_home: Path) -> int:
    calls = cuda_home / "calls"
    return len(calls.read_text().splitlines()) if calls.exists() else 0


@dataclasses.dataclass
class Installation:
    """The stand-in official package, CuTe DSL and backward module of one test."""

    monkeypatch: pytest.MonkeyPatch
    cuda_home: Path
    package: types.ModuleType
    sparse: types.ModuleType
    jit: types.ModuleType
    utils: types.ModuleType
    backward: types.ModuleType
    versions: dict

    def install(self, module):
        self.monkeypatch.setitem(sys.modules, module.__name__, module)

    def remove(self, name):
        # None in sys.modules makes `import name` raise ModuleNotFoundError.
        self.monkeypatch.setitem(sys.modules, name, None)


@pytest.fixture
def official(tmp_path, monkeypatch):
    package_dir = tmp_path / "site-packages" / "fmha_sm100"
    cuda_home = tmp_path / "cuda"
    package = _module("fmha_sm100", package_dir / "__init__.py")
    package.__path__ = [str(package_dir)]
    sparse = _module("fmha_sm100.sparse", package_dir / "sparse.py", build_k2q_csr=lambda *a, **k: "csr",
                     sparse_atten_func=lambda *a, **k: "attention")
    jit = _module("fmha_sm100.jit", package_dir / "jit.py", _get_nvcc_flags=pinned_nvcc_flags,
                  _get_cuda_home=lambda: str(cuda_home))
    cute_src = package_dir / "cute" / "src"
    utils = _module("src.common.utils", cute_src / "common" / "utils.py", fmax=pinned_fmax,
                    dsl_user_op=fake_dsl_user_op, Float32=FakeFloat32, nvvm=FakeNVVM())
    backward = _module(bindings.BACKWARD_MODULE, REPO_ROOT / "torch_msa/sm100/backward_host.py",
                       run_backward=lambda *a: "backward")
    installation = Installation(monkeypatch, cuda_home, package, sparse, jit, utils, backward,
                                {bindings.CUTE_DSL_DISTRIBUTION: "4.8.1"})
    for module in (
        package, sparse, jit, utils, backward,
        _module("src", cute_src / "__init__.py"),
        _module("src.common", cute_src / "common" / "__init__.py"),
        _module("cutlass", tmp_path / "cutlass" / "__init__.py"),
        _module("cuda.bindings.driver", tmp_path / "cuda_bindings" / "driver.py"),
        _module("tvm_ffi", tmp_path / "tvm_ffi" / "__init__.py"),
    ):
        installation.install(module)

    real_version = importlib.metadata.version

    def version(distribution):
        if distribution not in installation.versions:
            return real_version(distribution)
        if installation.versions[distribution] is None:
            raise importlib.metadata.PackageNotFoundError(distribution)
        return installation.versions[distribution]

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(bindings, "_bundle", None)
    return installation


@pytest.fixture
def device_caches():
    """Empty the memoized device facts before and after a test that fakes them."""
    cute_dsl._capability_of.cache_clear()
    cute_dsl._sm_count_of.cache_clear()
    sm100._extras_installed.cache_clear()
    backends.forget_resolutions()
    yield
    cute_dsl._capability_of.cache_clear()
    cute_dsl._sm_count_of.cache_clear()
    sm100._extras_installed.cache_clear()
    backends.forget_resolutions()


# --- the bundle ------------------------------------------------------------------------------


def test_binds_one_frozen_bundle_per_process(official):
    bundle = bindings.kernels()
    assert bundle.build_k2q_csr is official.sparse.build_k2q_csr
    assert bundle.sparse_atten_func is official.sparse.sparse_atten_func
    assert bundle.run_backward is official.backward.run_backward
    assert [field.name for field in dataclasses.fields(bundle)] == ["build_k2q_csr", "sparse_atten_func", "run_backward"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        bundle.run_backward = None
    official.remove("fmha_sm100")  # a cached bundle never imports again
    assert bindings.kernels() is bundle


@pytest.mark.parametrize("missing",
                         ["fmha_sm100", "fmha_sm100.sparse", "fmha_sm100.jit", "cutlass", "cuda.bindings.driver",
                          "tvm_ffi"])
def test_missing_dependency_raises_unavailable_naming_the_install_command(official, missing):
    official.remove(missing)
    with pytest.raises(UnavailableError) as caught:
        bindings.kernels()
    # The CuTe DSL's own message names only the CuTe DSL; the official package's, both steps.
    assert (cute_dsl.INSTALL_COMMAND if missing in cute_dsl.CUTE_DSL_MODULES else INSTALL_COMMAND) in str(caught.value)
    assert missing in str(caught.value)
    assert bindings._bundle is None


@pytest.mark.parametrize("installed", ["4.6.2", "4.6.3", "4.7.1", "4.8.1"])
def test_served_cute_dsl_versions_bind(official, installed):
    official.versions[bindings.CUTE_DSL_DISTRIBUTION] = installed
    assert bindings.kernels().run_backward is official.backward.run_backward


@pytest.mark.parametrize("installed", [None, "4.5.0", "4.6.1", "4.9.0", "4.9.0rc1", "5.0.0", "nightly"])
def test_other_cute_dsl_versions_are_unavailable(official, installed):
    official.versions[bindings.CUTE_DSL_DISTRIBUTION] = installed
    with pytest.raises(UnavailableError, match=r"nvidia-cutlass-dsl>=4\.6\.2,<4\.9") as caught:
        bindings.kernels()
    assert INSTALL_COMMAND in str(caught.value)
    if installed is not None:
        assert f"found nvidia-cutlass-dsl {installed}" in str(caught.value)
    assert bindings._bundle is None and not bindings._is_patched(official.utils.fmax)


def test_an_official_package_without_an_entry_point_is_unavailable(official):
    del official.sparse.sparse_atten_func
    with pytest.raises(UnavailableError, match=r"fmha_sm100\.sparse has no sparse_atten_func\(\)") as caught:
        bindings.kernels()
    assert INSTALL_COMMAND in str(caught.value)


def test_backward_module_missing_from_the_install_is_not_an_extras_problem(official):
    official.remove(bindings.BACKWARD_MODULE)
    with pytest.raises(ImportError, match="missing from this torch_msa install") as caught:
        bindings.kernels()
    assert not isinstance(caught.value, UnavailableError)


def test_backward_dependency_missing_is_unavailable(official, monkeypatch):
    real_import = importlib.import_module

    def import_module(name, package=None):
        if name == bindings.BACKWARD_MODULE:
            raise ModuleNotFoundError("No module named 'quack'", name="quack")
        return real_import(name, package)

    monkeypatch.setattr(bindings.importlib, "import_module", import_module)
    with pytest.raises(UnavailableError, match="needs quack") as caught:
        bindings.kernels()
    assert INSTALL_COMMAND in str(caught.value)


def test_a_failed_bind_is_not_cached_and_a_later_call_retries(official):
    official.remove("fmha_sm100")
    with pytest.raises(UnavailableError):
        bindings.kernels()
    assert bindings._bundle is None
    official.install(official.package)
    bundle = bindings.kernels()
    assert bundle.build_k2q_csr is official.sparse.build_k2q_csr
    assert getattr(official.utils.fmax, "decorated_by_dsl_user_op", False)
    assert official.jit._get_nvcc_flags.__wrapped__ is pinned_nvcc_flags


def test_import_binds_nothing_heavy():
    code = (
        "import sys, torch\n"
        "before = set(sys.modules)\n"
        "import torch_msa.sm100, torch_msa.sm100.bindings, torch_msa.sm100.common, torch_msa.sm100.backward_host\n"
        "heavy = ('triton', 'cutlass', 'cuda', 'fmha_sm100', 'src', 'quack', 'tvm_ffi')\n"
        "added = sorted(m for m in set(sys.modules) - before if m.split('.')[0] in heavy)\n"
        "assert not added, added\n"
        "assert torch_msa.sm100.bindings._bundle is None\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


# --- ownership of the patched modules -------------------------------------------------------


def test_a_foreign_jit_module_is_refused(official, tmp_path):
    official.jit.__file__ = str(tmp_path / "elsewhere" / "fmha_sm100" / "jit.py")
    with pytest.raises(ImportError, match="refuses to touch 'fmha_sm100.jit'") as caught:
        bindings.kernels()
    assert not isinstance(caught.value, UnavailableError)
    assert official.jit._get_nvcc_flags is pinned_nvcc_flags
    assert bindings._bundle is None


@pytest.mark.parametrize("defect", ["name", "no_flags", "no_cuda_home"])
def test_patch_jit_gencode_refuses_modules_that_are_not_msas_jit(official, defect):
    jit = official.jit
    if defect == "name":
        jit.__name__ = "someone_else.jit"
    elif defect == "no_flags":
        del jit._get_nvcc_flags
    else:
        del jit._get_cuda_home
    with pytest.raises(ImportError) as caught:
        bindings._patch_jit_gencode(jit)
    assert not isinstance(caught.value, UnavailableError)
    assert getattr(jit, "_get_nvcc_flags", pinned_nvcc_flags) is pinned_nvcc_flags


def test_a_foreign_src_common_utils_is_refused(official, tmp_path):
    official.utils.__file__ = str(tmp_path / "my_project" / "src" / "common" / "utils.py")
    with pytest.raises(ImportError, match="refuses to touch src.common.utils") as caught:
        bindings.kernels()
    assert not isinstance(caught.value, UnavailableError)
    assert official.utils.fmax is pinned_fmax
    assert bindings._bundle is None


def test_patch_fmax_refuses_without_msas_utils_or_sparse_module(official):
    official.remove("src.common.utils")
    with pytest.raises(ImportError, match="cannot be imported") as caught:
        bindings._patch_fmax(official.sparse)
    assert not isinstance(caught.value, UnavailableError)
    official.install(official.utils)
    impostor = _module("not_msa.sparse", official.sparse.__file__)
    with pytest.raises(ImportError, match="needs MSA's own fmha_sm100.sparse"):
        bindings._patch_fmax(impostor)
    assert official.utils.fmax is pinned_fmax


def test_patches_apply_once(official, monkeypatch):
    bindings.kernels()
    fmax, flags = official.utils.fmax, official.jit._get_nvcc_flags
    assert fmax is not pinned_fmax and flags.__wrapped__ is pinned_nvcc_flags
    monkeypatch.setattr(bindings, "_bundle", None)
    bindings.kernels()
    bindings._patch_fmax(official.sparse)
    bindings._patch_jit_gencode(official.jit)
    assert official.utils.fmax is fmax
    assert official.jit._get_nvcc_flags is flags


# --- what the patches do ---------------------------------------------------------------------


def test_fmax_replacement_keeps_fp32_the_third_operand_and_loc_ip(official):
    bindings.kernels()
    fmax, nvvm = official.utils.fmax, official.utils.nvvm
    assert fmax.decorated_by_dsl_user_op
    two = fmax(1.0, 2.0)
    assert nvvm.calls[-1] == {"a": ("ir", 1.0, None, None), "b": ("ir", 2.0, None, None), "c": None, "loc": None,
                              "ip": None}
    assert isinstance(two, FakeFloat32) and two.value[0] == "max"
    fmax(1.0, 2.0, 3.0, loc="site", ip="point")
    assert nvvm.calls[-1] == {
        "a": ("ir", 1.0, "site", "point"),
        "b": ("ir", 2.0, "site", "point"),
        "c": ("ir", 3.0, "site", "point"),
        "loc": "site",
        "ip": "point",
    }


@pytest.mark.parametrize("release", sorted(NVCC_VERSION_OUTPUT))
def test_nvcc_release_is_read_from_real_version_output(release, tmp_path):
    assert bindings._parse_nvcc_release(NVCC_VERSION_OUTPUT[release]) == release
    write_nvcc(tmp_path, NVCC_VERSION_OUTPUT[release])
    assert bindings._nvcc_release(str(tmp_path)) == release


def test_unreadable_or_absent_nvcc_is_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match="cannot read the CUDA release"):
        bindings._parse_nvcc_release("nvcc: command-line driver, no release here")
    with pytest.raises(RuntimeError, match="cannot be run"):
        bindings._nvcc_release(str(tmp_path / "no_cuda"))


@pytest.mark.parametrize(("release", "keeps_sm103a"), [((12, 8), False), ((12, 9), True), ((13, 0), True)])
def test_sm103a_is_dropped_only_for_nvcc_older_than_12_9(official, release, keeps_sm103a):
    write_nvcc(official.cuda_home, NVCC_VERSION_OUTPUT[release])
    bindings.kernels()
    flags = official.jit._get_nvcc_flags("/cache/variant", fmha=False)
    expected = pinned_nvcc_flags("/cache/variant", fmha=False)
    if keeps_sm103a:
        assert flags == expected
    else:
        assert SM103A not in flags and SM100A in flags
        assert flags == expected.replace(f"{SM103A} ", "")


def test_nvcc_is_asked_only_when_msa_builds_and_once(official):
    bindings.kernels()
    assert nvcc_calls(official.cuda_home) == 0  # binding works with a warm JIT cache and no nvcc
    with pytest.raises(RuntimeError, match="cannot be run"):
        official.jit._get_nvcc_flags("/cache")
    write_nvcc(official.cuda_home, NVCC_VERSION_OUTPUT[(12, 8)])
    official.jit._get_nvcc_flags("/cache")
    official.jit._get_nvcc_flags("/cache", False)
    assert nvcc_calls(official.cuda_home) == 1


# --- the device gates ------------------------------------------------------------------------


@pytest.mark.parametrize("missing", ["cutlass", "cuda.bindings.driver", "tvm_ffi"])
def test_require_cute_dsl_raises_unavailable_before_any_dsl_import(official, missing):
    cute_dsl.require_cute_dsl()
    official.remove(missing)
    with pytest.raises(UnavailableError, match=missing.replace(".", r"\.")) as caught:
        cute_dsl.require_cute_dsl()
    assert cute_dsl.INSTALL_COMMAND in str(caught.value)
    assert "fmha" not in str(caught.value)  # the Hopper kernels need the CuTe DSL only


def test_require_sm100_accepts_only_capability_10_0(monkeypatch, device_caches):
    capabilities = {0: (10, 0), 1: (9, 0), 2: (10, 3), 3: (12, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capabilities[index])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    sm100_common.require_sm100(torch.device("cuda", 0))
    sm100_common.require_sm100("cuda")
    for index, (major, minor) in list(capabilities.items())[1:]:
        with pytest.raises(NotImplementedError, match=f"cuda:{index} has compute capability {major}.{minor}"):
            sm100_common.require_sm100(torch.device("cuda", index))
    with pytest.raises(NotImplementedError, match="got a cpu device"):
        sm100_common.require_sm100(torch.device("cpu"))


def test_capability_and_sm_count_are_memoized_per_device(monkeypatch, device_caches):
    asked = []

    def capability(index):
        asked.append(("capability", index))
        return (10, 0) if index == 0 else (9, 0)

    def properties(index):
        asked.append(("properties", index))
        return types.SimpleNamespace(multi_processor_count=148 if index == 0 else 132)

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    for _ in range(3):
        assert cute_dsl.sm_capability(torch.device("cuda", 0)) == (10, 0)
        assert cute_dsl.sm_capability("cuda") == (9, 0)  # the current device, index 1
        assert cute_dsl.sm_count(torch.device("cuda", 0)) == 148
        assert cute_dsl.sm_count(1) == 132
    assert sorted(asked) == [("capability", 0), ("capability", 1), ("properties", 0), ("properties", 1)]
    with pytest.raises(ValueError, match="expected a CUDA device, got cpu"):
        cute_dsl.sm_capability(torch.device("cpu"))


@pytest.mark.cuda
def test_the_gates_on_the_real_device(device_caches):
    device = torch.device("cuda", torch.cuda.current_device())
    capability = torch.cuda.get_device_capability(device)
    assert cute_dsl.sm_capability(device) == capability
    assert cute_dsl.sm_count(device) == torch.cuda.get_device_properties(device).multi_processor_count
    if capability != sm100_common.SM100_CAPABILITY:
        assert not sm100.available(device)
        with pytest.raises(NotImplementedError, match=f"has compute capability {capability[0]}.{capability[1]}"):
            sm100_common.require_sm100(device)


# --- the backend -----------------------------------------------------------------------------


def test_available_needs_capability_10_0_and_the_extras(monkeypatch, device_caches):
    assert not sm100.available(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    capabilities = {0: (10, 0), 1: (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capabilities[index])
    looked_up = []
    present = set(sm100._REQUIRED_MODULES)

    def find_spec(name, package=None):
        looked_up.append(name)
        return object() if name in present else None

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert not sm100.available(torch.device("cuda", 1))
    assert looked_up == []  # the wrong device is refused before any lookup
    assert sm100.available(torch.device("cuda", 0))
    assert set(looked_up) == set(sm100._REQUIRED_MODULES)
    for missing in sm100._REQUIRED_MODULES:
        sm100._extras_installed.cache_clear()
        present = set(sm100._REQUIRED_MODULES) - {missing}
        assert not sm100.available(torch.device("cuda", 0)), missing


def test_the_registry_never_picks_sm100_on_cpu(monkeypatch):
    backends.registered_backends()  # registers the builtins first, so the undo below restores sm100, not deletes it
    monkeypatch.setitem(backends._BACKENDS, sm100.NAME, sm100.BACKEND)
    assert torch_msa.resolve("forward", torch.device("cpu")).name != sm100.NAME
    monkeypatch.setenv(torch_msa.BACKEND_ENV, sm100.NAME)
    with pytest.raises(torch_msa.BackendError, match="'sm100' cannot serve msa::forward on cpu"):
        torch_msa.resolve("forward", torch.device("cpu"))


def test_the_registry_holds_the_backend_at_priority_20():
    assert "torch_msa.sm100" in backends.BUILTIN_BACKENDS and sm100.NAME in backends.registered_backends()
    backend = backends._BACKENDS[sm100.NAME]
    assert backend is sm100.BACKEND
    assert backend.priority == 20 and backend.device_types == ("cuda",)
    # The backward with the index loss is composed (torch_msa.index_loss) from its backward.
    assert set(backend.ops) == {"forward", "backward"} and backend.implements("backward_with_index_loss")


def _m3_inputs(lengths, dtype=torch.bfloat16):
    cu_seqlens_q, cu_seqlens_k = testing.cu_seqlens(lengths)
    tokens = sum(lengths)
    q = torch.randn(tokens, sm100.NUM_Q_HEADS, sm100.HEAD_DIM, dtype=dtype)
    k = torch.randn(tokens, sm100.NUM_KV_HEADS, sm100.HEAD_DIM, dtype=dtype)
    v = torch.randn_like(k)
    block_indices = testing.random_block_indices(cu_seqlens_q, cu_seqlens_k, sm100.NUM_KV_HEADS, sm100.TOPK,
                                                 sm100.BLOCK_SIZE)
    return q, k, v, block_indices, cu_seqlens_q, cu_seqlens_k


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if the backend binds (or so launches) anything."""

    def refuse():
        raise AssertionError("the backend bound its kernels for inputs it must refuse")

    monkeypatch.setattr(bindings, "kernels", refuse)


@pytest.mark.parametrize(
    ("change", "got"),
    [
        ({"num_q_heads": 8}, "Hq=8"),
        ({"num_kv_heads": 2}, "Hkv=2"),
        ({"head_dim": 64}, "D=64"),
        ({"block_size": 64}, "block_size=64"),
        ({"topk": 8}, "topk=8"),
        ({"dtype": torch.float16}, "torch.float16"),
    ],
)
def test_inputs_outside_the_official_configuration_are_declined_before_any_work(no_launch, change, got):
    shape = {"num_q_heads": 64, "num_kv_heads": 4, "head_dim": 128, "block_size": 128, "topk": 16,
             "dtype": torch.bfloat16}
    shape.update(change)
    tokens = 3
    q = torch.zeros(tokens, shape["num_q_heads"], shape["head_dim"], dtype=shape["dtype"])
    k = torch.zeros(tokens, shape["num_kv_heads"], shape["head_dim"], dtype=shape["dtype"])
    block_indices = torch.zeros(shape["num_kv_heads"], tokens, shape["topk"], dtype=torch.int32)
    cu_seqlens = torch.tensor([0, tokens], dtype=torch.int32)
    documents = (cu_seqlens, cu_seqlens, tokens, tokens, shape["block_size"], 0.1)
    with pytest.raises(UnsupportedInputs, match="serves only the official MSA configuration") as caught:
        sm100.forward(*backend_arguments("forward", q, k, k, block_indices, *documents))
    assert got in str(caught.value)
    lse = torch.zeros(tokens, shape["num_q_heads"])
    with pytest.raises(UnsupportedInputs, match=got):
        sm100.backward(*backend_arguments("backward", q, q, k, k, q, lse, block_indices, *documents))


def test_deterministic_backward_is_declined_because_of_atomics(no_launch, monkeypatch):
    q, k, v, block_indices, cu_q, cu_k = _m3_inputs([5])
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    lse = torch.zeros(q.shape[:2])
    with pytest.raises(UnsupportedInputs, match="fp32 atomics"):
        sm100.backward(q, q, k, v, q, lse, block_indices, Documents(cu_q, cu_k, 5, 5), 128, 0.1)


def test_forward_is_declined_during_graph_capture(no_launch, monkeypatch):
    q, k, v, block_indices, cu_q, cu_k = _m3_inputs([5])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(UnsupportedInputs, match="CUDA-graph capture"):
        sm100.forward(q, k, v, block_indices, Documents(cu_q, cu_k, 5, 5), 128, 0.1)


def test_forward_sends_only_self_attention_packs(official, monkeypatch):
    calls = []
    monkeypatch.setattr(official.sparse, "build_k2q_csr", lambda *a, **k: calls.append("csr"))
    q, k, v, _, _, _ = _m3_inputs([100, 100])
    cu_q, cu_k = testing.cu_seqlens([100, 100], [50, 150])
    block_indices = testing.random_block_indices(cu_q, cu_k, 4, 16, 128)
    with pytest.raises(UnsupportedInputs, match="self-attention packs"):
        sm100.forward(q, k, v, block_indices, Documents(cu_q, cu_k, 100, 150), 128, 0.1)
    with pytest.raises(UnsupportedInputs, match="Tq=200, Tk=150"):
        sm100.forward(q, k[:150], v[:150], block_indices,
                      Documents(*testing.cu_seqlens([100, 100], [50, 100]), 100, 100), 128, 0.1)
    assert calls == []


def test_unsupported_inputs_fall_back_to_the_reference_with_a_warning(monkeypatch):
    # Not opt-in, so that default resolution tries it.
    cpu_twin = dataclasses.replace(sm100.BACKEND, device_types=("cpu",), available=lambda device: True,
                                   opt_in_note=None)
    monkeypatch.setitem(backends._BACKENDS, sm100.NAME, cpu_twin)
    monkeypatch.setattr(backends, "_warned", set())
    q, k, v = torch.randn(70, 4, 64), torch.randn(70, 2, 64), torch.randn(70, 2, 64)
    block_indices = torch.zeros(2, 70, 2, dtype=torch.int32)
    with pytest.warns(UserWarning,
                      match="backend 'sm100' does not serve these msa::forward inputs .*falling back to 'reference'"):
        out = torch_msa.sparse_attention(q, k, v, block_indices, block_size=64)
    expected, _ = reference.forward(*backend_arguments("forward", q, k, v, block_indices, *testing.cu_seqlens([70]), 70, 70,
                                                       64, 64**-0.5))
    torch.testing.assert_close(out, expected)


def _python_canonical(block_indices, positions, block_size):
    rows = []
    for head in block_indices.tolist():
        head_rows = []
        for ids, position in zip(head, positions):
            visible = position // block_size + 1 if position >= 0 else 0
            kept = sorted({i for i in ids if 0 <= i < visible})
            head_rows.append(kept + [-1] * (len(ids) - len(kept)))
        rows.append(head_rows)
    return torch.tensor(rows, dtype=torch.int32)


def test_canonical_block_indices_keep_exactly_the_set_the_reference_reads():
    lengths = [40, 0, 1, 150]
    cu_q, cu_k = testing.cu_seqlens(lengths)
    tokens, block_size, topk = sum(lengths), 64, 5
    raw = torch.randint(-2, 5, (2, tokens, topk), dtype=torch.int32)  # negatives, repeats, beyond the horizon
    canonical = sm100.canonical_block_indices(raw, cu_q, cu_k, tokens, block_size)
    positions = [t - start for start, end in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()) for t in range(start, end)]
    assert torch.equal(canonical, _python_canonical(raw, positions, block_size))
    q = torch.randn(tokens, 4, 64, dtype=torch.float64)
    k, v = torch.randn(2, tokens, 2, 64, dtype=torch.float64)
    documents = (cu_q, cu_k, max(lengths), max(lengths), block_size, 0.125)
    from_raw = reference.forward(*backend_arguments("forward", q, k, v, raw, *documents))
    from_canonical = reference.forward(*backend_arguments("forward", q, k, v, canonical, *documents))
    for raw_result, canonical_result in zip(from_raw, from_canonical):
        torch.testing.assert_close(raw_result, canonical_result)


@pytest.fixture
def cpu_device_guard(monkeypatch):
    # The backend binds launches to the tensors' CUDA device; stand-in launchers run on CPU tensors.
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())


def test_forward_calls_the_official_pair_and_returns_its_lse(official, monkeypatch, cpu_device_guard):
    lengths = [130, 5, 0, 256]
    q, k, v, block_indices, cu_q, cu_k = _m3_inputs(lengths)
    block_indices[0, :, 0] = block_indices[0, :, -1]  # a repeated id and -1 in the middle of rows
    block_indices[1, :, 1] = 99  # beyond every horizon
    calls = {}

    def build_k2q_csr(*args, **kwargs):
        calls["csr"] = (args, kwargs)
        return "row_ptr", "q_indices", "schedule"

    official_out, official_lse = torch.randn_like(q), torch.randn(q.shape[:2])

    def sparse_atten_func(*args, **kwargs):
        calls["attention"] = (args, kwargs)
        return official_out, official_lse

    monkeypatch.setattr(official.sparse, "build_k2q_csr", build_k2q_csr)
    monkeypatch.setattr(official.sparse, "sparse_atten_func", sparse_atten_func)
    out, lse = sm100.forward(q, k, v, block_indices, Documents(cu_q, cu_k, 256, 256), 128, 0.088)
    assert out is official_out and lse is official_lse

    (support, csr_cu_q, csr_cu_k, block), csr_kwargs = calls["csr"]
    positions = [t for n in lengths for t in range(n)]
    assert torch.equal(support, _python_canonical(block_indices, positions, 128))
    assert torch.equal(csr_cu_q, cu_q) and torch.equal(csr_cu_k, cu_k) and block == 128
    assert csr_kwargs == {"total_k": 391, "max_seqlen_q": 256, "max_seqlen_k": 256, "total_rows": 2 + 1 + 0 + 2,
                          "qhead_per_kv": 16, "return_schedule": True}
    attention_args, attention_kwargs = calls["attention"]
    assert attention_args[3:] == ("row_ptr", "q_indices", 16)
    assert all(torch.equal(a, b) for a, b in zip(attention_args[:3], (q, k, v)))
    keys = ("blk_kv", "causal", "softmax_scale", "return_softmax_lse", "schedule")
    assert {key: attention_kwargs[key] for key in keys} == {
        "blk_kv": 128, "causal": True, "softmax_scale": 0.088, "return_softmax_lse": True, "schedule": "schedule"}
    assert attention_kwargs["max_seqlen_q"] == attention_kwargs["max_seqlen_k"] == 256


def test_backward_calls_run_backward_with_the_documented_signature(official, monkeypatch, cpu_device_guard):
    lengths = [130, 7]
    q, k, v, block_indices, cu_q, cu_k = _m3_inputs(lengths)
    grad_out, lse, grad_lse = torch.randn_like(q), torch.randn(q.shape[:2]), torch.randn(q.shape[:2])
    received = []
    gradients = (torch.randn_like(q), torch.randn_like(k), torch.randn_like(v))

    def run_backward(*args):
        received.append(args)
        return gradients

    monkeypatch.setattr(official.backward, "run_backward", run_backward)
    got = sm100.backward(grad_out, q, k, v, q, lse, block_indices, Documents(cu_q, cu_k, 130, 130), 128, 0.088, grad_lse)
    assert got is gradients
    (args,) = received
    assert len(args) == 13
    for given, expected in zip(args[:6], (q, k, v, grad_out, q, lse)):
        assert torch.equal(given, expected)
    assert torch.equal(args[6], _python_canonical(block_indices, [t for n in lengths for t in range(n)], 128))
    assert torch.equal(args[7], cu_q) and torch.equal(args[8], cu_k)
    assert args[9:12] == (130, 130, 0.088) and torch.equal(args[12], grad_lse)
    sm100.backward(grad_out, q, k, v, q, lse, block_indices, Documents(cu_q, cu_k, 130, 130), 128, 0.088)
    assert received[-1][12] is None


def test_empty_packs_return_without_launching(no_launch):
    q, k, v, block_indices, cu_q, cu_k = _m3_inputs([0])
    out, lse = sm100.forward(q, k, v, block_indices, Documents(cu_q, cu_k, 0, 0), 128, 0.1)
    assert out.shape == (0, 64, 128) and out.dtype == torch.bfloat16
    assert lse.shape == (0, 64) and lse.dtype == torch.float32
    dq, dk, dv = sm100.backward(q, q, k, v, q, lse, block_indices, Documents(cu_q, cu_k, 0, 0), 128, 0.1)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


# --- the numerical patch against the real CuTe DSL -------------------------------------------


def _served_cute_dsl_installed() -> bool:
    try:
        return (importlib.util.find_spec("cutlass") is not None
                and cute_dsl.cute_dsl_version_served(importlib.metadata.version(cute_dsl.CUTE_DSL_DISTRIBUTION)))
    except (ImportError, ValueError):
        return False


@pytest.mark.skipif(not _served_cute_dsl_installed(),
                    reason=f"needs {cute_dsl.CUTE_DSL_REQUIREMENT}; install it with: {cute_dsl.INSTALL_COMMAND}")
def test_fmax_patch_compiles_for_sm_100a_with_the_real_dsl(tmp_path):
    """A stand-in MSA tree whose helper has the pinned explicit-result form: the installed CuTe DSL
    rejects it, the patched one lowers."""
    package = tmp_path / "site" / "fmha_sm100"
    (package / "cute" / "src" / "common").mkdir(parents=True)
    for folder in (package, package / "cute" / "src", package / "cute" / "src" / "common"):
        (folder / "__init__.py").write_text("")
    (package / "sparse.py").write_text(
        "import os, sys\nsys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), 'cute'))\n"
    )
    (package / "cute" / "src" / "common" / "utils.py").write_text(textwrap.dedent("""\
        from cutlass import Float32
        from cutlass.cutlass_dsl import T, dsl_user_op
        from cutlass._mlir.dialects import nvvm

        @dsl_user_op
        def fmax(a, b, c=None, *, loc=None, ip=None):
            third = Float32(c).ir_value(loc=loc, ip=ip) if c is not None else None
            return Float32(nvvm.fmax(T.f32(), Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip),
                                     c=third, loc=loc, ip=ip))
        """))
    script = textwrap.dedent("""\
        import fmha_sm100.sparse as sparse
        import src.common.utils as utils
        import cutlass.cute as cute
        from cutlass import Float32
        from cutlass.cute.runtime import make_fake_compact_tensor
        from torch_msa.sm100 import bindings

        @cute.kernel
        def kernel(x: cute.Tensor):
            x[0] = utils.fmax(x[1], x[2])
            x[3] = utils.fmax(x[4], x[5], x[6])

        @cute.jit
        def launch(x: cute.Tensor):
            kernel(x).launch(grid=[1, 1, 1], block=[32, 1, 1])

        row = make_fake_compact_tensor(Float32, (8,), stride_order=(0,), assumed_align=16)
        try:
            cute.compile(launch, row)
            print("pinned helper compiled")
        except TypeError:
            print("pinned helper rejected")
        bindings._patch_fmax(sparse)
        ptx = cute.compile(launch, row).__ptx__
        print("max.f32 with 2 operands:", sum(line.count(",") == 2 for line in ptx.splitlines() if "max.f32" in line))
        print("max.f32 with 3 operands:", sum(line.count(",") == 3 for line in ptx.splitlines() if "max.f32" in line))
        """)
    env = dict(os.environ, CUTE_DSL_ARCH="sm_100a", CUTE_DSL_KEEP_PTX="1",
               PYTHONPATH=os.pathsep.join([str(package.parent), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    # A file, not `-c`: the DSL reads the kernels' source.
    (tmp_path / "compile_fmax.py").write_text(script)
    result = subprocess.run([sys.executable, "compile_fmax.py"], capture_output=True, text=True, timeout=300,
                            cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.splitlines() == ["pinned helper rejected", "max.f32 with 2 operands: 1",
                                          "max.f32 with 3 operands: 1"]
