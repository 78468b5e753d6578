"""`python -m benchmarks.deterministic`: the backward with and without deterministic algorithms.

Times `msa::backward` (whichever backend the registry resolves: on H100 / H200 with the `cute`
extra the `sm90` kernel by default and its deterministic variant under
`torch.use_deterministic_algorithms(True)`, elsewhere the Triton backend's atomic and
deterministic kernels) at M3 shapes on the benchmark's inputs, and prints per length the two medians, their effective
TF/s and the deterministic backward's share of the default one's speed. `--step` also times the
training step (`sparse_attention` with its plan built in the call, then `torch.autograd.grad` of a
fixed output gradient) both ways, whose share has the target (at least 70%), three ways: `step`,
calls queued back to back and event-timed (the device's time where the host keeps ahead);
`synced`, each call on an idle device and synchronised after it (what a loop that syncs pays, the
host work included); on CUDA `graph`, the step captured in a CUDA graph (after `--warmup` calls,
at least one) and replayed (the kernels alone). `--kl` also times the
index branch's sparse KL loss on the same inputs (`indexer_kl_loss` on the forward's lse and the
selection, then its gradients to the index inputs) with and without
deterministic algorithms (the Triton backend's atomic and deterministic KL kernels on CUDA).
`--error` also prints how far each backward's dQ lies from an fp32 backward's (`msa::backward` on
the inputs in fp32: the Triton kernels in full fp32 on CUDA), per (query, head) row as its largest
error over its largest |dQ|, over the rows whose largest |dQ| is at least a thousandth of the median
row's (a query that sees one key alone has dQ = 0, where any rounding is an infinite share).
`--outlier C` multiplies K and V of each document's first key (the attention sink,
where trained models' outlier activations sit) by `C` before anything runs: the case that widens
the fixed-point dQ's bound of the rows that select that key's block.
`--no-fill` runs deterministic mode with `torch.utils.deterministic.fill_uninitialized_memory` off:
PyTorch then no longer fills each new tensor with NaN (the ops' own buffers skip that fill
either way). `--profile` adds the device time of each kernel of one call of each (torch.profiler);
`--sweep` times the Triton backend's deterministic backward once per candidate launch configuration
of its query-outer dQ kernel, pinned in place of the tuned list (for retuning on a new device; the
`sm90` one adds dQ in its own kernel).
"""

import argparse
import contextlib
import statistics
import sys

import torch

import torch_msa
from torch_msa.backends import UnsupportedInputs
from torch_msa.contract import M3
from torch_msa.ops import backend_arguments

from . import command
from .problems import SELECTIONS, Inputs, ProblemSpec, make_inputs, parse_seqlens
from .timing import free_memory, graph_timer, measure

DEFAULT_SEQLENS = ("8K", "32K")
# (num_stages, num_warps, block_n) of the dQ kernel; those that fit 227 KB of shared memory on SM90.
SWEEP_QUERY_CONFIGS = ((3, 4, 64), (2, 4, 64), (4, 4, 64), (3, 8, 64), (2, 4, 128), (2, 8, 128), (3, 8, 128),
                       (4, 4, 32))


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool):
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(enabled)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def _kernel_times(call, device: torch.device) -> list[tuple[str, float]]:
    """(kernel name, device ms) of one call, slowest first."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    # Self time: an operator's own device time is 0, its kernels carry the time.
    rows = [(event.key, event.self_device_time_total / 1e3) for event in profile.key_averages()
            if event.self_device_time_total > 0]
    return sorted(rows, key=lambda row: -row[1])


def _sweep(backward_arguments, device, warmup, iters):
    """The Triton deterministic backward called directly, so that a refused configuration is
    reported rather than served by another backend."""
    from torch_msa.triton import backward_deterministic
    from torch_msa.triton_utils.launch import LaunchConfig, pinned

    def backward():
        return backward_deterministic.backward(*backend_arguments("backward", *backward_arguments))

    for stages, warps, block_n in SWEEP_QUERY_CONFIGS:
        config = LaunchConfig(num_stages=stages, num_warps=warps, block_n=block_n)
        try:
            with deterministic_algorithms(True), pinned("msa_bwd_dq_kernel", config):
                ms = f"{measure(backward, device, warmup, iters).median_ms:9.3f} ms"
        except UnsupportedInputs:
            ms = "does not fit this device's shared memory"
        print(f"          dQ kernel stages={stages} warps={warps} block_n={block_n:<4} {ms}")


def _dq_error_line(dq_by_mode, backward_arguments) -> str:
    """Median, p99 and max over rows of each dQ's largest error as a share of the row's largest
    |dQ| in the fp32 backward, and the same for that dQ rounded to the inputs' dtype; rows whose
    largest |dQ| is below a thousandth of the median row's are left out."""
    fp32_arguments = tuple(x.float() if torch.is_tensor(x) and x.is_floating_point() else x
                           for x in backward_arguments)
    want = torch.ops.msa.backward(*fp32_arguments)[0]
    row_scale = want.abs().amax(dim=-1).flatten()
    rows = row_scale >= row_scale.median() / 1000

    def quantiles(dq):
        share = ((dq.float() - want).abs().amax(dim=-1).flatten() / row_scale)[rows]
        # torch.quantile takes at most 2**24 values.
        sample = share[torch.linspace(0, share.numel() - 1, min(share.numel(), 1 << 24), device=share.device).long()]
        median, p99 = torch.quantile(sample, torch.tensor([0.5, 0.99], device=share.device)).tolist()
        return f"{median:.1e} / {p99:.1e} / {share.max().item():.1e}"

    rounded = want.to(dq_by_mode[False].dtype)
    parts = [f"{name} {quantiles(dq_by_mode[mode])}" for mode, name in ((False, "default"), (True, "deterministic"))]
    return f"{'dQ error':>7} (median / p99 / max of a row's, vs fp32): {', '.join(parts)}, fp32 rounded {quantiles(rounded)}"


def _attention_step(inputs):
    """One training step of the attention: the forward with its plan built in the call, then the
    gradients to q, k and v; q, k, v made leaves in the call, as a step's activations are."""

    def step():
        q, k, v = (x.detach().requires_grad_() for x in (inputs.q, inputs.k, inputs.v))
        out = torch_msa.sparse_attention(q, k, v, inputs.block_indices, *inputs.document_args,
                                         block_size=M3.block_size)
        return torch.autograd.grad(out, (q, k, v), inputs.grad_out)

    return step


def _step_ms(step, device: torch.device, deterministic: bool, timing: str, warmup: int, iters: int) -> float:
    """The median of `iters` steps timed `timing`'s way (`step`, `synced` or `graph`: the module's
    docstring), with deterministic algorithms `deterministic` (the graph captured under it)."""
    with deterministic_algorithms(deterministic):
        if timing == "graph":
            replay = graph_timer(step, device, max(warmup, 1))  # the capture must not compile
            times = [replay() for _ in range(iters)]
            del replay
            free_memory(device)
            return statistics.median(times)
        return measure(step, device, warmup, iters, synchronised=timing == "synced").median_ms


def with_outlier_keys(inputs: Inputs, factor: float) -> None:
    """Multiplies K and V of each non-empty document's first key by `factor`, in place."""
    starts, ends = inputs.cu_seqlens[:-1].long(), inputs.cu_seqlens[1:].long()
    first_keys = starts[starts < ends]
    inputs.k[first_keys] *= factor
    inputs.v[first_keys] *= factor


def _kl_step(inputs, lse):
    """One step of the sparse KL loss: the loss and its gradients to the index inputs."""
    index_q = inputs.index_q.detach().requires_grad_()
    index_k = inputs.index_k.detach().requires_grad_()

    def step():
        loss = torch_msa.indexer_kl_loss(inputs.q, inputs.k, lse, index_q, index_k, inputs.block_indices,
                                         *inputs.document_args, block_size=M3.block_size)
        return torch.autograd.grad(loss, (index_q, index_k))

    return step


@command.exits_on_interrupt
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.deterministic", description=__doc__.split("\n")[0])
    parser.add_argument("--seqlens", nargs="+", default=list(DEFAULT_SEQLENS), metavar="T",
                        help=f"single-document lengths (default: {' '.join(DEFAULT_SEQLENS)})")
    parser.add_argument("--selection", choices=SELECTIONS, default="index")
    parser.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--warmup", type=command.at_least(0), default=3)
    parser.add_argument("--iters", type=command.at_least(1), default=10)
    parser.add_argument("--step", action="store_true", help="also time the training step (forward and backward)")
    parser.add_argument("--kl", action="store_true", help="also time the sparse KL loss's forward and backward")
    parser.add_argument("--profile", action="store_true", help="print each kernel's device time of one call")
    parser.add_argument("--error", action="store_true", help="also print each backward's dQ error against fp32's")
    parser.add_argument("--outlier", type=float, metavar="C",
                        help="multiply K and V of each document's first key by C")
    parser.add_argument("--no-fill", action="store_true",
                        help="deterministic mode without PyTorch's NaN fill of new tensors "
                             "(torch.utils.deterministic.fill_uninitialized_memory = False)")
    parser.add_argument("--sweep", action="store_true",
                        help="time the Triton deterministic backward with each configuration of its dQ kernel")
    args = parser.parse_args(argv)
    seqlens = command.parsed(parser, parse_seqlens, args.seqlens)
    device = command.device(parser, args.device)
    if args.sweep and device.type != "cuda":
        parser.error(f"--sweep times the Triton kernels: it needs a CUDA device, not {device}")

    outlier = "" if args.outlier is None else f", first keys x{args.outlier:g}"
    fill = ", deterministic without NaN fill" if args.no_fill else ""
    print(f"msa::backward, M3 shapes, bf16, {args.selection} selection{outlier}{fill}, on {device}")
    print(command.torch_msa_origin())
    # A module property, which the type stubs do not declare.
    filled = torch.utils.deterministic.fill_uninitialized_memory  # type: ignore[attr-defined]
    torch.utils.deterministic.fill_uninitialized_memory = filled and not args.no_fill  # type: ignore[attr-defined]
    try:
        _run(args, seqlens, device)
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = filled  # type: ignore[attr-defined]
    return 0


def _run(args, seqlens, device) -> None:
    """`main`'s lines per length of `seqlens`, after its header."""
    print(f"{'T':>7} {'default ms':>11} {'TF/s':>6} {'deterministic ms':>17} {'TF/s':>6} {'speed share':>12}")
    for length in seqlens:
        inputs = make_inputs(ProblemSpec((length,)), M3, device, args.selection, seed=0)
        if args.outlier is not None:
            with_outlier_keys(inputs, args.outlier)
        scale = M3.head_dim ** -0.5
        arguments = (inputs.q, inputs.k, inputs.v, inputs.block_indices, *inputs.document_args, M3.block_size, scale)
        out, lse = torch.ops.msa.forward(*arguments)
        backward_arguments = (inputs.grad_out, inputs.q, inputs.k, inputs.v, out, lse, *arguments[3:])

        def backward(arguments=backward_arguments):
            return torch.ops.msa.backward(*arguments)

        times, kernels = {}, {}
        for deterministic in (False, True):
            with deterministic_algorithms(deterministic):
                times[deterministic] = measure(backward, device, args.warmup, args.iters).median_ms
                if args.profile:
                    kernels[deterministic] = _kernel_times(backward, device)
        flops = inputs.work.msa_backward
        print(f"{length:>7} {times[False]:>11.3f} {flops / times[False] / 1e9:>6.0f} {times[True]:>17.3f} "
              f"{flops / times[True] / 1e9:>6.0f} {times[False] / times[True]:>11.0%}")
        for deterministic, name in ((False, "default"), (True, "deterministic")):
            for kernel, ms in kernels.get(deterministic, []):
                print(f"          {name:>13} {ms:9.3f} ms  {kernel[:100]}")
        if args.step:
            step = _attention_step(inputs)
            for timing in ("step", "synced", "graph") if device.type == "cuda" else ("step", "synced"):
                step_times = {deterministic: _step_ms(step, device, deterministic, timing, args.warmup, args.iters)
                              for deterministic in (False, True)}
                print(f"{timing:>7} {step_times[False]:>11.3f} {'':>6} {step_times[True]:>17.3f} {'':>6} "
                      f"{step_times[False] / step_times[True]:>11.0%}")
        if args.kl:
            kl_step, kl_times = _kl_step(inputs, lse), {}
            for deterministic in (False, True):
                with deterministic_algorithms(deterministic):
                    kl_times[deterministic] = measure(kl_step, device, args.warmup, args.iters).median_ms
            print(f"{'KL loss':>7} {kl_times[False]:>11.3f} {'':>6} {kl_times[True]:>17.3f} {'':>6} "
                  f"{kl_times[False] / kl_times[True]:>11.0%}")
        if args.error:
            dq_by_mode = {}
            for deterministic in (False, True):
                with deterministic_algorithms(deterministic):
                    dq_by_mode[deterministic] = backward()[0]
            print(_dq_error_line(dq_by_mode, backward_arguments))
            del dq_by_mode
        if args.sweep:
            _sweep(backward_arguments, device, args.warmup, args.iters)
        del inputs, out, lse, backward_arguments
        free_memory(device)


if __name__ == "__main__":
    sys.exit(main())
