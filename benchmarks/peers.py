"""The peers torch_msa is measured against, on the same inputs and block indices.

* Dense causal attention through `F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`
  forced to one backend: cuDNN (FA3-class on Hopper) and flash (FA2-class) on CUDA, math on CPU.
  A varlen pack of equal documents runs as one batch; unequal documents run one call each.
* fla's `parallel_nsa` selection branch (`ParallelNSAFunction`, package `fla-core`, Triton), fed
  our block indices as `[1, T, Hkv, topk]` int64; its compression branch is not run.
* FlexAttention with the exact MSA mask, heads folded into the query axis (`flex_mask.py`),
  compiled on CUDA; on CPU it runs eagerly and forward only (FlexAttention has no CPU backward).
* cuDNN frontend's block-sparse attention (`cudnn.block_sparse_attention`, package
  `nvidia-cudnn-frontend` >= 1.32, CuTe DSL kernels for SM90-SM120) on tile-shared selections
  (`--selection tiled`), the only ones it expresses: one list of key blocks per 128-query tile
  and query head. It attends non-causally inside a block, so on the tile's own block it computes
  the masked half too (about 3% more pairs at top-16); its rate counts MSA's FLOPs. The blk128
  kernels run forward and backward; the blk64 forward (each 128-key block as two of 64) is timed
  too. Its backward serves one KV head per query head only, so K/V are expanded to Hq heads
  first, and its dK/dV are per query head (the sum over a KV head's group is not timed).

Backward phases reuse one forward's autograd graph (`retain_graph=True`), so only the backward
is timed. Layout copies (folding heads for FlexAttention, transposing the indices for fla) are
made once, before timing.
"""

import functools
import importlib.metadata
import warnings

import torch
import torch.nn.functional as F

from .flex_mask import TILE_ROWS, fold_query_heads, kv_heads_first, msa_block_mask
from .problems import Inputs
from .results import SYNCED_DENSE
from .subject import Measurement, Subject
from .timing import is_out_of_memory

DENSE_PHASES = ("fwd", "bwd")
FLEX_PHASES = ("mask", "fwd", "bwd")
DENSE_BACKENDS = ("cudnn", "flash", "math")
FLA_INSTALL = "pip install fla-core"
BSA_INSTALL = "pip install 'nvidia-cudnn-frontend>=1.32' 'nvidia-cutlass-dsl>=4.6.2'"
BSA_PHASES = {128: ("fwd", "bwd"), 64: ("fwd",)}


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}[name]


def _heads_first(x: torch.Tensor, lengths: tuple[int, ...]) -> list[torch.Tensor]:
    """`[T, H, D]` -> views `[B, H, L, D]`: one batch of equal documents, else one view per document."""
    if len(set(lengths)) == 1:
        return [x.view(len(lengths), lengths[0], *x.shape[1:]).transpose(1, 2)]
    views, start = [], 0
    for length in lengths:
        views.append(x[start:start + length].unsqueeze(0).transpose(1, 2))
        start += length
    return views


def dense_subject(inputs: Inputs, backend: str) -> Subject:
    """Dense causal SDPA on one forced backend (`cudnn`, `flash` or `math`)."""
    if backend not in DENSE_BACKENDS:
        raise ValueError(f"backend: expected one of {DENSE_BACKENDS}, got {backend!r}")
    impl = f"{backend} dense"
    if backend != "math" and inputs.q.device.type != "cuda":
        return Subject(impl, DENSE_PHASES, skip_reason=f"the {backend} SDPA backend needs CUDA")

    def measurements():
        from torch.nn.attention import sdpa_kernel

        lengths, work = inputs.spec.lengths, inputs.work
        sdpa_backend = _sdpa_backend(backend)
        q, k, v = (x.detach().requires_grad_() for x in (inputs.q, inputs.k, inputs.v))

        def forward(keys, values, gqa):
            with sdpa_kernel(sdpa_backend):
                return [F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa)
                        for qs, ks, vs in zip(_heads_first(q, lengths), _heads_first(keys, lengths),
                                              _heads_first(values, lengths))]

        gqa, note = True, ""
        try:
            forward(k, v, True)
        except RuntimeError as error:
            if is_out_of_memory(error):
                raise
            # The backend refuses grouped-query inputs: give it K/V with one head per query head.
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            gqa, note = False, f"enable_gqa refused ({reason[:80]}): K/V repeated to Hq heads before timing"
        if not gqa:
            group = inputs.shape.group
            k, v = (x.detach().repeat_interleave(group, dim=1).requires_grad_() for x in (inputs.k, inputs.v))
        yield Measurement("fwd", lambda: forward(k, v, gqa), work.dense_forward, note)
        graph = {"outputs": forward(k, v, gqa)}
        grads = _heads_first(inputs.grad_out, lengths)
        yield Measurement("bwd", lambda: torch.autograd.grad(graph["outputs"], (q, k, v), grads, retain_graph=True),
                          work.dense_backward, note)
        graph.clear()  # the forward's graph is not needed past here
        if q.device.type == "cuda":
            yield Measurement(SYNCED_DENSE, lambda: torch.autograd.grad(forward(k, v, gqa), (q, k, v), grads),
                              work.dense_forward + work.dense_backward, note, synchronised=True)

    return Subject(impl, DENSE_PHASES + (SYNCED_DENSE,) if inputs.q.device.type == "cuda" else DENSE_PHASES,
                   measurements)


def fla_version() -> str | None:
    try:
        return importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def fla_subject(inputs: Inputs) -> Subject:
    """fla `parallel_nsa`'s selected-block attention with our indices (CUDA, `fla-core`)."""
    impl = "fla parallel_nsa"
    if inputs.q.device.type != "cuda":
        return Subject(impl, DENSE_PHASES, skip_reason="fla's Triton kernels need CUDA")
    try:
        from fla.ops.nsa.parallel import ParallelNSAFunction
    except Exception as error:  # noqa: BLE001  (absent, or broken against this torch/triton: skip the peer)
        return Subject(impl, DENSE_PHASES, skip_reason=f"fla-core not importable ({type(error).__name__}: {error}); "
                                                       f"{FLA_INSTALL}")

    def measurements():
        shape, work = inputs.shape, inputs.work
        q, k, v = (x.detach().unsqueeze(0).requires_grad_() for x in (inputs.q, inputs.k, inputs.v))
        # fla wants [B, T, Hkv, S] int64 and skips ids < 0; documents as int64 cu_seqlens.
        indices = inputs.block_indices.permute(1, 0, 2).unsqueeze(0).to(torch.int64).contiguous()
        cu_seqlens = inputs.cu_seqlens.to(torch.int64) if inputs.spec.pack else None
        scale = shape.head_dim ** -0.5

        def forward():
            return ParallelNSAFunction.apply(q, k, v, indices, shape.topk, shape.block_size, scale, cu_seqlens)

        yield Measurement("fwd", forward, work.msa_forward)
        out = forward()
        grad_out = inputs.grad_out.unsqueeze(0)
        yield Measurement("bwd", lambda: torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True),
                          work.msa_backward)

    return Subject(impl, DENSE_PHASES, measurements)


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_subject(inputs: Inputs) -> Subject:
    """FlexAttention with the exact MSA mask, heads folded into the query axis."""
    impl = "FlexAttention"
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except Exception as error:  # noqa: BLE001  (older torch)
        return Subject(impl, FLEX_PHASES, skip_reason=f"torch.nn.attention.flex_attention unavailable ({error})")
    shape = inputs.shape
    if TILE_ROWS % shape.group:
        return Subject(impl, FLEX_PHASES,
                       skip_reason=f"the folded layout needs Hq / Hkv dividing {TILE_ROWS}, got {shape.group}")
    on_cuda = inputs.q.device.type == "cuda"

    def measurements():
        work, tokens = inputs.work, inputs.spec.tokens

        def build():
            return msa_block_mask(inputs.block_indices, inputs.key_start, inputs.position, tokens,
                                  shape.group, shape.block_size)

        yield Measurement("mask", build, None, "built from the block indices (no dense mask evaluation)")
        block_mask, stats = build()
        note = stats.describe() + ("" if on_cuda else "; eager (not compiled) on CPU")
        q = fold_query_heads(inputs.q, shape.kv_heads)
        k, v = kv_heads_first(inputs.k), kv_heads_first(inputs.v)
        if on_cuda:
            q, k, v = (x.requires_grad_() for x in (q, k, v))
        attend = _compiled_flex_attention() if on_cuda else flex_attention
        scale = shape.head_dim ** -0.5

        def forward():
            with warnings.catch_warnings():
                # Eager FlexAttention on CPU warns that it is not compiled; the row's note says so.
                warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
                return attend(q, k, v, block_mask=block_mask, scale=scale)

        yield Measurement("fwd", forward, work.msa_forward, note)
        if not on_cuda:
            yield Measurement("bwd", None, None, f"FlexAttention has no CPU backward (torch {torch.__version__})")
            return
        out = forward()
        grad_out = fold_query_heads(inputs.grad_out, shape.kv_heads)
        yield Measurement("bwd", lambda: torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True),
                          work.msa_backward, note)

    return Subject(impl, FLEX_PHASES, measurements)


def _bsa_block_lists(inputs: Inputs, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """BSA's metadata of the problem's tile-shared selection at BSA block size `block` (128, or
    64 with each key block split in two): int32 `[B, Hq, L / block, 2 * topk or topk]` key block
    ids per query tile and head, ascending, the slots past the tile's count holding 0, and the
    counts `[B, Hq, L / block]`."""
    shape, lengths = inputs.shape, inputs.spec.lengths
    batch, length = len(lengths), lengths[0]
    tile_last = torch.arange(shape.block_size - 1, length + shape.block_size - 1, shape.block_size,
                             device=inputs.q.device).clamp(max=length - 1)
    starts = torch.tensor([0, *lengths[:-1]], device=inputs.q.device).cumsum(0)
    rows = inputs.block_indices[:, (starts[:, None] + tile_last[None, :]).flatten()]  # [Hkv, B * tiles, topk]
    rows = rows.view(shape.kv_heads, batch, -1, shape.topk)
    # Ascending, the unused slots (-1) last.
    unused = torch.iinfo(torch.int32).max
    rows = torch.where(rows < 0, unused, rows).sort(dim=-1).values
    counts = (rows != unused).sum(-1, dtype=torch.int32)
    if block != shape.block_size:
        split = shape.block_size // block
        rows = torch.where(rows[..., None] == unused, unused, rows[..., None] * split + torch.arange(split, device=rows.device))
        rows = rows.flatten(-2).repeat_interleave(split, dim=2)[:, :, : length // block]
        counts = counts.repeat_interleave(split, dim=2)[:, :, : length // block] * split
    rows = torch.where(rows == unused, 0, rows)
    # One list per query head: the heads of a KV head share its selection.
    rows = rows.repeat_interleave(shape.group, dim=0).permute(1, 0, 2, 3).contiguous()
    return rows.to(torch.int32), counts.repeat_interleave(shape.group, dim=0).permute(1, 0, 2).contiguous()


def bsa_subject(inputs: Inputs, block: int = 128) -> Subject:
    """cuDNN frontend's block-sparse attention at BSA block size `block` (128 or 64) on the
    problem's tile-shared selection (CUDA, SM90-SM120, `nvidia-cudnn-frontend`)."""
    impl, phases = f"cuDNN BSA blk{block}", BSA_PHASES[block]
    shape, lengths = inputs.shape, inputs.spec.lengths
    if inputs.q.device.type != "cuda":
        return Subject(impl, phases, skip_reason="cuDNN's block-sparse attention needs CUDA")
    if inputs.selection != "tiled":
        return Subject(impl, phases, skip_reason="it takes one selection per 128-query tile: run with --selection tiled")
    if len(set(lengths)) != 1 or lengths[0] % shape.block_size:
        return Subject(impl, phases, skip_reason=f"it runs equal documents of a multiple of {shape.block_size} tokens "
                                                 f"as one batch; got {lengths[:4]}{'...' if len(lengths) > 4 else ''}")
    if shape.block_size != 128 or shape.head_dim != 128:
        return Subject(impl, phases, skip_reason=f"it serves blocks of 128 keys and D = 128, got block "
                                                 f"{shape.block_size}, D {shape.head_dim}")
    try:
        from cudnn.block_sparse_attention import api as bsa
    except Exception as error:  # noqa: BLE001  (absent, or broken against this torch/CuTe DSL: skip the peer)
        return Subject(impl, phases, skip_reason=f"cudnn.block_sparse_attention not importable "
                                                 f"({type(error).__name__}: {error}); {BSA_INSTALL}")

    def measurements():
        batch, length, scale = len(lengths), lengths[0], shape.head_dim ** -0.5
        block_lists, counts = _bsa_block_lists(inputs, block)
        capacity = block_lists.shape[-1]
        q = inputs.q.view(batch, length, shape.query_heads, shape.head_dim)
        k, v = (x.view(batch, length, shape.kv_heads, shape.head_dim) for x in (inputs.k, inputs.v))
        note = "non-causal inside the own block; FLOPs counted as MSA's"

        def forward(keys, values):
            return bsa.block_sparse_attention_forward(q, keys, values, block_lists, capacity, q2k_block_nums=counts,
                                                      sparse_block_size=block, softmax_scale=scale, layout="bshd")

        yield Measurement("fwd", lambda: forward(k, v), inputs.work.msa_forward, note)
        if "bwd" not in phases:
            return
        expanded_k, expanded_v = (x.repeat_interleave(shape.group, dim=2) for x in (k, v))
        result = forward(expanded_k, expanded_v)
        out, lse = result["o_tensor"], result["lse_tensor"]
        grad_out = inputs.grad_out.view_as(q)

        def backward():
            return bsa.block_sparse_attention_backward(grad_out, q, expanded_k, expanded_v, out, lse, block_lists,
                                                       capacity, q2k_block_nums=counts, softmax_scale=scale,
                                                       sparse_block_size=block, layout="bshd")

        yield Measurement("bwd", backward, inputs.work.msa_backward,
                          f"{note}; K/V expanded to {shape.query_heads} heads (its backward is MHA only), "
                          "dK/dV per query head")

    return Subject(impl, phases, measurements)
