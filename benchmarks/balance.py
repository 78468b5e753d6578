"""`python -m benchmarks.balance`: how evenly the `sm90` kernels' persistent walk spreads a plan's
items over the CTAs, without timing anything.

CTA `c` of a persistent grid of `n` walks items `c, c + n, ...` (`torch_msa/sm90/tile_scheduler.py`),
and a kernel ends with its busiest CTA. For each problem (`--seqlens`, one document each) and
`--selection` regime, at M3 shapes (or `--heads`), one line per item size: the items of the public
API's plans (`plan`: the default backward walks them all, and so does the KV-outer forward where
the call runs no query-outer part in one query window) and of the deterministic backward
(`deterministic`: `workspace_entries_per_item`, `torch_msa/stages/deterministic.py`). Each
line gives the items, the mean work per CTA (an item's work: its query tiles of `TOKENS_PER_TILE`
tokens) and the busiest and idlest CTA's work over that mean, under the kernels' walk
(`round-robin`) and under an in-order fetch (`in order`: each item, in the plan's order, to the
CTA that finishes first, as a dynamic scheduler hands them out). The busiest CTA's share above
the mean is the kernel's tail, where the other SMs idle. `tokens in flight`: the median, over the
walk's rounds of one item per CTA, of the distinct (KV head, query token) pairs those items hold,
whose queries, output gradients and dQ rows the L2 cache keeps for the blocks that reuse them.
Runs on CPU, where the `index` and `tiled` selections take minutes past 16K (their selection runs
on the reference).
"""

import argparse
import heapq
import sys

import torch

from torch_msa.documents import Documents
from torch_msa.plan.schedule import build_schedule, entries_per_item, with_items
from torch_msa.sm90.common import TOKENS_PER_TILE
from torch_msa.stages.deterministic import workspace_entries_per_item

from . import command
from .problems import ProblemSpec, make_inputs
from .sharing import add_regime_arguments, parsed_regime_arguments

HOPPER_SXM_SMS = 132  # one CTA per SM: H100 and H200 SXM


def round_robin_loads(work: torch.Tensor, ctas: int) -> torch.Tensor:
    """int64 `[ctas]`: each CTA's total of `work` (per item, in walk order) when CTA `c` takes
    items `c, c + ctas, ...`."""
    padded = torch.zeros(-(-work.numel() // ctas) * ctas, dtype=torch.int64)
    padded[: work.numel()] = work
    return padded.view(-1, ctas).sum(0)


def in_order_loads(work: torch.Tensor, ctas: int) -> torch.Tensor:
    """int64 `[ctas]`: each CTA's total of `work` when each item, in order, goes to the CTA whose
    work so far is least (the lowest index among equals)."""
    heap = [(0, cta) for cta in range(ctas)]
    for item_work in work.tolist():
        load, cta = heapq.heappop(heap)
        heapq.heappush(heap, (load + item_work, cta))
    loads = torch.zeros(ctas, dtype=torch.int64)
    for load, cta in heap:
        loads[cta] = load
    return loads


def tokens_in_flight(item_tokens: list[torch.Tensor], ctas: int) -> int:
    """The median (the lower middle one) over the rounds of `ctas` consecutive items of the
    distinct values they hold (`item_tokens`: each item's tokens, in walk order)."""
    rounds = [torch.cat(item_tokens[first:first + ctas]).unique().numel() for first in range(0, len(item_tokens), ctas)]
    return int(torch.tensor(rounds).median())


def plan_items(tokens: int, selection: str, shape, entries: dict[str, int]) -> dict[str, list[torch.Tensor]]:
    """Per item size of `entries` (name: entries per item), each item's (KV head, query token)
    pairs as `head * tokens + token`, in plan order, for one document of `tokens` tokens under
    `selection` (on CPU)."""
    inputs = make_inputs(ProblemSpec((tokens,)), shape, torch.device("cpu"), selection, seed=0)
    documents = Documents(inputs.cu_seqlens, inputs.cu_seqlens, tokens, tokens)
    # The entries and buckets do not depend on the item size; `with_items` cuts each size's items.
    schedule = build_schedule(inputs.block_indices, documents, tokens, shape.block_size, min(entries.values()))
    num_buckets = int(schedule.num_buckets[0])
    sizes = schedule.bucket_ptr[1:num_buckets + 1] - schedule.bucket_ptr[:num_buckets]
    entry_heads = schedule.bucket_head[:num_buckets].repeat_interleave(sizes)
    entry_pairs = entry_heads * tokens + schedule.entry_query[: entry_heads.numel()] // shape.topk
    items_by_size = {}
    for name, size in entries.items():
        items = with_items(schedule, size)
        count = int(items.num_items[0])
        ranges = zip(items.item_start[:count].tolist(), items.item_end[:count].tolist())
        items_by_size[name] = [entry_pairs[start:end] for start, end in ranges]
    return items_by_size


@command.exits_on_interrupt
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.balance", description=__doc__.split("\n\n")[0])
    add_regime_arguments(parser)
    parser.add_argument("--ctas", type=command.at_least(1), default=HOPPER_SXM_SMS,
                        help=f"CTAs of the persistent grid (default {HOPPER_SXM_SMS}: an H100's or H200's SMs)")
    args = parser.parse_args(argv)
    lengths, shape = parsed_regime_arguments(parser, args)
    entries = {"plan": entries_per_item(shape.query_heads, shape.kv_heads),
               "deterministic": workspace_entries_per_item(shape.query_heads, shape.kv_heads)}
    print(f"{'T':>8} {'selection':>9} {'items of':>13} {'items':>7} {'tiles/CTA':>9} | "
          f"{'round-robin max':>15} {'min':>5} | {'in order max':>12} {'min':>5} | {'tokens in flight':>16}")
    for tokens in lengths:
        for selection in args.selection:
            for name, items in plan_items(tokens, selection, shape, entries).items():
                work = torch.tensor([-(-item.numel() // TOKENS_PER_TILE) for item in items], dtype=torch.int64)
                mean = work.sum().item() / args.ctas
                walked, fetched = round_robin_loads(work, args.ctas), in_order_loads(work, args.ctas)
                print(f"{tokens:>8} {selection:>9} {name:>13} {work.numel():>7} {mean:9.0f} | "
                      f"{walked.max().item() / mean:15.3f} {walked.min().item() / mean:5.3f} | "
                      f"{fetched.max().item() / mean:12.3f} {fetched.min().item() / mean:5.3f} | "
                      f"{tokens_in_flight(items, args.ctas):16}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
