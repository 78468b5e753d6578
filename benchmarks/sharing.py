"""`python -m benchmarks.sharing`: how much each selection regime shares, and the work the plan's
query-outer rule takes, without timing anything.

For each problem (`--seqlens`, one document each) and `--selection` regime, at M3 shapes (or
`--heads`), one line: the distinct blocks per 8-token group and their 90th percentile, the
(token, slot) pairs in blocks the whole group selects (`torch_msa.selection_stats`), and, for the
plan's query groups (`torch_msa/plan/README.md`, "Query groups"), the pairs that run query-outer,
how full its tiles are and the rows left without a combine. The benchmark prints the same beside
its times; here it runs on CPU too (the `index` and `tiled` selections then take minutes past 16K).
"""

import argparse
import sys

import torch

from torch_msa.contract import M3, Shape
from torch_msa.selection_stats import selection_sharing

from . import command
from .cli import parse_heads
from .problems import SELECTIONS, ProblemSpec, make_inputs, parse_seqlens, query_outer


def sharing_row(tokens: int, selection: str, shape, device: torch.device) -> dict:
    """The statistics of one problem: union and shared pairs of 8-token groups, and the query-outer work."""
    inputs = make_inputs(ProblemSpec((tokens,)), shape, device, selection, seed=0)
    union = selection_sharing(inputs.block_indices, inputs.cu_seqlens, group_size=8,
                              block_size=shape.block_size).overall
    work = query_outer(inputs)
    return {"tokens": tokens, "selection": selection, "union_mean": union.union_mean, "union_p90": union.union_p90,
            "shared_pairs": union.shared_pairs, "group_size": work.group_size, "q_outer": work.entries,
            "tile_fill": work.tile_fill, "rows_without_combine": work.rows_without_combine}


def add_regime_arguments(parser: argparse.ArgumentParser) -> None:
    """`--seqlens`, `--selection` and `--heads`, the arguments of the untimed per-regime commands
    (this one and `benchmarks.balance`); `parsed_regime_arguments` reads them."""
    parser.add_argument("--seqlens", nargs="+", default=["8K", "32K"], metavar="T",
                        help="document lengths (K = 1024; default 8K 32K)")
    parser.add_argument("--selection", nargs="+", default=list(SELECTIONS), choices=SELECTIONS,
                        help=f"selection regimes (default all: {' '.join(SELECTIONS)})")
    parser.add_argument("--heads", metavar="HQ/HKV", default=f"{M3.query_heads}/{M3.kv_heads}",
                        help=f"query and KV heads (default {M3.query_heads}/{M3.kv_heads})")


def parsed_regime_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[int], Shape]:
    """The document lengths and the shape `add_regime_arguments`' arguments name (a usage error
    where one does not parse); the regimes are `args.selection`."""
    return command.parsed(parser, parse_seqlens, args.seqlens), command.parsed(parser, parse_heads, args.heads)


@command.exits_on_interrupt
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sharing", description=__doc__.split("\n\n")[0])
    add_regime_arguments(parser)
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: CUDA when present)")
    args = parser.parse_args(argv)
    lengths, shape = parsed_regime_arguments(parser, args)
    device = command.device(parser, args.device)
    print(f"{'T':>8} {'selection':>9} {'blocks/8 tokens':>15} {'p90':>5} {'shared':>7} | {'query-outer':>11} "
          f"{'tile fill':>9} {'no combine':>10}")
    for tokens in lengths:
        for selection in args.selection:
            row = sharing_row(tokens, selection, shape, device)
            print(f"{tokens:>8} {selection:>9} {row['union_mean']:15.1f} {row['union_p90']:5.0f} "
                  f"{row['shared_pairs']:7.0%} | {row['q_outer']:11.1%} {row['tile_fill']:9.1%} "
                  f"{row['rows_without_combine']:10.1%}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
