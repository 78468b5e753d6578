"""Every test here runs with junk in the buffers its kernels are promised to write in full
(`junk_in_uninitialized_buffers`, `tests/conftest.py`).

Under the Triton interpreter (`tests/triton/test_interpret.py` runs these files with
`TRITON_INTERPRET=1`), two shortcuts through its slowest steps, neither changing what a kernel
computes:

- `xor_sum`, the reduction inside every `tl.sort`, reduces with numpy. The interpreter reduces with
  numpy only for max, min, argmax, argmin and sum; any other combine function runs element by
  element in Python, and `tl.sort` takes an `xor_sum` in each compare-and-swap stage: the selection
  kernel's sorts were most of `test_selection_kernel.py`'s CPU time. An xor over integers gives the
  same bits in any order, so `np.bitwise_xor.reduce` returns exactly what the element loop returns
  (`test_selection_kernel.py` checks the two agree).
- A `@triton.jit` helper called inside a launch patches `triton.language` again only if the launch
  has not patched the modules it sees already. The interpreter re-patches them at every helper call
  (a walk over every member of `triton.language`), though the launch's patch is in place and
  stays until it ends: a sixth to a third of the KL and attention kernels' CPU time.
"""

import os

import pytest


@pytest.fixture(autouse=True)
def _junk(junk_in_uninitialized_buffers):
    pass


def _interpreter_has_the_internals_patched_here() -> bool:
    """The private interpreter members both shortcuts replace (those of the triton releases CI runs);
    a release without them runs the interpreter as it is, only slower."""
    from triton.runtime import interpreter

    reduce_ops = getattr(interpreter, "ReduceOps", None)
    return all((reduce_ops is not None and hasattr(reduce_ops, "apply_impl"),
                hasattr(interpreter, "_patch_lang"), hasattr(interpreter, "_LangPatchScope"),
                hasattr(interpreter, "GridExecutor")))


if os.environ.get("TRITON_INTERPRET") == "1" and _interpreter_has_the_internals_patched_here():
    import inspect

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

    _patch_lang = interpreter._patch_lang
    _launch = interpreter.GridExecutor.__call__
    _patched_in_this_launch: set[int] | None = None  # ids of the language modules; None outside a launch

    def _launch_tracking_its_patches(self, *args, **kwargs):
        global _patched_in_this_launch
        _patched_in_this_launch = set()
        try:
            return _launch(self, *args, **kwargs)
        finally:
            _patched_in_this_launch = None

    _langs_of: dict = {}  # function -> ids of the language modules its globals hold

    def _patch_lang_once_per_launch(fn):
        langs = _langs_of.get(fn)
        if langs is None:
            langs = _langs_of[fn] = frozenset(id(value) for value in fn.__globals__.values()
                                              if inspect.ismodule(value) and value in (tl, tl.core))
        if _patched_in_this_launch is not None and langs and langs <= _patched_in_this_launch:
            return interpreter._LangPatchScope()  # already patched until the launch restores them
        scope = _patch_lang(fn)
        if _patched_in_this_launch is not None:
            _patched_in_this_launch.update(langs)
        return scope

    interpreter.GridExecutor.__call__ = _launch_tracking_its_patches
    interpreter._patch_lang = _patch_lang_once_per_launch
