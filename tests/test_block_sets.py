"""`pbs.kernels.block_sets` against its eager side (`pbs.layout.Layout` block sets and
`pbs.reference.block_sets`), through the Triton interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

from pbs.kernels.block_sets import block_sets
from pbs.layout import Layout


# -- block sets and block means --------------------------------------------------------------------
@pytest.mark.parametrize("segmented", [True, False], ids=["segmented", "unsegmented"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "seq_len_q, seq_len_k, block, segment",
    [(512, 512, 64, 128), (300, 300, 32, 64), (130, 300, 32, 64), (77, 1000, 16, 64), (1000, 1000, 64, 256),
     (40, 40, 16, 64), (257, 513, 32, 96), (100, 290, 32, 64), (1, 300, 32, 64)],
)
def test_block_sets_match_layout(seq_len_q, seq_len_k, block, segment, causal, segmented):
    layout = Layout(batch=1, heads_q=1, heads_kv=1, seq_len_q=seq_len_q, seq_len_k=seq_len_k, block_size=block,
                    segment_size=segment if segmented else block, causal=causal, segmented=segmented)
    sets = block_sets(layout, "cpu")
    assert torch.equal(sets.allowed, layout.allowed_blocks())
    assert torch.equal(sets.diagonal, layout.diagonal_blocks())
    assert torch.equal(sets.candidates, layout.candidate_blocks())
    assert torch.equal(sets.allowed, sets.candidates | sets.diagonal)  # what the threshold kernel relies on


def test_block_sets_partial_last_segment_is_diagonal():
    # 300 keys, segment 64: keys 256..299 are the partial last segment (blocks 8 and 9 of 32).
    layout = Layout(1, 1, 1, 300, 300, 32, 64)
    sets = block_sets(layout, "cpu")
    assert sets.diagonal[9, 8] and sets.diagonal[8, 8] and not sets.candidates[9, 8]
    # Nq < Nk with offset 170: query block 0 holds positions 170..201, segments 2 and 3.
    layout = Layout(1, 1, 1, 130, 300, 32, 64)
    sets = block_sets(layout, "cpu")
    assert sets.diagonal[0].nonzero().flatten().tolist() == [4, 5, 6, 7]
    assert sets.candidates[0].nonzero().flatten().tolist() == [0, 1, 2, 3]
