"""torch_msa's own phases: selection, schedule, forward, backward and the whole training step.

* `select`: `torch_msa.select_blocks` (index scoring + top-k) on the problem's index inputs;
  `select topk=2`: the same scoring keeping one scored block (a top-1 instead of a top-15), so
  `1 - (topk=2) / select` is a lower bound of the top-k's share of the selection. (With
  `topk=1` only the local block is kept: no output reads a score, and the compiler drops the
  scoring GEMMs, which would overstate the share.)
* `schedule`: `msa::plan`, the key-to-query tables of the KV-outer kernels (`torch_msa/plan/schedule.py`),
  timed on its own; `sparse_attention` builds it once per call and autograd hands it to the
  backward.
* `fwd`, `bwd`: `msa::forward` and `msa::backward` called directly on the problem's indices,
  without a plan (so each builds its own, as a caller without a plan pays).
* `select+fwd+bwd`: `select_blocks -> sparse_attention -> autograd backward`, the number the
  speedup targets use; its peak device memory above the inputs is recorded too. Under the skewed
  and tile-shared selections the step still runs `select_blocks` but attends with the problem's
  indices.
* `synced step` (CUDA): the training step as a model runs it, one `msa_attention` call (selection
  and plan inside) and its backward, each call synchronised, so its host work counts; compared
  with the dense peers' `synced fwd+bwd`. The index selection only: `msa_attention` selects from
  the index inputs.

`torch_msa` runs under the caller's `TORCH_MSA_QUERY_OUTER` (unset: the default, whose Hopper
forward runs its query-outer part in documents of at least 8192 queries on H100s). With
`--query-outer`, `torch_msa q-outer` times `fwd` and `select+fwd+bwd` again with the forward's
query-outer part in every document (`TORCH_MSA_QUERY_OUTER=1` set around each call).

Whichever backend the registry resolves serves the ops. The pure-PyTorch reference is an oracle,
not a fast path: on CUDA its phases are skipped above `max_reference_tokens` tokens so that a
run without fast kernels still finishes.
"""

import os
from collections.abc import Callable
from typing import TypeVar
from unittest import mock

import torch

import torch_msa
from torch_msa import backends
from torch_msa.plan.schedule import entries_per_item
from torch_msa.settings import QUERY_OUTER_ENV

from .problems import Inputs
from .results import SYNCED_STEP
from .subject import Measurement, Subject

IMPL = "torch_msa"
SCORING_TOPK = 2
SCORING_PHASE = f"select topk={SCORING_TOPK}"
PHASES = ("select", SCORING_PHASE, "schedule", "fwd", "bwd", "select+fwd+bwd")
QUERY_OUTER_IMPL = "torch_msa q-outer"
QUERY_OUTER_PHASES = ("fwd", "select+fwd+bwd")
Result = TypeVar("Result")


def resolved_backends(device: torch.device) -> dict[str, str]:
    """Backend name serving each msa op on `device` (`{"select_blocks": "reference", ...}`)."""
    return {op: torch_msa.resolve(op, device).name for op in backends.OPS}


def msa_subject(inputs: Inputs, max_reference_tokens: int) -> Subject:
    device = inputs.q.device
    phases = PHASES + (SYNCED_STEP,) if device.type == "cuda" else PHASES
    try:
        serving = resolved_backends(device)
    except torch_msa.BackendError as error:
        return Subject(IMPL, phases, skip_reason=str(error))

    def too_slow(*ops) -> str:
        """Why these ops are skipped here, or '' when they run."""
        slow = [op for op in ops if serving[op] == "reference"]
        if device.type != "cuda" or not slow or inputs.spec.tokens <= max_reference_tokens:
            return ""
        return (f"msa::{'/'.join(slow)} served by the reference backend (no fast kernel registered); "
                f"skipped above --max-reference-tokens {max_reference_tokens}")

    def measurements():
        shape, work = inputs.shape, inputs.work
        block_size, scale = shape.block_size, shape.head_dim ** -0.5
        documents = inputs.document_args
        q, k, v, block_indices = inputs.q, inputs.k, inputs.v, inputs.block_indices

        skip = too_slow("select_blocks")
        yield Measurement("select", None if skip else inputs.select, work.index_scoring, skip)
        # Same scoring, a top-1 of the scored blocks: the difference to `select` is the top-k's share.
        yield Measurement(SCORING_PHASE, None if skip else (lambda: inputs.select(topk=SCORING_TOPK)),
                          work.index_scoring,
                          skip or "the same scoring keeping one scored block, to measure the share of the top-k")

        def plan():
            return torch.ops.msa.plan(block_indices, *documents, k.shape[0], block_size,
                                      entries_per_item(shape.query_heads, shape.kv_heads))

        yield Measurement("schedule", plan, None,
                          "msa::plan, the key-to-query schedule of one step (torch_msa/plan/schedule.py), timed alone")

        def forward():
            return torch.ops.msa.forward(q, k, v, block_indices, *documents, block_size, scale)

        skip = too_slow("forward")
        yield Measurement("fwd", None if skip else forward, work.msa_forward, skip)

        skip = too_slow("forward", "backward")
        if skip:
            yield Measurement("bwd", None, work.msa_backward, skip)
        else:
            out, lse = forward()
            yield Measurement(
                "bwd",
                lambda: torch.ops.msa.backward(inputs.grad_out, q, k, v, out, lse, block_indices, *documents,
                                               block_size, scale),
                work.msa_backward,
            )
            del out, lse

        skip = too_slow("select_blocks", "forward", "backward")
        leaves = tuple(x.detach().requires_grad_() for x in (q, k, v))
        given = inputs.selection != "index"

        def step():
            chosen = inputs.select()
            if given:
                chosen = block_indices
            out = torch_msa.sparse_attention(*leaves, chosen, *documents, block_size=block_size)
            return torch.autograd.grad(out, leaves, inputs.grad_out)

        note = skip or (f"select_blocks runs, then the {inputs.selection} indices are attended" if given else "")
        yield Measurement("select+fwd+bwd", None if skip else step, work.msa_step, note, track_memory=True)
        if device.type != "cuda":
            return

        def model_step():
            out = torch_msa.msa_attention(*leaves, inputs.index_q, inputs.index_k, *documents, topk=shape.topk,
                                          block_size=block_size)
            return torch.autograd.grad(out, leaves, inputs.grad_out)

        note = skip or ("msa_attention selects from the index inputs: timed on the index selection only" if given
                        else "")
        yield Measurement(SYNCED_STEP, None if note else model_step, work.msa_step, note, synchronised=True)

    return Subject(IMPL, phases, measurements)


def with_query_outer_setting(fn: Callable[[], Result], value: str) -> Callable[[], Result]:
    """`fn` called with `TORCH_MSA_QUERY_OUTER` set to `value` (the caller's value restored)."""

    def call():
        with mock.patch.dict(os.environ, {QUERY_OUTER_ENV: value}):
            return fn()

    return call


def query_outer_subject(inputs: Inputs, max_reference_tokens: int) -> Subject:
    """`msa_subject`'s forward and step with the forward's query-outer part."""
    plain = msa_subject(inputs, max_reference_tokens)
    if plain.measurements is None:
        return Subject(QUERY_OUTER_IMPL, QUERY_OUTER_PHASES, skip_reason=plain.skip_reason)
    measurements = plain.measurements

    def query_outer_measurements():
        for measurement in measurements():
            if measurement.phase in QUERY_OUTER_PHASES:
                yield measurement._replace(fn=measurement.fn and with_query_outer_setting(measurement.fn, "1"))

    return Subject(QUERY_OUTER_IMPL, QUERY_OUTER_PHASES, query_outer_measurements)
