"""Integrations of torch_msa with model libraries; each submodule needs its library installed.

* `torch_msa.integrations.transformers`: HF transformers' MiniMax-M3 (`pip install ".[hf]"` in a
  checkout, or `pip install "transformers>=5.17,<6"`).
"""
