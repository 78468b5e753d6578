"""The `torch.library.opcheck` sample matrix of the msa ops; `python -m opcheck` runs it."""
