"""The Triton kernels at small shapes against the reference: compiled on a CUDA host, under the Triton
interpreter on CPU (in the subprocess of `tests/triton/test_interpret.py`)."""
