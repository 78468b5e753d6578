"""Context parallelism (`torch_msa.distributed`) against one process running the whole pack.

The multi-process tests spawn `world_size` processes once (gloo over a `file://` rendezvous in a
temporary directory, so no port can clash) and run every case inside them. Each rank computes
the single-process result on the whole pack itself, then its context-parallel share, and
checks: out, lse, the selections (as sets), dq, dk, dv (dk, dv after the reduce-scatter), the
sparse and dense KL losses (summed over the ranks) and their index_q / index_k gradients. In
fp64 both sides agree to rounding.
"""

import functools
import itertools
import os
import tempfile
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.utils.checkpoint

import torch_msa
from torch_msa import distributed as cp

HEADS, KV_HEADS, DIM, INDEX_DIM, BLOCK, TOPK = 4, 2, 64, 16, 64, 2

# Several documents with an empty one, a 1-token one and ones shorter than 2 x world_size chunks;
# T = 513 divides by neither 4 nor 8 chunks. "few" has fewer tokens than 4 ranks.
PACKS = {
    "mixed": [300, 0, 1, 5, 130, 77],
    "one-document": [517],
    "few": [1, 0, 2],
}


def _cu(lengths):
    return [0, *itertools.accumulate(lengths)]


def _pack(lengths, device, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)

    def tensor(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)

    return dict(q=tensor(tokens, HEADS, DIM), k=tensor(tokens, KV_HEADS, DIM), v=tensor(tokens, KV_HEADS, DIM),
                index_q=tensor(tokens, KV_HEADS, INDEX_DIM), index_k=tensor(tokens, 1, INDEX_DIM),
                grad_out=tensor(tokens, HEADS, DIM), grad_lse=tensor(tokens, HEADS))


def _leaves(tensors):
    return {name: x.detach().clone().requires_grad_() for name, x in tensors.items()}


def _sorted_ids(block_indices):
    return block_indices.sort(dim=-1).values


def _single_process(x, lengths):
    """Everything the distributed run must reproduce, on the whole pack in one process."""
    device = x["q"].device
    cu = torch.tensor(_cu(lengths), dtype=torch.int32, device=device)
    docs = (cu, cu, max(lengths), max(lengths))
    t = _leaves({name: x[name] for name in ("q", "k", "v", "index_q", "index_k")})
    attn = torch_msa.msa_attention(t["q"], t["k"], t["v"], t["index_q"].detach(), t["index_k"].detach(), *docs,
                                   topk=TOPK, block_size=BLOCK, return_lse=True, return_block_indices=True)
    out, lse, block_indices = attn.out, attn.lse, attn.block_indices
    dq, dk, dv = torch.autograd.grad((out * x["grad_out"]).sum() + (lse * x["grad_lse"]).sum(),
                                     (t["q"], t["k"], t["v"]))
    kl = torch_msa.indexer_kl_loss(t["q"].detach(), t["k"].detach(), lse.detach(), t["index_q"], t["index_k"],
                                   block_indices, *docs, block_size=BLOCK)
    d_index_q, d_index_k = torch.autograd.grad(kl, (t["index_q"], t["index_k"]))
    dense = torch_msa.indexer_kl_loss_dense(t["q"].detach(), t["k"].detach(), t["index_q"], t["index_k"], *docs,
                                            block_size=BLOCK)
    dense_d_index_q, dense_d_index_k = torch.autograd.grad(dense, (t["index_q"], t["index_k"]))
    return dict(out=out.detach(), lse=lse.detach(), block_indices=block_indices, dq=dq, dk=dk, dv=dv, kl=kl.detach(),
                d_index_q=d_index_q, d_index_k=d_index_k, dense=dense.detach(), dense_d_index_q=dense_d_index_q,
                dense_d_index_k=dense_d_index_k)


def _context_parallel(x, layout, group):
    """The same quantities from the ranks' shares; each rank returns its local ones."""
    local = _leaves({name: layout.shard(x[name]) for name in ("q", "k", "v", "index_q", "index_k")})
    out, lse, block_indices = cp.msa_attention(local["q"], local["k"], local["v"], local["index_q"], local["index_k"],
                                               layout, group, topk=TOPK, block_size=BLOCK, return_lse=True,
                                               return_block_indices=True)
    loss = (out * layout.shard(x["grad_out"])).sum() + (lse * layout.shard(x["grad_lse"])).sum()
    dq, dk, dv = torch.autograd.grad(loss, (local["q"], local["k"], local["v"]))
    kl = cp.indexer_kl_loss(local["q"].detach(), local["k"].detach(), lse.detach(), local["index_q"],
                            local["index_k"], block_indices, layout, group, block_size=BLOCK)
    d_index_q, d_index_k = torch.autograd.grad(kl, (local["index_q"], local["index_k"]))
    dense = cp.indexer_kl_loss_dense(local["q"].detach(), local["k"].detach(), local["index_q"], local["index_k"],
                                     layout, group, block_size=BLOCK)
    dense_d_index_q, dense_d_index_k = torch.autograd.grad(dense, (local["index_q"], local["index_k"]))
    return dict(out=out.detach(), lse=lse.detach(), block_indices=block_indices, dq=dq, dk=dk, dv=dv, kl=kl.detach(),
                d_index_q=d_index_q, d_index_k=d_index_k, dense=dense.detach(), dense_d_index_q=dense_d_index_q,
                dense_d_index_k=dense_d_index_k)


def _summed(value, group):
    total = value.clone()
    dist.all_reduce(total, group=group)
    return total


def _check_case(name, lengths, device, dtype, tolerance, group=None, seed=0):
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    x = _pack(lengths, device, dtype, seed)
    want = _single_process(x, lengths)
    layout = cp.load_balanced_layout(_cu(lengths), world_size, rank, device=device)
    got = _context_parallel(x, layout, group)

    def close(what, a, b):
        # Absolute tolerance relative to the largest entry: the index gradients are ~1 / (T x Hi).
        scale = b.abs().max().item() if b.numel() else 0.0
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance * max(scale, 1e-30),
                                   msg=lambda m: f"{name}, rank {rank} of {world_size}, {what}: {m}")

    for what in ("out", "lse", "dq", "dk", "dv", "d_index_q", "d_index_k", "dense_d_index_q", "dense_d_index_k"):
        close(what, got[what], layout.shard(want[what]))
    assert torch.equal(_sorted_ids(got["block_indices"]), _sorted_ids(layout.shard(want["block_indices"], dim=1))), \
        f"{name}, rank {rank}: selections differ"
    close("sparse KL loss summed over ranks", _summed(got["kl"], group), want["kl"])
    close("dense KL loss summed over ranks", _summed(got["dense"], group), want["dense"])
    # The gather helper restores the whole pack on every rank.
    close("all_gather_tokens(out)", cp.all_gather_tokens(got["out"], layout, group), want["out"])
    gathered_ids = cp.all_gather_tokens(got["block_indices"], layout, group, dim=1)
    assert torch.equal(_sorted_ids(gathered_ids), _sorted_ids(want["block_indices"])), f"{name}: gathered selections"


def _check_gather_gradient(device, group=None):
    """all_gather_tokens's backward: each rank's rows get the sum over ranks of their gradients."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    layout = cp.load_balanced_layout([0, 7, 7, 20], world_size, rank, device=device)
    whole = torch.arange(20.0, dtype=torch.float64, device=device)[:, None]
    local = layout.shard(whole).requires_grad_()
    gathered = cp.all_gather_tokens(local, layout, group)
    torch.testing.assert_close(gathered, whole)
    (gathered * (rank + 1)).sum().backward()
    expected = torch.full_like(local, world_size * (world_size + 1) / 2)
    torch.testing.assert_close(local.grad, expected)


def _check_checkpointed_layer(lengths, device, dtype, tolerance):
    """Under activation checkpointing (the gathered K and V are not kept for the backward, and
    the recomputation gathers again) the gradients do not change."""
    rank = dist.get_rank()
    x = _pack(lengths, device, dtype, seed=1)
    layout = cp.load_balanced_layout(_cu(lengths), dist.get_world_size(), rank, device=device)
    local = _leaves({name: layout.shard(x[name]) for name in ("q", "k", "v", "index_q", "index_k")})
    grad_out, grad_lse = layout.shard(x["grad_out"]), layout.shard(x["grad_lse"])

    def layer_loss(q, k, v, index_q, index_k):
        out, lse = cp.msa_attention(q, k, v, index_q, index_k, layout, topk=TOPK, block_size=BLOCK, return_lse=True)
        return (out * grad_out).sum() + (lse * grad_lse).sum()

    inputs = [local[name] for name in ("q", "k", "v", "index_q", "index_k")]
    plain = torch.autograd.grad(layer_loss(*inputs), inputs[:3])
    checkpointed = torch.autograd.grad(torch.utils.checkpoint.checkpoint(layer_loss, *inputs, use_reentrant=False),
                                       inputs[:3])
    for what, a, b in zip(("dq", "dk", "dv"), checkpointed, plain):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance,
                                   msg=lambda m, what=what: f"checkpointed {what}: {m}")


def _check_bad_inputs(device):
    world_size, rank = dist.get_world_size(), dist.get_rank()
    other = cp.load_balanced_layout([0, 9], world_size, (rank + 1) % world_size, device=device)
    mine = cp.load_balanced_layout([0, 9], world_size, rank, device=device)
    x = _pack([9], device, torch.float64, 0)
    shards = [mine.shard(x[name]) for name in ("q", "k", "v", "index_q", "index_k")]
    if world_size > 1:
        with pytest.raises(ValueError, match=r"layout: expected a layout for rank"):
            cp.msa_attention(*shards, other, topk=TOPK, block_size=BLOCK)
    with pytest.raises(ValueError, match=r"k: expected this rank's"):
        cp.msa_attention(shards[0], x["k"], *shards[2:], mine, topk=TOPK, block_size=BLOCK)


def _worker(rank, world_size, init_file, device_type, dtype, tolerance, cases):
    if device_type == "cuda":
        torch.cuda.set_device(0)  # every rank shares the one GPU: gloo moves CUDA tensors through the host
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=120))
    try:
        device = torch.device(device_type)
        for name in cases:
            _check_case(name, PACKS[name], device, dtype, tolerance)
        _check_gather_gradient(device)
        _check_checkpointed_layer(PACKS["one-document"], device, dtype, tolerance)
        _check_bad_inputs(device)
        if world_size == 4:
            # Two independent context-parallel groups of 2 in one world: everything honours `group`.
            pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            group = pairs[rank // 2]
            _check_case("mixed, subgroup", PACKS["mixed"], device, dtype, tolerance, group=group, seed=rank // 2)
            _check_gather_gradient(device, group)
    finally:
        dist.destroy_process_group()


def _spawn(world_size, device_type="cpu", dtype=torch.float64, tolerance=1e-10, cases=tuple(PACKS)):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world_size, os.path.join(tmp, "rendezvous"), device_type, dtype, tolerance, cases),
                 nprocs=world_size, join=True)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_context_parallel_matches_one_process(world_size):
    _spawn(world_size)


@pytest.mark.cuda
def test_context_parallel_on_one_gpu_through_gloo():
    # NCCL refuses two ranks on one device; gloo takes CUDA tensors. fp32: the fast kernels serve it.
    _spawn(2, device_type="cuda", dtype=torch.float32, tolerance=2e-5, cases=("mixed", "one-document"))


def test_results_unpack_as_asked_in_a_one_rank_group(tmp_path):
    """`distributed.msa_attention` returns exactly the fields asked for, in order, as
    `torch_msa.msa_attention` does, with its values (one gloo rank in this process: no spawn)."""
    lengths = [70, 0, 2]  # two blocks, an empty document, a short one: small, for a quick check
    x = _pack(lengths, "cpu", torch.float64, seed=0)
    inputs = [x[name] for name in ("q", "k", "v", "index_q", "index_k")]
    cu = torch.tensor(_cu(lengths), dtype=torch.int32)
    layout = cp.load_balanced_layout(cu, 1, 0)
    want_out, want_lse, want_ids = torch_msa.msa_attention(*inputs, cu, cu, max(lengths), max(lengths), topk=TOPK,
                                                           block_size=BLOCK, return_lse=True, return_block_indices=True)
    call = functools.partial(cp.msa_attention, *(layout.shard(t) for t in inputs), layout, topk=TOPK, block_size=BLOCK)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        plain = call()
        out, lse = call(return_lse=True)
        out_too, block_indices = call(return_block_indices=True)
        both = call(return_lse=True, return_block_indices=True)
    finally:
        dist.destroy_process_group()
    assert type(plain) is torch.Tensor
    assert type(both) is torch_msa.MSALseBlocksOutput and len(both) == 3
    for got in (plain, out, out_too, both.out):
        torch.testing.assert_close(got, layout.shard(want_out), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, layout.shard(want_lse), rtol=1e-10, atol=1e-10)
    assert torch.equal(block_indices, both.block_indices) and torch.equal(lse, both.lse)
    assert torch.equal(_sorted_ids(block_indices), _sorted_ids(layout.shard(want_ids, dim=1)))


# Layout unit tests: no processes.

LAYOUT_PACKS = [[300, 0, 1, 5, 130, 77], [517], [1, 0, 2], [3] * 40, [0], [1000, 24, 7]]


def _layouts(lengths, world_size):
    return [cp.load_balanced_layout(_cu(lengths), world_size, rank) for rank in range(world_size)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("lengths", LAYOUT_PACKS, ids=str)
def test_every_token_is_owned_once_and_gathers_back(lengths, world_size):
    layouts = _layouts(lengths, world_size)
    total = sum(lengths)
    owned = torch.cat([layout.rows for layout in layouts])
    assert torch.equal(owned.sort().values, torch.arange(total))
    padded = max(layout.num_local_tokens for layout in layouts)
    for rank, layout in enumerate(layouts):
        assert layout.num_tokens == total and layout.padded_local_tokens == padded
        # gathered_rows maps each token to its slot in the rank-major gather.
        assert torch.equal(layout.gathered_rows[layout.rows], rank * padded + torch.arange(layout.num_local_tokens))
        assert torch.equal(layout.gathered_rows, layouts[0].gathered_rows)
        assert layout.cu_seqlens_k.tolist() == _cu(lengths)
        assert layout.max_seqlen_k == max(lengths)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("lengths", LAYOUT_PACKS, ids=str)
def test_fragments_name_the_positions_of_the_local_tokens(lengths, world_size):
    bounds = _cu(lengths)
    chunks = 2 * world_size
    chunk_of_document = [[None] * chunks for _ in lengths]
    for rank, layout in enumerate(_layouts(lengths, world_size)):
        cu_q = layout.cu_seqlens_q.tolist()
        documents, starts = layout.fragment_documents.tolist(), layout.fragment_starts.tolist()
        assert (layout.cu_seqlens_q.dtype == layout.fragment_documents.dtype == layout.fragment_starts.dtype
                == torch.int32)
        assert len(cu_q) == 2 * len(lengths) + 1 and cu_q[0] == 0 and cu_q[-1] == layout.num_local_tokens
        assert layout.max_seqlen_q == max((b - a for a, b in zip(cu_q, cu_q[1:])), default=0)
        for f, (document, start) in enumerate(zip(documents, starts)):
            assert document == f // 2
            size = cu_q[f + 1] - cu_q[f]
            assert start + size <= lengths[document]
            rows = layout.rows[cu_q[f]:cu_q[f + 1]]
            assert torch.equal(rows, bounds[document] + start + torch.arange(size)), (rank, f)
            assert torch.equal(layout.positions[cu_q[f]:cu_q[f + 1]], start + torch.arange(size)), (rank, f)
            # Fragment 2d is chunk `rank` of document d, fragment 2d + 1 chunk `chunks - 1 - rank`.
            chunk = rank if f % 2 == 0 else chunks - 1 - rank
            chunk_of_document[document][chunk] = (start, size)
    for document, length in enumerate(lengths):
        # The chunks tile the document in order.
        ends = [start + size for start, size in chunk_of_document[document]]
        assert [start for start, _ in chunk_of_document[document]] == [0, *ends[:-1]] and ends[-1] == length


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_chunks_and_work_are_balanced(world_size):
    lengths = [4099, 0, 1, 5, 1000, 77] + [3] * 50
    chunks = 2 * world_size
    layouts = _layouts(lengths, world_size)
    counts = [layout.num_local_tokens for layout in layouts]
    assert max(counts) - min(counts) <= 1, counts
    for document, length in enumerate(lengths):
        sizes = []
        for layout in layouts:
            cu_q = layout.cu_seqlens_q
            sizes += [int(cu_q[2 * document + 1] - cu_q[2 * document]),
                      int(cu_q[2 * document + 2] - cu_q[2 * document + 1])]
        assert sum(sizes) == length and max(sizes) - min(sizes) <= 1, (document, sizes)
        assert sum(size == 0 for size in sizes) == max(0, chunks - length)
    # Causal work: a query at position p scores p + 1 keys. The remainder tokens (one more or
    # less per chunk) leave about 2 x world_size / L of imbalance: 0.4% at L = 4099 over 8 ranks.
    work = []
    for layout in layouts:
        cu_q, starts = layout.cu_seqlens_q.tolist(), layout.fragment_starts.tolist()
        work.append(sum(sum(range(start + 1, start + cu_q[f + 1] - cu_q[f] + 1)) for f, start in enumerate(starts)))
    assert max(work) / min(work) < 1.01, work


def test_shard_takes_the_local_rows_along_a_dim():
    layout = cp.load_balanced_layout(torch.tensor(_cu([10, 3]), dtype=torch.int32), 2, 1)
    whole = torch.arange(2 * 13).view(2, 13)
    assert torch.equal(layout.shard(whole, dim=1), whole[:, layout.rows])
    with pytest.raises(ValueError, match=r"x: expected 13 tokens"):
        layout.shard(whole)


@pytest.mark.parametrize("args, error, message", [
    (([0, 5], 0, 0), ValueError, r"world_size: expected an int >= 1, got 0"),
    (([0, 5], 2, 2), ValueError, r"rank: expected an int in \[0, 2\), got 2"),
    (([0, 5], 2.0, 0), TypeError, r"world_size: expected an int, got float"),
    (([1, 5], 2, 0), ValueError, r"cu_seqlens: expected boundaries \[B \+ 1\] starting at 0"),
    (([0, 5, 3], 2, 0), ValueError, r"cu_seqlens: expected non-decreasing boundaries"),
    ((torch.tensor([0.0, 5.0]), 2, 0), TypeError, r"cu_seqlens: expected a 1-D integer tensor"),
    (("05", 2, 0), TypeError, r"cu_seqlens: expected a sequence of ints"),
])
def test_layout_rejects_bad_arguments(args, error, message):
    with pytest.raises(error, match=message):
        cp.load_balanced_layout(*args)


def test_the_example_outside_torchrun_says_how_to_start_it():
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).resolve().parents[2] / "examples" / "context_parallel.py"
    env = {name: value for name, value in os.environ.items() if name not in ("RANK", "WORLD_SIZE")}
    result = subprocess.run([sys.executable, str(script), "--device", "cpu"], capture_output=True, text=True,
                            timeout=120, env=env)
    assert result.returncode == 1
    assert "start it with torchrun" in result.stderr and "Traceback" not in result.stderr


def test_the_example_says_each_stage_when_it_starts():
    """On CPU rank 0 prints each stage before it runs, with the time it should take after the
    warm-up measured a step (one rank, a tiny pack: a few seconds)."""
    import pathlib
    import re
    import subprocess
    import sys

    script = pathlib.Path(__file__).resolve().parents[2] / "examples" / "context_parallel.py"
    # One rank, its store on a port the system picks.
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    result = subprocess.run([sys.executable, str(script), "--device", "cpu", "--tokens", "64", "--documents", "2"],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    patterns = [r"warm-up step on 1 rank: forward, backward and KL of 64 of 64 tokens each \.\.\.",
                r"timed step \(expected about \d+(\.\d)? s\) \.\.\.",
                r"rank 0/1 \(cpu, gloo, torch\.float32\): 64 of 64 tokens, step .* ms, .*",
                r"the whole pack in each process, for the comparison \(expected about \d+(\.\d)? s\) \.\.\.",
                r"rank 0: relative error against one process: out .*"]
    assert len(lines) == len(patterns), result.stdout
    for line, pattern in zip(lines, patterns):
        assert re.fullmatch(pattern, line), (line, pattern)
