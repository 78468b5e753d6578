"""Integrations of torch_msa with model libraries; each submodule needs its library installed.

* `torch_msa.integrations.transformers`: HF transformers' MiniMax-M3 (`pip install ".[hf]"` in a
  checkout, or `pip install "transformers>=5.17,<6"`). Importing it registers
  `attn_implementation="torch_msa"` with HF.
"""

import sys


def register_with_loaded_transformers() -> bool:
    """Import `torch_msa.integrations.transformers` (which registers `"torch_msa"` with HF) when HF's
    modeling code, `transformers.modeling_utils`, is already imported; returns whether it did.

    `import torch_msa` calls this. It never imports transformers itself: importing HF's modeling
    code takes seconds and pulls in triton, and HF looks up `attn_implementation` in its own
    registry with no hook to find torch_msa later, so with any other import order the
    registering import is the caller's. A transformers without MiniMax-M3 is left alone.
    """
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    if getattr(modeling_utils, "ALL_ATTENTION_FUNCTIONS", None) is None:  # not imported, or still importing
        return False
    try:
        from . import transformers  # noqa: F401  (registers on import)
    except ImportError:
        return False
    return True
