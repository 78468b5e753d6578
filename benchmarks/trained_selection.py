"""The `trained` selection regime: block selections a trained index branch made on held-out text.

The fixture (`trained_selection.npz` beside this file) holds the selections of
`examples/train_long_context.py`'s sparse arm on held-out documents: one *stream* per (layer, KV
head) of the trained model, each a `[T, topk]` selection over the same packed documents. It is
stored as one bitmask row per token over the document's blocks, each row XOR-ed with the row
before it (neighbouring tokens select mostly the same blocks) and compressed with LZMA.

Mapping onto a benchmark problem: KV head `h` takes stream `h % streams` (named in
`TrainedSelections.streams`). Document `i` of the problem takes the prefix of fixture document
`i % documents` (a prefix of a causal selection is the selection of the prefix); a problem
document longer than the fixture's documents is first split into documents of that length, since
the model never saw longer ones (`split_beyond_trained`).

    python -m benchmarks.trained_selection RUN/selections.pt     # write the fixture from a run
"""

import argparse
import dataclasses
import functools
import io
import json
import lzma
import sys
from pathlib import Path

import numpy as np
import torch

FIXTURE = Path(__file__).with_name("trained_selection.npz")
MAX_BYTES = 400_000  # every device call carries the tree


@dataclasses.dataclass(frozen=True)
class TrainedSelections:
    """`block_indices` int32 `[streams, T, topk]` over documents of `lengths` (document-local ids,
    the op contract: valid ids ascending, the local block last, -1 after)."""

    block_indices: torch.Tensor
    lengths: tuple[int, ...]
    block_size: int
    streams: tuple[str, ...]
    meta: dict

    @property
    def topk(self) -> int:
        return self.block_indices.shape[-1]


def _rows_to_bits(ids: np.ndarray, blocks: int) -> np.ndarray:
    bits = np.zeros((ids.shape[0], blocks), dtype=bool)
    rows, slots = np.nonzero(ids >= 0)
    bits[rows, ids[rows, slots]] = True
    return bits


def _bits_to_rows(bits: np.ndarray, position: np.ndarray, block_size: int, topk: int) -> np.ndarray:
    """Bitmask rows -> ids in the contract's order: the other blocks ascending, the local block last."""
    local = position // block_size
    others = np.zeros((len(bits), max(bits.shape[1], topk - 1)), dtype=bool)  # at least topk - 1 columns
    others[:, : bits.shape[1]] = bits
    others[np.arange(len(bits)), local] = False
    order = np.argsort(~others, axis=1, kind="stable")[:, : topk - 1]  # set bits first, ascending
    taken = np.take_along_axis(others, order, axis=1)
    ids = np.where(taken, order, -1)
    count = taken.sum(1)
    out = np.full((len(bits), topk), -1, dtype=np.int32)
    out[:, : topk - 1] = ids
    out[np.arange(len(bits)), count] = local
    return out


def encode(block_indices: torch.Tensor, lengths: list[int], block_size: int, streams: list[str], meta: dict) -> bytes:
    """`[streams, T, topk]` selections of documents `lengths` -> the fixture's bytes."""
    ids = block_indices.to(torch.int32).cpu().numpy()
    parts = []
    start = 0
    for length in lengths:
        blocks = -(-length // block_size)
        for stream in ids[:, start:start + length]:
            bits = _rows_to_bits(stream, blocks)
            bits[1:] ^= bits[:-1]
            parts.append(np.packbits(bits, axis=1).tobytes())
        start += length
    header = {"lengths": list(lengths), "block_size": block_size, "topk": int(ids.shape[-1]), "streams": list(streams),
              "meta": meta}
    buffer = io.BytesIO()
    np.savez(buffer, header=np.frombuffer(json.dumps(header).encode(), dtype=np.uint8),
             bits=np.frombuffer(lzma.compress(b"".join(parts), preset=9 | lzma.PRESET_EXTREME), dtype=np.uint8))
    return buffer.getvalue()


@functools.lru_cache(maxsize=2)
def load(path: Path = FIXTURE) -> TrainedSelections:
    """The fixture's selections; a `ValueError` says how to make one when it is missing."""
    if not Path(path).exists():
        raise ValueError(f"--selection trained: no fixture at {path}; make one with examples/train_long_context.py "
                         "and python -m benchmarks.trained_selection RUN/selections.pt")
    with np.load(path) as stored:
        header = json.loads(stored["header"].tobytes())
        raw = lzma.decompress(stored["bits"].tobytes())
    block_size, topk, streams = header["block_size"], header["topk"], header["streams"]
    rows, offset = [], 0
    for length in header["lengths"]:
        blocks = -(-length // block_size)
        width = -(-blocks // 8)
        position = np.arange(length)
        document = []
        for _ in streams:
            packed = np.frombuffer(raw, dtype=np.uint8, count=length * width, offset=offset).reshape(length, width)
            offset += length * width
            bits = np.bitwise_xor.accumulate(np.unpackbits(packed, axis=1)[:, :blocks].astype(bool), axis=0)
            document.append(_bits_to_rows(bits, position, block_size, topk))
        rows.append(np.stack(document))
    return TrainedSelections(torch.from_numpy(np.concatenate(rows, axis=1)), tuple(header["lengths"]), block_size,
                             tuple(streams), header["meta"])


def split_beyond_trained(lengths: tuple[int, ...], trained_length: int) -> tuple[int, ...]:
    """Documents longer than `trained_length` split into documents of at most that length."""
    split: list[int] = []
    for length in lengths:
        while length > trained_length:
            split.append(trained_length)
            length -= trained_length
        split.append(length)
    return tuple(split)


def selection_for(selections: TrainedSelections, lengths: tuple[int, ...], kv_heads: int, topk: int,
                  block_size: int) -> torch.Tensor:
    """int32 `[kv_heads, sum(lengths), topk]`: the mapping of the module docstring; every length at
    most the fixture's shortest document (see `split_beyond_trained`)."""
    if (topk, block_size) != (selections.topk, selections.block_size):
        raise ValueError(f"--selection trained: the fixture selects top-{selections.topk} blocks of "
                         f"{selections.block_size}; the problem asks for top-{topk} of {block_size}")
    longest = min(selections.lengths)
    if max(lengths, default=0) > longest:
        raise ValueError(f"lengths: expected documents of at most {longest} tokens (the trained selections'), got {max(lengths)}")
    starts = np.concatenate([[0], np.cumsum(selections.lengths)])
    streams = len(selections.streams)
    pieces = []
    for i, length in enumerate(lengths):
        start = int(starts[i % len(selections.lengths)])
        pieces.append(selections.block_indices[:, start:start + length])
    packed = torch.cat(pieces, dim=1) if pieces else selections.block_indices[:, :0]
    return packed[[h % streams for h in range(kv_heads)]].contiguous()


def describe(selections: TrainedSelections, lengths: tuple[int, ...], kv_heads: int) -> str:
    """What `selection_for` maps onto a problem, for the benchmark's notes."""
    heads = ", ".join(f"KV head {h}: {selections.streams[h % len(selections.streams)]}" for h in range(kv_heads))
    documents = len(selections.lengths)
    reused = f"; {len(lengths)} documents take the prefixes of {documents} held-out one(s), reused in turn" \
        if len(lengths) > documents else ""
    return (f"trained selections of step {selections.meta.get('step')} on held-out text ({heads}){reused}; "
            f"documents are at most the trained length, {min(selections.lengths)} tokens")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Write the trained-selection fixture from a training run's selections.pt.")
    parser.add_argument("selections", type=Path, help="selections.pt written by examples/train_long_context.py")
    parser.add_argument("--out", type=Path, default=FIXTURE, help=f"default: {FIXTURE}")
    parser.add_argument("--layers", help="comma-separated layers to keep, e.g. 1,3 (default: every layer)")
    args = parser.parse_args(argv)
    if not args.selections.exists():
        parser.error(f"selections: expected a file written by examples/train_long_context.py, got {args.selections} (missing)")
    saved = torch.load(args.selections, weights_only=False)
    block_indices = saved["block_indices"]  # [layers, Hkv, T, topk]
    layers = list(range(block_indices.shape[0]))
    if args.layers is not None:
        chosen = [int(x) for x in args.layers.split(",") if x.strip().lstrip("-").isdigit()]
        if not chosen or any(layer not in layers for layer in chosen):
            parser.error(f"--layers: expected comma-separated layers of {layers}, got {args.layers!r}")
        layers = chosen
    kv_heads = block_indices.shape[1]
    streams = [f"layer {layer} KV head {head}" for layer in layers for head in range(kv_heads)]
    selection = block_indices[layers].flatten(0, 1)
    cu = saved["cu_seqlens"].long()
    lengths = (cu[1:] - cu[:-1]).tolist()
    for count in range(len(lengths), 0, -1):  # as many held-out documents as fit
        meta = {"step": saved["step"], "documents": saved["documents"][:count], "source": args.selections.name}
        data = encode(selection[:, :sum(lengths[:count])], lengths[:count], saved["block_size"], streams, meta)
        if len(data) <= MAX_BYTES:
            break
    else:
        parser.error(f"one document of {len(streams)} streams takes {len(data)} bytes, over the {MAX_BYTES} a fixture "
                     "may take: keep fewer --layers")
    args.out.write_bytes(data)
    print(f"wrote {args.out}: {len(data)} bytes, {count} documents of {lengths[:count]} tokens, streams {streams}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
