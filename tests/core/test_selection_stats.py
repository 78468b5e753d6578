"""`torch_msa.selection_stats.selection_sharing` on hand-made selections and against a plain-Python oracle."""

import math

import pytest
import torch

from torch_msa.selection_stats import selection_sharing
from torch_msa.testing import cu_seqlens, random_block_indices, skewed_block_indices


def _oracle(block_indices, lengths, group_size, block_size):
    """(union sizes, shared pairs, valid pairs, block-0 rows, previous-block rows, choosing rows) by loops."""
    kv_heads, _, topk = block_indices.shape
    unions, shared, valid_pairs, block0, previous, choosing = [], 0, 0, 0, 0, 0
    for head in range(kv_heads):
        start = 0
        for length in lengths:
            for first in range(0, length, group_size):
                rows = range(first, min(first + group_size, length))
                sets = []
                for t in rows:
                    chosen = {int(b) for b in block_indices[head, start + t] if 0 <= b <= t // block_size}
                    sets.append(chosen)
                    if t // block_size + 1 > topk:
                        choosing += 1
                        block0 += 0 in chosen
                        previous += t // block_size - 1 in chosen
                union = set().union(*sets)
                unions.append(len(union))
                common = set.intersection(*sets)
                shared += len(common) * len(sets)
                valid_pairs += sum(len(s) for s in sets)
            start += length
    return unions, shared, valid_pairs, block0, previous, choosing


def test_a_hand_made_group():
    """Four queries of block 3 (blocks of 16, top-3) select {0,1,3}, {0,2,3}, {0,1,3}, {1,2,3}: a
    union of 4, block 3 alone shared (4 of 12 pairs), block 0 in 3 of 4 rows, block 2 in 2."""
    selection = torch.full((1, 52, 3), -1, dtype=torch.int32)
    selection[0, 48:52] = torch.tensor([[0, 1, 3], [0, 2, 3], [0, 1, 3], [1, 2, 3]], dtype=torch.int32)
    cu = torch.tensor([0, 52], dtype=torch.int32)
    stats = selection_sharing(selection[:, 48:], torch.tensor([0, 4], dtype=torch.int32), cu_seqlens_k=cu,
                              group_size=4, block_size=16)
    assert stats.overall.groups == 1 and stats.overall.union_mean == 4
    assert stats.overall.shared_pairs == pytest.approx(4 / 12)
    assert stats.overall.block0 == pytest.approx(3 / 4) and stats.overall.previous_block == pytest.approx(2 / 4)


def test_the_sink_and_local_selection_is_shared_by_every_group():
    cu = torch.tensor([0, 3000], dtype=torch.int32)
    stats = selection_sharing(skewed_block_indices(cu, cu, 2, 16, 128), cu, group_size=8)
    assert stats.overall.shared_pairs == 1.0 and stats.overall.block0 == 1.0 and stats.overall.previous_block == 1.0
    past_prefix = stats.by_position["2K-8K"]
    assert past_prefix.union_mean == 16 and past_prefix.union_max == 16
    assert stats.by_position["0-2K"].union_max == 16 and stats.by_position["8K+"].groups == 0
    assert math.isnan(stats.by_position["8K+"].union_mean)


@pytest.mark.parametrize("group_size", [1, 3, 8])
def test_random_selections_match_the_oracle(group_size):
    lengths = [0, 1, 700, 5, 1300]
    cu = cu_seqlens(lengths, lengths)[0]
    generator = torch.Generator().manual_seed(group_size)
    selection = random_block_indices(cu, cu, 2, 4, 64, generator=generator)
    # Junk that must not count: a repeat, an id past the horizon, a negative id.
    selection[0, 10, 1] = selection[0, 10, 0]
    selection[1, 20, 2] = 10_000
    selection[1, 30, 3] = -7
    stats = selection_sharing(selection, cu, group_size=group_size, block_size=64, position_edges=(256, 1024))
    unions, shared, valid_pairs, block0, previous, choosing = _oracle(selection, lengths, group_size, 64)
    overall = stats.overall
    assert overall.groups == len(unions)
    assert overall.union_mean == pytest.approx(sum(unions) / len(unions))
    assert overall.union_max == max(unions)
    assert overall.shared_pairs == pytest.approx(shared / valid_pairs)
    assert overall.block0 == pytest.approx(block0 / choosing)
    assert overall.previous_block == pytest.approx(previous / choosing)
    assert sum(row.groups for row in stats.by_position.values()) == overall.groups
    assert list(stats.by_position) == ["0-256", "256-1K", "1K+"]


def test_groups_never_cross_documents():
    """Two documents of 5 tokens in groups of 4: groups of 4 and 1 each, never one of 4 + 1 + 3."""
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    selection = torch.zeros(1, 10, 1, dtype=torch.int32)
    stats = selection_sharing(selection, cu, group_size=4, block_size=64)
    assert stats.overall.groups == 4 and stats.overall.shared_pairs == 1.0


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"group_size": 0}, "group_size: expected >= 1, got 0"),
    ({"position_edges": (8, 2)}, "position_edges: expected increasing positive positions"),
])
def test_bad_arguments_are_named(kwargs, message):
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        selection_sharing(torch.zeros(1, 4, 1, dtype=torch.int32), cu, **kwargs)
