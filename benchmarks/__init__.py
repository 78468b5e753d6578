"""The benchmark of torch_msa: `python -m benchmarks`, run from the repository root.

It is tooling, not part of the installed package: `pip install .` ships `torch_msa` only, and
`import torch_msa` never imports this package. It measures the installed or checked-out
torch_msa through its public API, its ops and (for the kernel-level commands) its backend
modules.

In one process, on the same random inputs and block indices (M3 shapes by default: Hq=64, Hkv=4,
D=128, block 128, top-16, bf16, index heads 4 x 128; `--heads` sets other head counts), it times

* dense causal SDPA forced to cuDNN and to flash (the math backend on CPU): the baseline;
* fla's `parallel_nsa` selected-block attention (optional package `fla-core`);
* FlexAttention with the exact MSA mask, heads folded into the query axis;
* cuDNN frontend's block-sparse attention (blocks of 128 and, forward only, 64), on the
  tile-shared selections of `--selection tiled`, where it computes what MSA computes at each
  query tile's last row (optional package `nvidia-cudnn-frontend`);
* torch_msa: `select_blocks`, the shared schedule, `msa::forward`, `msa::backward`, and the
  whole `select -> forward -> backward` step,

for single documents of 8K to 128K tokens and a varlen pack, and reports milliseconds,
effective TF/s by the FLOP formulas of `docs/performance.md` (valid elements only), the fraction
of the device's dense bf16 rate (`devices`), the speedup over the dense baseline, and the
performance goals (`targets`).

Modules: `flops` (formulas), `problems` (layouts, inputs, selections), `timing` (how one
measurement is timed), `flex_mask` (the BlockMask), `peers` and `msa` (what is timed),
`runner`, `results`, `targets`, `devices` (peak rates, L2), `report` (table, JSON, PNG), `cli`,
and `command` (what every command shares: its arguments checked, its end on Ctrl-C).
Separate commands: `python -m benchmarks.deterministic` (the backward with and without
`torch.use_deterministic_algorithms(True)`), `python -m benchmarks.kl` (the KL loss against
the attention step), `python -m benchmarks.overhead` (what each eager call costs the host
and the GPU: host time after a sync and in a loop, kernel, synchronised and CUDA-graph times), `python -m benchmarks.sm90`
(the SM90 CuTe DSL forward and backward against the Triton kernels, split into their parts) and
`python -m benchmarks.sharing` (each selection regime's union statistics and the work the plan's
query-outer rule takes, untimed), `python -m benchmarks.balance` (how evenly the `sm90` kernels'
walk spreads the plan's items over the CTAs, untimed) and `python -m benchmarks.frontend` (the
host cost of the layers above the backends, every op a stub, on CPU).
"""

import sys

if sys.argv[:1] == ["-m"]:
    # `python -m benchmarks[.COMMAND]` imports this package while it locates the command (Python
    # sets sys.argv[0] to "-m" meanwhile): from here to the command's `main`, through its imports,
    # Ctrl-C ends it with the interrupted line too.
    from .command import stop_cleanly_while_starting

    stop_cleanly_while_starting()
