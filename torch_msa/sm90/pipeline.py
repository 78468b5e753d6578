"""The TMA load pipelines of the SM90 kernels (`cutlass.pipeline`): warp 0 produces; consumer
warps release a stage (one arrive each) once the GEMMs that read it have completed.
"""

import cutlass.cute as cute
from cutlass import pipeline


def tma_load_pipeline(barriers: cute.Pointer, stages: int, stage_bytes: int, consumer_warps: int):
    """A `PipelineTmaAsync` of `stages` x `stage_bytes` on the `2 * stages` mbarriers at `barriers`,
    consumed by `consumer_warps` warps; not yet fenced (the kernel fences once for all pipelines)."""
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=barriers,
        num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps),
        tx_count=stage_bytes,
        defer_sync=True,
    )


def producer_state(stages: int):
    """The producer's position: its first acquire passes."""
    return pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)


def consumer_state(stages: int):
    """A consumer's position: its first wait is for stage 0."""
    return pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
