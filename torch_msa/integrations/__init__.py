"""Integrations of torch_msa with model libraries; each submodule needs its library installed.

`torch_msa.integrations.transformers` (HF MiniMax-M3, `pip install ".[hf]"`) registers
`attn_implementation="torch_msa"` on import; `import torch_msa` imports it once HF's MiniMax-M3
modeling code is imported, in either order.
"""

import importlib.abc
import importlib.machinery
import sys
import types

# Every way of building a MiniMax-M3 model imports this module first.
HF_MODELING_MODULE = "transformers.models.minimax_m3_vl.modeling_minimax_m3_vl"


def _register() -> bool:
    try:
        from . import transformers  # noqa: F401  (registers on import)
    except ImportError:  # a transformers without what the integration needs is left alone
        return False
    return True


class _RegisteringLoader(importlib.abc.Loader):
    """HF's own loader of its MiniMax-M3 modeling code, registering `"torch_msa"` once it has run."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.loader.exec_module(module)
        _register()

    def __getattr__(self, name: str):  # get_source, get_filename, ...: the wrapped loader's
        return getattr(self.loader, name)


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Wraps the loader of HF's MiniMax-M3 modeling module; leaves every other import alone."""

    def find_spec(self, fullname, path, target=None):
        if fullname != HF_MODELING_MODULE:
            return None
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            if finder is self or isinstance(finder, _RegisterOnImport) or find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RegisteringLoader(spec.loader)
                return spec
        return None


def register_with_transformers() -> bool:
    """Register `"torch_msa"` with HF whatever the import order; `import torch_msa` calls this.

    Imports `torch_msa.integrations.transformers` now if `HF_MODELING_MODULE` is imported, else
    puts a `sys.meta_path` hook that does so right after it is. Nothing here imports transformers,
    which takes seconds.

    Returns:
        Whether the name is registered now (False while the hook waits for HF's modeling code).
    """
    if HF_MODELING_MODULE in sys.modules:
        return _register()
    if not any(isinstance(finder, _RegisterOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())
    return False
