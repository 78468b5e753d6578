"""The SM90 CuTe DSL forward against the reference, on a compute capability 9.0 GPU.

M3 shapes (Hq = 64, Hkv = 4, D = 128, block 128, top-16): a 1K document, a pack with empty and
one-token documents, an Lq < Lk pack, a 1M-token document on sampled rows, junk ids, a skewed
selection, NaN in one document, bf16 and fp16, query fragments, given plans of any item size,
the query-outer part (`TORCH_MSA_QUERY_OUTER=1`) on random, skewed, tiled and junk selections,
at 1 and 2 KV heads, in fp16, over query fragments, its rows that skip the combine,
batch invariance (a document alone and packed, bit for bit),
query windows (bounded partials), a 32K document (partials past 2**31 elements, against the
Triton forward), CUDA-graph replay, `torch.compile(fullgraph=True)`, `torch.library.opcheck` and
dispatch through `torch.ops.msa.forward`. Skipped without such a GPU or the CuTe DSL.
"""

import math

import pytest
import torch

from benchmarks.problems import tile_shared
from tests.support.documents import Documents, backend_arguments, documents_of
from tests.support.sm90 import (
    BLOCK,
    HKV,
    HQ,
    REFERENCE_LAYOUTS,
    SCALE,
    SM90_KERNEL_MARKS,
    TOPK,
    D,
    random_problem,
    with_junk_ids,
)
from torch_msa import reference
from torch_msa.settings import QUERY_OUTER_ENV
from torch_msa.testing import fragments, random_block_indices

pytestmark = SM90_KERNEL_MARKS
_inputs = random_problem


def _sm90(q, k, v, blocks, cu_q, cu_k, max_q, max_k):
    from torch_msa.sm90.forward_host import forward

    return forward(*backend_arguments("forward", q, k, v, blocks, cu_q, cu_k, max_q, max_k, BLOCK, SCALE))


def _check(got, want, rows=None):
    out, lse = got
    want_out, want_lse = want
    if rows is not None:
        out, lse, want_out, want_lse = out[rows], lse[rows], want_out[rows], want_lse[rows]
    assert out.dtype == want_out.dtype and lse.dtype == torch.float32
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    error = (out.float() - want_out.float()).norm() / want_out.float().norm().clamp(min=1e-6)
    # P enters the tensor cores rounded to 16 bits: errors of about 2^-8 relative; a key block
    # missed or counted twice moves the output by percents.
    assert error < 1e-2, f"relative error {error:.2e}"
    torch.testing.assert_close(lse, want_lse.float(), atol=2e-3, rtol=1e-4)


def _reference(q, k, v, blocks, cu_q, cu_k, max_q, max_k):
    out, lse = reference.forward(q.float(), k.float(), v.float(), blocks, Documents(cu_q, cu_k, max_q, max_k), BLOCK, SCALE)
    return out.to(q.dtype), lse


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@REFERENCE_LAYOUTS
def test_matches_reference(q_lens, k_lens, dtype):
    inputs = _inputs(q_lens, k_lens, dtype)
    _check(_sm90(*inputs), _reference(*inputs))


def test_skewed_selection_splits_hot_blocks():
    """Every query reads block 0: its bucket is split over many items (and CTAs)."""
    inputs = _inputs([3000, 2100], [3000, 2100], torch.bfloat16, selection="skewed")
    _check(_sm90(*inputs), _reference(*inputs))


def test_junk_ids_are_ignored():
    """Negative, beyond-horizon, huge and repeated ids add nothing and read nothing out of bounds."""
    q, k, v, blocks, cu_q, cu_k, max_q, max_k = _inputs([700, 513], [700, 513], torch.bfloat16)
    blocks = with_junk_ids(blocks)
    inputs = (q, k, v, blocks, cu_q, cu_k, max_q, max_k)
    _check(_sm90(*inputs), _reference(*inputs))


def test_nan_in_one_document_stays_there():
    """Documents whose last key block runs into a NaN document's keys stay finite and exact."""
    lens = [200, 300, 333]
    q, k, v, blocks, cu_q, cu_k, max_q, max_k = _inputs(lens, lens, torch.bfloat16)
    want = _reference(q, k, v, blocks, cu_q, cu_k, max_q, max_k)
    for x in (q, k, v):
        x[200:500] = math.nan
    out, lse = _sm90(q, k, v, blocks, cu_q, cu_k, max_q, max_k)
    clean = torch.cat([torch.arange(0, 200), torch.arange(500, 833)]).cuda()
    _check((out, lse), want, rows=clean)
    assert torch.isnan(out[200:500]).all()


def test_sm90_serves_forward_by_default(monkeypatch):
    import torch_msa

    cuda = torch.device("cuda")
    monkeypatch.delenv(torch_msa.BACKEND_ENV, raising=False)
    assert torch_msa.resolve("forward", cuda).name == "sm90"
    inputs = _inputs([1500], [1500], torch.bfloat16, seed=3)
    got = torch.ops.msa.forward(*inputs, BLOCK, SCALE)
    _check(got, _reference(*inputs))


def test_unsupported_configuration_falls_back():
    from torch_msa.backends import UnsupportedInputs
    from torch_msa.sm90.common import check_served

    q = torch.zeros(4, 32, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.zeros(4, 4, 128, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(UnsupportedInputs, match="16 query heads per KV head"):
        check_served(q, k, k, 128)
    with pytest.raises(UnsupportedInputs, match="bf16 or all fp16"):
        check_served(q.float(), k.float(), k.float(), 128)


def test_cuda_graph_replay_matches_eager():
    """No host sync: the schedule, the blocks kernel and the combine replay from a CUDA graph."""
    inputs = _inputs([900, 400], [900, 400], torch.bfloat16, seed=4)
    eager = _sm90(*inputs)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _sm90(*inputs)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured[0], eager[0], atol=0, rtol=0)
    torch.testing.assert_close(captured[1], eager[1], atol=0, rtol=0)


def test_long_document_past_32_bit_element_offsets():
    """32K queries: the partials hold 2**32 elements, written by TMA. The reference would gather
    too much at this size, so the Triton forward (checked against it elsewhere) is the oracle."""
    from torch_msa.triton.forward import forward as triton_forward

    inputs = _inputs([32768], [32768], torch.bfloat16, seed=6)
    _check(_sm90(*inputs), triton_forward(*backend_arguments("forward", *inputs, BLOCK, SCALE)))


def test_a_million_token_document_on_sampled_rows():
    """One 1M-token document through the backend's forward (query windows bound the partials; an
    index-branch selection, since a random one would need a 1M x 8192 draw): 48 rows spread over
    the document, every KV head, against a float64 gather of the keys their blocks select. Its 37
    GiB go back to the device before the checks, so that the tests sharing the GPU keep theirs."""
    try:
        sampled = _million_token_rows()
    finally:
        torch.cuda.empty_cache()
    for token, head, out, want_out, lse, want_lse in sampled:
        error = (out - want_out).norm() / want_out.norm()
        assert error < 1e-2, (token, head, error.item())
        torch.testing.assert_close(lse, want_lse, atol=2e-3, rtol=1e-4)


def _million_token_rows():
    """`(token, KV head, out, reference out, lse, reference lse)` (float64, that head's 16 query
    heads) of the 1M-token test's sampled rows; the inputs die with this call."""
    import torch_msa
    from torch_msa.sm90 import interface as sm90_interface

    num_tokens = 1 << 20
    generator = torch.Generator(device="cuda").manual_seed(9)

    def tensor(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=generator)

    q, k, v = tensor(num_tokens, HQ, D), tensor(num_tokens, HKV, D), tensor(num_tokens, HKV, D)
    cu = torch.tensor([0, num_tokens], dtype=torch.int32, device="cuda")
    blocks = torch_msa.select_blocks(tensor(num_tokens, HKV, 128), tensor(num_tokens, 1, 128), cu, cu,
                                     num_tokens, num_tokens, topk=TOPK, block_size=BLOCK)
    out, lse = sm90_interface.forward(*backend_arguments("forward", q, k, v, blocks, cu, cu, num_tokens, num_tokens, BLOCK,
                                               SCALE))
    sampled = []
    for token in torch.linspace(0, num_tokens - 1, 48).round().long().tolist():
        for head in range(HKV):
            ids = sorted({b for b in blocks[head, token].tolist() if 0 <= b <= token // BLOCK})
            keys = torch.cat([torch.arange(b * BLOCK, min(b * BLOCK + BLOCK, token + 1)) for b in ids]).cuda()
            heads = slice(head * (HQ // HKV), (head + 1) * (HQ // HKV))
            scores = SCALE * q[token, heads].double() @ k[keys, head].double().T
            sampled.append((token, head, out[token, heads].double(), torch.softmax(scores, dim=-1) @ v[keys, head].double(),
                            lse[token, heads].double(), torch.logsumexp(scores, dim=-1)))
    return sampled


def test_query_windows_bound_the_partials_and_equal_one_call(monkeypatch):
    """The backend's forward over windows of 1000 queries (a pack with empty and one-token
    documents and a 3000-token one) equals one kernel call over all queries, and its memory above
    the inputs is the output plus one window's partials, not the 4096 queries' partials."""
    from torch_msa import query_windows
    from torch_msa.sm90 import interface as sm90_interface

    inputs = _inputs([0, 1, 3000, 0, 1094, 1], [0, 1, 3000, 0, 1094, 1], torch.bfloat16, seed=8)
    one_call = _sm90(*inputs)
    window = 1000
    per_query = query_windows.partial_bytes_per_query(HQ, TOPK, D, torch.bfloat16)
    monkeypatch.setattr(query_windows, "PARTIAL_BYTES", window * per_query)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    got = sm90_interface.forward(*backend_arguments("forward", *inputs, BLOCK, SCALE))
    torch.cuda.synchronize()
    above_inputs = torch.cuda.max_memory_allocated() - before
    torch.testing.assert_close(got[0], one_call[0], atol=0, rtol=0)
    torch.testing.assert_close(got[1], one_call[1], atol=0, rtol=0)
    num_queries = inputs[0].shape[0]
    outputs = num_queries * HQ * (D * 2 + 4)
    assert num_queries * per_query > outputs + 3 * window * per_query
    assert above_inputs < outputs + 2 * window * per_query + (64 << 20), above_inputs


@pytest.mark.parametrize("given_plan", [False, True], ids=["own-plan", "given-plan"])
@pytest.mark.parametrize("selection", ["random", "skewed", "tiled", "junk"])
@REFERENCE_LAYOUTS
def test_the_query_outer_part_matches_reference(q_lens, k_lens, selection, given_plan, monkeypatch):
    """`TORCH_MSA_QUERY_OUTER=1`: the kernel walks the KV-outer part's selection (in a plan of its
    own, or in the given plan restricted to it) and the query-outer stage writes the partials of the
    blocks the query groups share."""
    import torch_msa
    from torch_msa.sm90 import interface as sm90_interface
    from torch_msa.stages import query_outer

    q, k, v, blocks, cu_q, cu_k, max_q, max_k = _inputs(q_lens, k_lens, torch.bfloat16,
                                                        selection="skewed" if selection == "skewed" else "random")
    if selection == "tiled":
        blocks = tile_shared(blocks, cu_q, BLOCK)
    if selection == "junk":
        blocks = with_junk_ids(blocks)
    inputs = (q, k, v, blocks, cu_q, cu_k, max_q, max_k)
    plan = (torch_msa.build_plan(blocks, cu_q, cu_k, max_q, max_k, num_keys=k.shape[0], num_heads=HQ, block_size=BLOCK)
            if given_plan else None)
    args = backend_arguments("forward", *inputs, BLOCK, SCALE, plan)
    monkeypatch.setenv(QUERY_OUTER_ENV, "1")
    kv_outer = query_outer.split_forward(q, blocks, args[4], k.shape[0], BLOCK, None)[0]
    assert ((kv_outer < 0) & (blocks >= 0)).any()
    _check(sm90_interface.forward(*args), _reference(*inputs))


@pytest.mark.parametrize("kv_heads, dtype", [(1, torch.float16), (2, torch.bfloat16)], ids=["hkv1-fp16", "hkv2-bf16"])
def test_the_query_outer_part_at_other_head_counts(kv_heads, dtype, monkeypatch):
    """The groups kernel compiled for 1 and 2 KV heads (16 query heads each), fp16 and bf16, on a
    pack whose first document shares its selection per 128-query tile and whose others are random."""
    from torch_msa.sm90 import interface as sm90_interface

    lens = [700, 1, 600]
    q, k, v, blocks, cu_q, cu_k, max_q, max_k = _inputs(lens, lens, dtype, seed=6, kv_heads=kv_heads)
    shared = torch.arange(sum(lens), device="cuda").view(1, -1, 1) < lens[0]
    blocks = torch.where(shared, tile_shared(blocks, cu_q, BLOCK), blocks)
    inputs = (q, k, v, blocks, cu_q, cu_k, max_q, max_k)
    monkeypatch.setenv(QUERY_OUTER_ENV, "1")
    _check(sm90_interface.forward(*backend_arguments("forward", *inputs, BLOCK, SCALE)), _reference(*inputs))


def test_the_query_outer_part_keeps_nan_in_its_document(monkeypatch):
    """With `TORCH_MSA_QUERY_OUTER=1` on tile-shared selections, documents whose blocks run into a
    NaN document's keys stay finite and exact."""
    from torch_msa.sm90 import interface as sm90_interface

    lens = [200, 300, 333]
    q, k, v, blocks, cu_q, cu_k, max_q, max_k = _inputs(lens, lens, torch.bfloat16)
    blocks = tile_shared(blocks, cu_q, BLOCK)
    want = _reference(q, k, v, blocks, cu_q, cu_k, max_q, max_k)
    for x in (q, k, v):
        x[200:500] = math.nan
    monkeypatch.setenv(QUERY_OUTER_ENV, "1")
    out, lse = sm90_interface.forward(*backend_arguments("forward", q, k, v, blocks, cu_q, cu_k, max_q, max_k, BLOCK,
                                                         SCALE))
    clean = torch.cat([torch.arange(0, 200), torch.arange(500, 833)]).cuda()
    _check((out, lse), want, rows=clean)
    assert torch.isnan(out[200:500]).all()


@pytest.mark.parametrize("given_plan", [False, True], ids=["own-plan", "given-plan"])
def test_the_query_outer_part_over_query_windows_that_cut_groups(given_plan, monkeypatch):
    """Windows of 1001 queries cut 8-query groups (a pack with empty and one-token documents): the
    query-outer forward still matches the reference, its windows walking one plan of the KV-outer
    part, or the given plan restricted to it by the first window."""
    import torch_msa
    from torch_msa import query_windows
    from torch_msa.sm90 import interface as sm90_interface

    lens = [0, 1, 3000, 0, 1094, 1]
    q, k, v, blocks, cu_q, cu_k, max_q, max_k = _inputs(lens, lens, torch.bfloat16, seed=8)
    blocks = tile_shared(blocks, cu_q, BLOCK)
    inputs = (q, k, v, blocks, cu_q, cu_k, max_q, max_k)
    plan = (torch_msa.build_plan(blocks, cu_q, cu_k, max_q, max_k, num_keys=k.shape[0], num_heads=HQ, block_size=BLOCK)
            if given_plan else None)
    monkeypatch.setattr(query_windows, "PARTIAL_BYTES",
                        1001 * query_windows.partial_bytes_per_query(HQ, TOPK, D, torch.bfloat16))
    monkeypatch.setenv(QUERY_OUTER_ENV, "1")
    _check(sm90_interface.forward(*backend_arguments("forward", *inputs, BLOCK, SCALE, plan)), _reference(*inputs))


def test_rows_the_kv_outer_part_leaves_empty_skip_the_combine(monkeypatch):
    """The groups kernel writes straight into the output, and flags for the combine to skip,
    exactly the (query, KV head) rows that see a listed block and no entry of the KV-outer part:
    a pack of a tile-shared document (most rows) and a random one (some rows, as in a pack with
    junk ids). Every row still matches the reference."""
    from torch_msa.plan.schedule import valid_entries
    from torch_msa.sm90 import forward_host
    from torch_msa.sm90 import interface as sm90_interface

    lens = [1100, 900]
    q, k, v, random_blocks, cu_q, cu_k, max_q, max_k = _inputs(lens, lens, torch.bfloat16, seed=5)
    tiled = tile_shared(random_blocks, cu_q, BLOCK)
    blocks = torch.where(torch.arange(sum(lens), device="cuda").view(1, -1, 1) < lens[0], tiled, with_junk_ids(random_blocks))
    inputs = (q, k, v, blocks, cu_q, cu_k, max_q, max_k)
    flags = []

    def combine(*args):
        flags.append(args[-1].clone())
        return real_combine(*args)

    real_combine = forward_host.combine
    monkeypatch.setattr(forward_host, "combine", combine)
    monkeypatch.setenv(QUERY_OUTER_ENV, "1")
    args = backend_arguments("forward", *inputs, BLOCK, SCALE)
    got = sm90_interface.forward(*args)
    _check(got, _reference(*inputs))

    from torch_msa.stages import query_outer

    kv_outer = query_outer.split_forward(q, blocks, args[4], k.shape[0], BLOCK, None)[0]
    valid = valid_entries(blocks, args[4].locate(q.shape[0], k.shape[0]).position, BLOCK)
    expected = ((valid & (kv_outer < 0)).any(-1) & ~(valid & (kv_outer >= 0)).any(-1)).T  # [Tq, Hkv]
    (done,) = flags
    assert torch.equal(done.view(-1, HKV) > 0, expected)
    assert expected[:lens[0]].float().mean() > 0.9 and 0 < expected[lens[0]:].sum() < expected[lens[0]:].numel()


@pytest.mark.parametrize("setting", ["0", "1", "auto"], ids=["kv-outer", "query-outer", "default"])
def test_a_documents_output_is_bitwise_the_same_alone_and_packed(setting, monkeypatch):
    """Batch invariance: each document of a pack gets, bit for bit, the output and lse it gets
    alone, without and with the query-outer part (on a selection shared by 128-query tiles), and by
    default, where a document's own length decides: on a GPU the default was measured on, the
    8300-query one runs its groups query-outer as the setting `1` would, the shorter ones none, as
    `0` would; on another, none does."""
    from torch_msa.sm90 import interface as sm90_interface
    from torch_msa.sm90.common import runs_query_outer_by_default

    lens = [8300, 700, 1500] if setting == "auto" else [700, 1500, 129, 1000]
    q, k, v, blocks, cu_q, cu_k, max_q, max_k = _inputs(lens, lens, torch.bfloat16, seed=3)
    if setting != "0":
        blocks = tile_shared(blocks, cu_q, BLOCK)

    def forward(setting, start=0, end=None):
        monkeypatch.setenv(QUERY_OUTER_ENV, setting)
        if end is None:
            return sm90_interface.forward(*backend_arguments("forward", q, k, v, blocks, cu_q, cu_k, max_q, max_k,
                                                             BLOCK, SCALE))
        cu = torch.tensor([0, end - start], dtype=torch.int32, device="cuda")
        return sm90_interface.forward(*backend_arguments("forward", q[start:end], k[start:end], v[start:end],
                                                         blocks[:, start:end].contiguous(), cu, cu, end - start,
                                                         end - start, BLOCK, SCALE))

    packed = forward(setting)
    for start, end in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        alone = forward(setting, start, end)
        assert torch.equal(alone[0], packed[0][start:end]), (start, end)
        assert torch.equal(alone[1], packed[1][start:end]), (start, end)
    if setting == "auto":
        on, off = forward("1"), forward("0")
        long = slice(0, lens[0])
        assert not torch.equal(on[0][long], off[0][long]), "the two parts round differently"
        expected = on if runs_query_outer_by_default(q.device) else off
        assert torch.equal(packed[0][long], expected[0][long]) and torch.equal(packed[1][long], expected[1][long])
        assert torch.equal(packed[0][lens[0]:], off[0][lens[0]:]) and torch.equal(packed[1][lens[0]:], off[1][lens[0]:])


@pytest.mark.parametrize("entries", [None, 7, 128])
def test_given_plans_of_any_item_size(entries):
    """The kernel walks the items of the plan it is given, whatever their size."""
    from torch_msa.plan import kernels as plan_kernel
    from torch_msa.sm90.forward_host import forward

    q, k, v, blocks, cu_q, cu_k, max_q, max_k = _inputs([1000, 1500], [1000, 1500], torch.bfloat16, seed=7)
    plan = None if entries is None else plan_kernel.plan(blocks, documents_of(cu_q, cu_k), k.shape[0], BLOCK, entries)
    got = forward(*backend_arguments("forward", q, k, v, blocks, cu_q, cu_k, max_q, max_k, BLOCK, SCALE, plan))
    _check(got, _reference(q, k, v, blocks, cu_q, cu_k, max_q, max_k))


@pytest.mark.parametrize("query_outer", [False, True], ids=["default", "query-outer"])
def test_fragments_match_reference(query_outer, monkeypatch):
    """A context-parallel rank's share: two chunks of a 4K document, the middle of a 2K one and a
    1-token document, as query fragments over the whole documents' keys. With the query-outer
    part, on selections shared per 128-query tile of each fragment: groups stay inside their
    fragment, and a tile's blocks past an early query's position are masked for it."""
    from torch_msa.sm90 import interface as sm90_interface

    frag = fragments((4096, 2048, 1), ((0, 0, 1024), (0, 3072, 1024), (1, 500, 700), (2, 0, 1)), "cuda")
    generator = torch.Generator().manual_seed(8)
    tq, tk = int(frag.cu_seqlens_q[-1]), int(frag.cu_seqlens_k[-1])

    def tensor(*shape):
        return torch.randn(*shape, generator=generator).to("cuda", torch.bfloat16)

    q, k, v = tensor(tq, HQ, D), tensor(tk, HKV, D), tensor(tk, HKV, D)
    blocks = random_block_indices(frag.cu_seqlens_q, frag.cu_seqlens_k, HKV, TOPK, BLOCK, generator,
                                  *frag.tensors).cuda()
    if query_outer:
        blocks = tile_shared(blocks, frag.cu_seqlens_q, BLOCK)
        monkeypatch.setenv(QUERY_OUTER_ENV, "1")
    args = (blocks, *frag.op_args, BLOCK, SCALE)
    got = sm90_interface.forward(*backend_arguments("forward", q, k, v, *args, None, *frag.tensors))
    want_out, want_lse = reference.forward(*backend_arguments("forward", q.float(), k.float(), v.float(), *args, None,
                                                              *frag.tensors))
    _check(got, (want_out.to(q.dtype), want_lse))


def test_compiles_into_one_graph(monkeypatch):
    import torch_msa

    monkeypatch.setenv(torch_msa.BACKEND_ENV, "sm90")
    inputs = _inputs([1200, 800], [1200, 800], torch.bfloat16, seed=9)

    def attend(q, k, v, blocks, cu_q, cu_k):
        return torch.ops.msa.forward(q, k, v, blocks, cu_q, cu_k, 1200, 1200, BLOCK, SCALE)

    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True)
    got = compiled(*inputs[:6])
    _check(got, _reference(*inputs))


def test_the_query_outer_part_replays_from_a_cuda_graph_and_compiles(monkeypatch):
    """With `TORCH_MSA_QUERY_OUTER=1` the groups, the KV-outer part's plan and both kernels replay
    from a CUDA graph bit for bit, and a `torch.compile(fullgraph=True)` call gets the same output."""
    import torch_msa

    monkeypatch.setenv(torch_msa.BACKEND_ENV, "sm90")
    monkeypatch.setenv(QUERY_OUTER_ENV, "1")
    q, k, v, blocks, cu_q, cu_k, max_q, max_k = _inputs([900, 400], [900, 400], torch.bfloat16, seed=4)
    blocks = tile_shared(blocks, cu_q, BLOCK)

    def attend(q, k, v, blocks, cu_q, cu_k):
        return torch.ops.msa.forward(q, k, v, blocks, cu_q, cu_k, max_q, max_k, BLOCK, SCALE)

    eager = attend(q, k, v, blocks, cu_q, cu_k)  # compiles the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = attend(q, k, v, blocks, cu_q, cu_k)
    graph.replay()
    torch.cuda.synchronize()
    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True)(q, k, v, blocks, cu_q, cu_k)
    for got in (captured, compiled):
        torch.testing.assert_close(got[0], eager[0], atol=0, rtol=0)
        torch.testing.assert_close(got[1], eager[1], atol=0, rtol=0)
    _check(eager, _reference(q, k, v, blocks, cu_q, cu_k, max_q, max_k))


def test_opcheck_through_the_sm90_kernel(monkeypatch):
    """Schema, fake kernel (shapes and strides) and AOT dispatch agree with the kernel's outputs."""
    import torch_msa

    monkeypatch.setenv(torch_msa.BACKEND_ENV, "sm90")
    q, k, v, blocks, cu_q, cu_k, max_q, max_k = _inputs([300, 1, 200], [300, 1, 200], torch.bfloat16, seed=10)
    torch.library.opcheck(torch.ops.msa.forward.default, (q, k, v, blocks, cu_q, cu_k, max_q, max_k, BLOCK, SCALE))
