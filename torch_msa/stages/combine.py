"""The combine of a KV-outer forward: per-(query, slot) partial outputs merged per query."""

import triton
import triton.language as tl

from ..triton_utils.common import LN_2, program_token_group
from ..triton_utils.launch import LaunchConfig, cached_launches, launch

COMBINE_CONFIGS = (LaunchConfig(num_stages=3, num_warps=4),)


@cached_launches
@triton.jit
def msa_fwd_combine_kernel(
    partial_out, partial_lse, out, lse, done,
    stride_out_token, stride_out_head,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
    TOPK: tl.constexpr, DIM: tl.constexpr, SKIP_DONE: tl.constexpr,
):
    token, kv_head, heads, head_ok = program_token_group(GROUP, GROUP_P2)
    if SKIP_DONE:
        if tl.load(done + token * NUM_KV_HEADS + kv_head) > 0:
            return
    dims = tl.arange(0, DIM)
    base = (token * NUM_KV_HEADS + kv_head) * TOPK * GROUP
    best = tl.full((GROUP_P2,), float("-inf"), tl.float32)
    for slot in range(TOPK):
        best = tl.maximum(best, tl.load(partial_lse + base + slot * GROUP + heads, mask=head_ok, other=float("-inf")))
    shift = tl.where(best == float("-inf"), 0.0, best)
    total = tl.zeros((GROUP_P2,), tl.float32)
    acc = tl.zeros((GROUP_P2, DIM), tl.float32)
    for slot in range(TOPK):
        slot_lse = tl.load(partial_lse + base + slot * GROUP + heads, mask=head_ok, other=float("-inf"))
        used = slot_lse != float("-inf")
        weight = tl.where(used, tl.exp2(slot_lse - shift), 0.0)
        part = tl.load(partial_out + (base + slot * GROUP + heads)[:, None] * DIM + dims[None, :],
                       mask=used[:, None], other=0.0)
        total += weight
        acc += weight[:, None] * part.to(tl.float32)
    acc = acc / tl.where(total > 0, total, 1.0)[:, None]
    query_head = kv_head * GROUP + heads
    tl.store(out + token * stride_out_token + query_head[:, None] * stride_out_head + dims[None, :],
             acc.to(out.dtype.element_ty), mask=head_ok[:, None])
    natural = tl.where(total > 0, (shift + tl.log2(tl.where(total > 0, total, 1.0))) * LN_2, float("-inf"))
    tl.store(lse + token * NUM_KV_HEADS * GROUP + query_head, natural, mask=head_ok)


def combine(partial_out, partial_lse, out, lse, num_kv_heads, topk, done=None):
    """Merge the per-(query, slot) partials of a KV-outer forward into `out` and `lse` (in place).

    Args:
        partial_out: `[Tq * Hkv * topk * G, D]` in the input dtype, laid out `[Tq, Hkv, topk, G]`
            by rows: each row normalised over its slot's key block.
        partial_lse: fp32 `[Tq * Hkv * topk * G]`, the slot's log2-sum-exp of the scaled scores,
            `-inf` for a slot without an entry.
        out: `[Tq, Hq, D]` (unit stride in D), written.
        lse: fp32 `[Tq, Hq]` contiguous, written (natural log).
        done: optional int32 `[Tq * Hkv]`: positive at the (query, KV head) rows whose output
            and lse a query-outer kernel already wrote; those are left as they are.
    """
    num_queries, num_heads, dim = out.shape
    group = num_heads // num_kv_heads
    shape_key = (out.device, out.dtype, dim, group, topk, done is not None)

    def launch_combine(config):
        msa_fwd_combine_kernel[(num_queries, num_kv_heads)](
            partial_out, partial_lse, out, lse, partial_lse if done is None else done,
            out.stride(0), out.stride(1),
            NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_P2=triton.next_power_of_2(group), TOPK=topk, DIM=dim,
            SKIP_DONE=done is not None, **config.options,
        )

    launch("msa_fwd_combine_kernel", shape_key, COMBINE_CONFIGS, launch_combine)
