"""The TMA load pipelines of the SM90 kernels, on `cutlass.pipeline`.

Each kernel loads a key block's K and V once per item (a pipeline of one stage in the backward,
two in the forward, so that the next item's block loads during this one) and its per-token
operand tiles (Q; Q and dO) ahead of the tiles that read them (two stages in the backward, four
in the forward: two per consumer warpgroup). Warp 0 is the producer: `producer_acquire` waits
until every consumer warp of the stage has released it (its `empty` barrier) and arms the
stage's `full` barrier with the bytes the TMA will write; the TMA copies complete on that
barrier. The consumer warps (every warp in the backward; the two consumer warpgroups' in the
forward, each Q stage read by one of them) `consumer_wait` on `full`, and `consumer_release` (one
arrive per warp) once the GEMMs that read the stage have completed.

Device code: this module imports cutlass at the top, and only the kernel modules import it.
"""

import cutlass.cute as cute
from cutlass import pipeline


def tma_load_pipeline(barriers: cute.Pointer, stages: int, stage_bytes: int, consumer_warps: int):
    """A `PipelineTmaAsync` of `stages` stages of `stage_bytes` each on the `2 * stages` mbarriers
    at `barriers`, produced by one elected thread of warp 0 and consumed by `consumer_warps` warps.

    Its barriers are initialised but not yet fenced: the kernel calls
    `cute.arch.mbarrier_init_fence()` and a CTA barrier once all its pipelines exist."""
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=barriers,
        num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps),
        tx_count=stage_bytes,
        defer_sync=True,
    )


def producer_state(stages: int):
    """The producer's position in a pipeline of `stages` stages: its first acquire passes."""
    return pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)


def consumer_state(stages: int):
    """A consumer's position in a pipeline of `stages` stages: its first wait is for stage 0."""
    return pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
