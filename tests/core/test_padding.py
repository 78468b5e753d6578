"""Padding helpers: padded [B, S, ...] batches to packed documents and back."""

import pytest
import torch

import torch_msa
from torch_msa import check_padding_mask, pad_input, padded_cu_seqlens, unpad_input


def _mask(lengths, seqlen, left=()):
    mask = torch.zeros(len(lengths), seqlen, dtype=torch.long)
    for row, length in enumerate(lengths):
        if row in left:
            mask[row, seqlen - length:] = 1
        else:
            mask[row, :length] = 1
    return mask


def test_unpad_and_pad_round_trip():
    x = torch.randn(3, 7, 2, 5)
    mask = torch.tensor([[1, 1, 0, 1, 0, 0, 0], [1] * 7, [0] * 7])
    packed, indices, cu_seqlens, max_seqlen = unpad_input(x, mask)
    assert packed.shape == (3 + 7, 2, 5)
    assert cu_seqlens.tolist() == [0, 3, 10, 10] and cu_seqlens.dtype == torch.int32
    assert max_seqlen == 7
    torch.testing.assert_close(packed[:3], x[0, [0, 1, 3]])
    restored = pad_input(packed, indices, 3, 7)
    torch.testing.assert_close(restored, x * mask[..., None, None])


def test_pad_input_is_differentiable():
    packed = torch.randn(5, 3, requires_grad=True)
    indices = torch.tensor([0, 1, 4, 5, 6])
    pad_input(packed, indices, 2, 4).pow(2).sum().backward()
    torch.testing.assert_close(packed.grad, 2 * packed.detach())


def test_padded_cu_seqlens_right_left_full_and_empty_rows():
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
    cu_seqlens, max_seqlen = padded_cu_seqlens(mask)
    assert max_seqlen == 5 and cu_seqlens.dtype == torch.int32
    # Row by row: (real, padding) for right padding, (padding, real) for left padding.
    assert cu_seqlens.tolist() == [0, 3, 5, 7, 10, 15, 15, 20, 20]


def test_padded_cu_seqlens_needs_no_host_sync():
    compiled = torch.compile(padded_cu_seqlens, backend="eager", fullgraph=True)
    mask = _mask([6, 2], 8, left=(1,))
    torch.testing.assert_close(compiled(mask)[0], padded_cu_seqlens(mask)[0])


def test_check_padding_mask_rejects_a_hole():
    check_padding_mask(_mask([3, 5], 6, left=(0,)))
    with pytest.raises(ValueError, match="attention_mask: expected every row to be left- or right-padded.*row 1"):
        check_padding_mask(torch.tensor([[1, 1, 0], [1, 0, 1]]))


def test_debug_mode_checks_the_layout(monkeypatch):
    monkeypatch.setenv(torch_msa.DEBUG_ENV, "1")
    with pytest.raises(ValueError, match="row 0"):
        padded_cu_seqlens(torch.tensor([[0, 1, 0]]))


@pytest.mark.parametrize("bad, error, message", [
    (torch.ones(2, 3, 1), ValueError, r"attention_mask: expected a 2-D tensor \[B, S\], got shape \(2, 3, 1\)"),
    (torch.ones(2, 3), TypeError, "attention_mask: expected a bool or integer tensor.*float32"),
    ([1, 0], TypeError, "attention_mask: expected a torch.Tensor"),
])
def test_bad_masks_are_named(bad, error, message):
    with pytest.raises(error, match=message):
        padded_cu_seqlens(bad)


def test_unpad_input_checks_the_mask_shape():
    with pytest.raises(ValueError, match=r"attention_mask: expected shape \(2, 4\)"):
        unpad_input(torch.zeros(2, 4, 3), torch.ones(2, 5, dtype=torch.bool))


@pytest.mark.parametrize("left", [(), (0, 1)])
def test_padded_documents_give_the_unpadded_attention(left):
    """Kept in place (padding as documents) and removed (unpad_input): the same real-token outputs."""
    batch, seqlen, hq, hkv, dim, block = 2, 160, 4, 2, 64, 64
    mask = _mask([160, 97], seqlen, left=left)
    q = torch.randn(batch, seqlen, hq, dim)
    k, v = torch.randn(2, batch, seqlen, hkv, dim).unbind(0)
    index_q, index_k = torch.randn(batch, seqlen, hkv, 16), torch.randn(batch, seqlen, 1, 16)

    def attend(flat, cu_seqlens, max_seqlen):
        blocks = torch_msa.select_blocks(flat(index_q), flat(index_k), cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                         topk=2, block_size=block)
        return torch_msa.sparse_attention(flat(q), flat(k), flat(v), blocks, cu_seqlens, cu_seqlens, max_seqlen,
                                          max_seqlen, block_size=block)

    cu_seqlens, max_seqlen = padded_cu_seqlens(mask)
    in_place = attend(lambda x: x.reshape(batch * seqlen, *x.shape[2:]), cu_seqlens, max_seqlen)
    in_place = in_place.view(batch, seqlen, hq, dim)
    _, _, cu_unpadded, max_unpadded = unpad_input(q, mask)
    removed = attend(lambda x: unpad_input(x, mask)[0], cu_unpadded, max_unpadded)
    torch.testing.assert_close(in_place[mask.bool()], removed)
    assert torch.isfinite(in_place).all()
