"""The served range of CuTe DSL releases (`torch_msa.cute_dsl.CUTE_DSL_REQUIREMENT`): the extras that
install it, the version test the SM100 gate applies, the release this run imports, the names that
moved inside the range (`torch_msa/cute_dsl/compat.py`) and the nvdisasm that only some releases
install.

CI runs the CuTe tests twice: with the newest release the range allows (the `test` extra) and with
the oldest (`.ci/run` puts it first on the module path); the checks below hold for both."""

import importlib.metadata
import re
from pathlib import Path

import pytest

from tests.support.cute_dsl import SASS_INSTALL_HINT, requires_cute, skip_without_nvdisasm
from torch_msa import cute_dsl

ROOT = Path(__file__).resolve().parents[2]
LINUX_X86_64 = "sys_platform == 'linux' and platform_machine == 'x86_64'"


def _extras() -> dict:
    tomllib = pytest.importorskip("tomllib",
                                  reason="reading pyproject.toml needs tomllib: run the tests with Python 3.11 or later")
    with open(ROOT / "pyproject.toml", "rb") as file:
        return tomllib.load(file)["project"]["optional-dependencies"]


def test_the_requirement_spans_the_oldest_to_the_first_unserved_release():
    assert cute_dsl.CUTE_DSL_REQUIREMENT == "nvidia-cutlass-dsl>=4.6.2,<4.9"
    assert cute_dsl.CUTE_DSL_REQUIREMENT in cute_dsl.INSTALL_COMMAND


def test_the_extras_install_the_served_range():
    extras = _extras()
    assert cute_dsl.CUTE_DSL_REQUIREMENT in extras["cute"]
    assert f"{cute_dsl.CUTE_DSL_REQUIREMENT} ; {LINUX_X86_64}" in extras["test"]
    # nvdisasm for the compile tests' SASS listings (an optional extra of the DSL from 4.8 on).
    assert f"nvidia-cutlass-dsl-libs-base[sass] ; {LINUX_X86_64}" in extras["test"]
    pinned = [r for extra in extras.values() for r in extra if r.startswith(cute_dsl.CUTE_DSL_DISTRIBUTION + "=")]
    assert not pinned, f"an extra pins one CuTe DSL release instead of the range: {pinned}"


@pytest.mark.parametrize(
    "version, served",
    [("4.6.1", False), ("4.6.2", True), ("4.6.2.post1", True), ("4.6.3", True), ("4.7.1", True), ("4.8.1", True),
     ("4.9.0rc1", False), ("4.9.0", False), ("4.10.0", False), ("5.0", False), ("3.9.9", False)],
)
def test_version_test_of_the_range(version, served):
    assert cute_dsl.cute_dsl_version_served(version) is served


@pytest.mark.parametrize("version", ["", "nightly", "v4.8.1"])
def test_version_test_refuses_what_is_not_a_release(version):
    with pytest.raises(ValueError, match="version: expected a release such as '4.8.1'"):
        cute_dsl.cute_dsl_version_served(version)


@requires_cute
def test_this_run_imports_an_installed_served_release():
    """The `cutlass` this interpreter imports is the release the package metadata reports, and it is
    served: a module path that mixed two installs would fail here, not somewhere in a kernel."""
    import cutlass

    installed = importlib.metadata.version(cute_dsl.CUTE_DSL_DISTRIBUTION)
    assert cutlass.__version__ == installed
    assert cute_dsl.cute_dsl_version_served(installed), f"{installed} is outside {cute_dsl.CUTE_DSL_REQUIREMENT}"


@requires_cute
def test_moved_names_come_from_their_newest_home():
    """From 4.8 the names' old homes in `cutlass.utils` only warn and forward; before 4.8 they are the
    only homes."""
    import cutlass.utils

    from torch_msa.cute_dsl import compat, importable

    if importable("cutlass.memory"):
        import cutlass.memory
        import cutlass.tensor_utils

        assert compat.SmemAllocator is cutlass.memory.SmemAllocator
        assert compat.LayoutEnum is cutlass.tensor_utils.LayoutEnum
    else:
        assert compat.SmemAllocator is cutlass.utils.SmemAllocator
        assert compat.LayoutEnum is cutlass.utils.LayoutEnum


@requires_cute
def test_compile_tests_without_nvdisasm_skip_naming_what_installs_it(monkeypatch):
    from cutlass.base_dsl import env_manager
    from cutlass.base_dsl.common import DSLUserCodeError

    def not_found():
        raise DSLUserCodeError("SASS dumping requires the nvdisasm tool, but it was not found.")

    monkeypatch.setattr(env_manager, "_find_nvdisasm_binary", not_found)
    with pytest.raises(pytest.skip.Exception, match=re.escape(SASS_INSTALL_HINT)):
        skip_without_nvdisasm()
