"""`pbs.kernels.threshold_select` against its eager twin `pbs.reference.threshold_select`, through
the Triton interpreter on CPU: ties, forced blocks ranked first, candidates only."""

from __future__ import annotations

import pytest
import torch

import pbs
from pbs.kernels.block_sets import block_sets
from pbs.kernels.threshold_select import empty_block_mask_tensors, threshold_select_rows
from pbs.planning import make_layout
from pbs.reference.block_sets import finalize_selection
from pbs.reference.block_sets import forced_blocks
from pbs.reference.threshold_select import select_by_cumulative_threshold
from pbs.types import BlockMask, Permutation
from tests.planning_helpers import (
    case_config,
    assert_same_selection,
)


# -- threshold selection ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "segmented, forced_first", [(True, False), (False, False), (False, True)],
    ids=["segmented", "unsegmented", "forced_first"],
)
def test_threshold_select_exact_ties_and_forced_blocks(segmented, forced_first):
    # Two heads of exactly tied / two-level shares over the candidates, a partial last segment
    # (Nk = 480, segment 128) and a sink that moved to block 1: the kept sets must match exactly.
    q, k, _ = pbs.testing.make_qkv(batch=1, heads_q=2, heads_kv=1, seq_len=480, head_dim=16)
    config = case_config(64, 128, "shared", permuter="last_block" if segmented else "none")
    layout = make_layout(q, k, config)
    tq, tk = layout.num_query_blocks, layout.num_key_blocks
    candidates = layout.candidate_blocks()
    raw = torch.zeros(1, 2, tq, tk)
    raw[0, 0] = 1.0  # uniform rows: pure ties
    raw[0, 1, :, ::2] = 2.0  # two levels
    raw[0, 1, :, 1::2] = 1.0
    shares = raw.masked_fill(~candidates, 0.0)
    shares = shares / shares.sum(-1, keepdim=True).clamp(min=1.0)
    indices = torch.arange(480)
    indices[:64] = indices[:64].roll(-70 % 64)  # position 0 is no longer in slot 0 ...
    indices[:128] = torch.cat([indices[64:128], indices[:64]])  # ... but in block 1
    key_perm = Permutation.from_indices(indices.expand(1, 1, 480).clone())
    assert int(key_perm.inverse[0, 0, 0]) // 64 == 1
    first = forced_blocks(layout, key_perm.indices) if forced_first else None
    sets = block_sets(layout, "cpu")
    for threshold in (0.3, 0.75, 1.0):
        selected = select_by_cumulative_threshold(shares, candidates, threshold, ranked_first=first)
        expected = finalize_selection(selected, layout, key_perm.indices, True)
        counts, idx = empty_block_mask_tensors(layout, shares.device)
        counts.fill_(-7)
        idx.fill_(99)
        threshold_select_rows(
            shares, layout, threshold, counts, idx, head_offset=0, key_inverse=key_perm.inverse,
            from_logits=False, candidates=sets.candidates, diagonal=sets.diagonal, forced_first=forced_first,
        )
        assert torch.equal(counts, expected.counts) and torch.equal(idx, expected.indices), threshold
    if segmented:
        # The first segment's rows have no candidates: only the forced blocks are kept.
        assert not candidates[:2].any() and int(counts[0, 0, 0]) == 2  # blocks 0 and 1 (sink)


def test_threshold_select_from_logits_over_candidates_only():
    # Huge logits on the diagonal segment must not take any mass: it is not a candidate.
    q, k, _ = pbs.testing.make_qkv(batch=1, heads_q=1, heads_kv=1, seq_len=512, head_dim=16)
    layout = make_layout(q, k, case_config(64, 128, "shared"))
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 1, layout.num_query_blocks, layout.num_key_blocks, generator=gen)
    logits = logits + 100.0 * layout.diagonal_blocks()
    candidates = layout.candidate_blocks()
    shares = logits.masked_fill(~candidates, float("-inf")).softmax(-1).nan_to_num(0.0)
    key_positions = torch.arange(512).expand(1, 1, 512)
    sets = block_sets(layout, "cpu")
    for threshold in (0.5, 0.9):
        counts, idx = empty_block_mask_tensors(layout, logits.device)
        threshold_select_rows(
            logits, layout, threshold, counts, idx, head_offset=0, key_inverse=key_positions,
            from_logits=True, candidates=sets.candidates, diagonal=sets.diagonal,
        )
        selected = select_by_cumulative_threshold(shares, candidates, threshold)
        expected = finalize_selection(selected, layout, key_positions, True)
        assert_same_selection(BlockMask(counts, idx, layout), expected, shares, candidates, threshold)
