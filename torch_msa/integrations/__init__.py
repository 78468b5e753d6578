"""Integrations of torch_msa with model libraries; each submodule needs its library installed.

* `torch_msa.integrations.transformers`: HF transformers' MiniMax-M3 (`pip install "torch_msa[hf]"`).
"""
