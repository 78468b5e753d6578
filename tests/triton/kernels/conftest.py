"""Under the Triton interpreter (`tests/triton/test_interpret.py` runs these files with
`TRITON_INTERPRET=1`): a numpy path for `xor_sum`, the reduction inside every `tl.sort`.

The interpreter reduces with numpy only for max, min, argmax, argmin and sum; any other combine
function runs element by element in Python, and `tl.sort` takes an `xor_sum` in each
compare-and-swap stage. The selection kernel's sorts were thereby most of its CPU time (over 80%
of `test_selection_kernel.py`). An xor over integers gives the same bits in any order, so
`np.bitwise_xor.reduce` returns exactly what the element loop returns
(`test_selection_kernel.py` checks the two agree); nothing else of the interpreter changes.
"""

import os

if os.environ.get("TRITON_INTERPRET") == "1":
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    # The interpreter's own reduction, kept for the test that compares the two.
    element_loop_apply_impl = _apply_impl = interpreter.ReduceOps.apply_impl

    def _apply_impl_with_xor(self, input):
        if self.combine_fn is tl.standard._xor_combine and len(input) == 1:
            (tensor,) = input
            data = np.bitwise_xor.reduce(tensor.handle.data, axis=self.axis, keepdims=self.keep_dims)
            return self.to_tensor(data, tensor.dtype)
        return _apply_impl(self, input)

    interpreter.ReduceOps.apply_impl = _apply_impl_with_xor
