"""Integrations of torch_msa with model libraries; each submodule needs its library installed.

* `torch_msa.integrations.transformers`: HF transformers' MiniMax-M3 (`pip install ".[hf]"` in a
  checkout, or `pip install "transformers>=5.17,<6"`). It registers `attn_implementation="torch_msa"`
  with HF when it is imported, and `import torch_msa` imports it as soon as HF's MiniMax-M3 modeling
  code is (`register_with_transformers`), whatever the import order.
"""

import importlib.abc
import importlib.machinery
import sys
import types

HF_MODELING_MODULE = "transformers.models.minimax_m3_vl.modeling_minimax_m3_vl"
"""HF's MiniMax-M3 modeling code: importing it, which every way of building the model does, registers
`"torch_msa"` with HF."""


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
    """Finds HF's MiniMax-M3 modeling module through the other finders and wraps its loader; leaves
    every other import alone."""

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

    When HF's MiniMax-M3 modeling code (`HF_MODELING_MODULE`) is already imported, this imports
    `torch_msa.integrations.transformers` (which registers the name) now. Otherwise it puts an
    import hook on `sys.meta_path` that does so right after that module is first imported: HF
    checks `attn_implementation` when it builds a model, and any way of building a MiniMax-M3
    model (`from transformers import MiniMaxM3VLForCausalLM`, `AutoModelForCausalLM.from_pretrained`,
    ...) imports its modeling code first. Nothing here imports transformers: importing HF's
    modeling code takes seconds and pulls in triton. A transformers without MiniMax-M3, or without
    what the integration needs, is left alone.

    Returns:
        Whether the name is registered now (False while the hook waits for HF's modeling code).
    """
    if HF_MODELING_MODULE in sys.modules:
        return _register()
    if not any(isinstance(finder, _RegisterOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())
    return False
