"""The softmax of the SM90 kernels, in the log2 domain: over one block (a KV-outer slot) or online
over a query group's blocks. A score row lives in a quad's 4 threads, so row reductions end with
two shuffles.
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
    """Row `row` in place: `exp2(scale_log2 * s - shift)`, `shift = scale_log2 * max(s)` (0 if all
    hidden, so the row stays zero). Returns `(shift, sum)`; log2-sum-exp is `shift + log2(sum)`."""
    best = quad_max(scores_rc[row, None].load().reduce(cute.ReductionOp.MAX, -Float32.inf, 0))
    if best == -Float32.inf:
        best = Float32(0.0)
    shift = best * scale_log2
    probs = cute.math.exp2(scores_rc[row, None].load() * scale_log2 - shift, fastmath=True)
    total = quad_sum(probs.reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
    scores_rc[row, None].store(probs)
    return shift, total


def probability(score: Float32, scale_log2: Float32, lse_log2: Float32) -> Float32:
    """`exp2(scale_log2 * score - lse_log2)`, `lse_log2` the row's final log2-sum-exp."""
    return cute.math.exp2(score * scale_log2 - lse_log2, fastmath=True)


@cute.jit
def online_softmax_row(scores_rc: cute.Tensor, row: cutlass.Constexpr[int], scale_log2: Float32, shift: Float32,
                       total: Float32):
    """Row `row` of the next block in place, after blocks whose running `(shift, total)` it
    continues (`(-inf, 0)` before the first): `exp2(scale_log2 * s - shift')` with `shift'` the
    running max in the log2 domain. Returns `(shift', total', rescale)`: the earlier blocks' sum and
    output rows are scaled by `rescale`; log2-sum-exp is `shift' + log2(total')` at the end."""
    best = quad_max(scores_rc[row, None].load().reduce(cute.ReductionOp.MAX, -Float32.inf, 0)) * scale_log2
    new_shift = shift
    if best > new_shift:
        new_shift = best
    # A row that has seen no key yet keeps its zeros.
    base = new_shift
    if base == -Float32.inf:
        base = Float32(0.0)
    rescale = cute.math.exp2(shift - base, fastmath=True)
    probs = cute.math.exp2(scores_rc[row, None].load() * scale_log2 - base, fastmath=True)
    total = total * rescale + quad_sum(probs.reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
    scores_rc[row, None].store(probs)
    return new_shift, total, rescale
