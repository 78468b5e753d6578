"""Which keys a query sees in the SM90 kernels: block-local key `c <= position - first_key`. Hidden
scores are selected away, never multiplied by a mask, so a hidden key's NaN cannot leak.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .common import BLOCK_SIZE, HEAD_DIM


def key_hidden(key: Int32, last_key: Int32):
    """Whether block-local key `key` is hidden from a query whose last visible key is `last_key`."""
    return key > last_key


@cute.jit
def hide_scores_past(scores_rc: cute.Tensor, coords_rc: cute.Tensor, row: cutlass.Constexpr[int], last_key: Int32):
    """Set row `row`'s hidden scores to `-inf` (`coords_rc`: each element's (row, key))."""
    for c in cutlass.range_constexpr(cute.size(scores_rc, mode=[1])):
        if key_hidden(coords_rc[row, c][1], last_key):
            scores_rc[row, c] = -Float32.inf


@cute.jit
def zero_keys_past(tile: cute.Tensor, key_count: Int32, thread: Int32):
    """Zero keys `key_count ..` of a (key, dim) tile, since `0 * NaN = NaN` (thread `t` < 128 takes
    key `t`), and fence for the tensor cores; the caller's barrier then orders the stores."""
    if thread < BLOCK_SIZE and thread >= key_count:
        # Rolled: unrolled, its 128 swizzled addresses would be hoisted out of the kernel's loops
        # into registers for stores that rarely run.
        for d in cutlass.range(HEAD_DIM, unroll=1):
            tile[thread, d] = tile.element_type(0.0)
    cute.arch.fence_proxy("async.shared", space="cta")
