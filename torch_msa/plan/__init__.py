"""The plan: the KV-outer schedule of one layer's selection, built once per call or step and read
by every kernel of the step.

`schedule.py` holds its tables, their sizes and packing, and the reference build; `kernels.py` the
Triton build (`msa::plan` on CUDA) and the per-bucket key counts the SM90 kernels read beside it.
"""
