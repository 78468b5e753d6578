"""Which keys a query sees, for the SM90 forward and backward kernels.

A query at document position `p` sees the keys at positions `<= p` of its own document. Inside an
item's block (block-local key `c`, the block's key 0 at position `first_key`) that is
`c <= last_key` with `last_key = p - first_key` (`tile_scheduler.ItemScheduler.last_visible_key`):
a key of another document, or past the packed keys, always lies past the position, since
positions are document-local and the block starts inside the query's document. Hidden scores are
selected away (to `-inf`, or a zero probability), never multiplied by a mask, so that a hidden
key's NaN cannot reach a visible one's result.

`zero_keys_past` covers the other half of document isolation: `P = 0` does not stop a NaN in the
operand it multiplies (`0 * NaN = NaN`), so the rows of a block tile past its document's end are
zeroed in shared memory before a GEMM reads them.

Device code: this module imports cutlass at the top, and only the kernel modules import it.
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
    """Row `row` of a (rows, keys) accumulator view (`tiles.accumulator_rows_cols`): the scores of
    hidden keys become `-inf` (`coords_rc` holds each element's (row, key) coordinate)."""
    for c in cutlass.range_constexpr(cute.size(scores_rc, mode=[1])):
        if key_hidden(coords_rc[row, c][1], last_key):
            scores_rc[row, c] = -Float32.inf


@cute.jit
def zero_keys_past(tile: cute.Tensor, key_count: Int32, thread: Int32):
    """Zero keys `key_count ..` of a (key, dim) tile (another document's, or TMA fill), thread
    `thread < 128` taking key `thread`, and fence the stores for the tensor cores' reads. The
    caller's barrier over the threads that called it then orders the stores before those reads."""
    if thread < BLOCK_SIZE and thread >= key_count:
        # A rolled loop: unrolled, its 128 swizzled addresses would be hoisted out of the kernel's
        # loops and held in registers (or spilled) for stores that run once per partial block.
        for d in cutlass.range(HEAD_DIM, unroll=1):
            tile[thread, d] = tile.element_type(0.0)
    cute.arch.fence_proxy("async.shared", space="cta")
