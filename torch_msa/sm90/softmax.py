"""The softmax over one key block, for the SM90 forward and backward kernels, in the log2 domain.

Each slot of a query's selection is one block of 128 keys, so the forward needs no online
rescale: a row's max and sum over its block are final for that slot, and the combine merges the
slots. The backward recomputes the probabilities with the final (natural-log) lse the forward
returned, converted to log2 when its rows are staged.

A row of the forward's 64 x 128 score accumulator lives in the 4 threads of a quad (each holding
two adjacent columns of every 8), so row reductions end with two butterfly shuffles.

Device code: this module imports cutlass at the top, and only the kernel modules import it.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32


def quad_max(value: Float32) -> Float32:
    """The max over the 4 threads of a quad that share a row."""
    for offset in (1, 2):
        value = cute.arch.fmax(value, cute.arch.shuffle_sync_bfly(value, offset=offset))
    return value


def quad_sum(value: Float32) -> Float32:
    """The sum over the 4 threads of a quad that share a row."""
    for offset in (1, 2):
        value = value + cute.arch.shuffle_sync_bfly(value, offset=offset)
    return value


@cute.jit
def block_softmax_row(scores_rc: cute.Tensor, row: cutlass.Constexpr[int], scale_log2: Float32):
    """Row `row` of a (rows, keys) accumulator view: `exp2(scale_log2 * s - shift)` in place, with
    `shift = scale_log2 * max(s)` (0 when every key is hidden, so a hidden row stays all zeros).
    Returns `(shift, sum)`: the row's log2-sum-exp is `shift + log2(sum)`."""
    best = quad_max(scores_rc[row, None].load().reduce(cute.ReductionOp.MAX, -Float32.inf, 0))
    if best == -Float32.inf:
        best = Float32(0.0)
    shift = best * scale_log2
    probs = cute.math.exp2(scores_rc[row, None].load() * scale_log2 - shift, fastmath=True)
    total = quad_sum(probs.reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
    scores_rc[row, None].store(probs)
    return shift, total


def probability(score: Float32, scale_log2: Float32, lse_log2: Float32) -> Float32:
    """A recomputed probability: `exp2(scale_log2 * score - lse_log2)`, `lse_log2` the row's final
    log2-sum-exp (0 for a row that sees no key)."""
    return cute.math.exp2(score * scale_log2 - lse_log2, fastmath=True)
