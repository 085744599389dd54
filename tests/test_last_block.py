"""The `last_block` GPU permuter (`pbs.kernels.last_block`: Eq. 3 scores and the in-segment sort)
against its eager twin in `pbs.permuters.last_block`, through the Triton interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

from pbs.backends.planners import last_block_permute
from pbs.kernels.last_block import last_block_key_scores, sort_segments
from pbs.permuters._segments import sort_within_segments
from tests.planning_helpers import (
    case_permutation_inputs,
    reference_key_scores,
    assert_same_key_order,
    CPU_CASES,
    NO_FULL_SEGMENT,
)


# -- last_block ------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CPU_CASES), ids=str)
@pytest.mark.parametrize(
    "dtype, causal", [(torch.float32, False), (torch.float32, True), (torch.float16, False)],
    ids=["fp32-eq3", "fp32-causal", "fp16-eq3"],
)
def test_last_block_scores_match_reference(case, dtype, causal):
    q, k, _, config, inputs = case_permutation_inputs(CPU_CASES[case], dtype)
    layout = inputs.layout
    expected = reference_key_scores(inputs, causal)
    actual = last_block_key_scores(inputs.q, inputs.k, layout, inputs.gqa, inputs.scale,
                                   min(layout.seq_len_q, layout.block_size), causal=causal)
    assert actual.shape == expected.shape
    assert actual.shape[-1] == (layout.seq_len_k if causal else layout.permutable_key_len)
    tol = 1e-6 if dtype == torch.float32 else 2e-4
    torch.testing.assert_close(actual, expected, atol=tol, rtol=1e-3)
    if not causal:
        # Eq. 3: each proxy query's softmax is normalised over the full-segment keys.
        torch.testing.assert_close(actual.sum(-1), torch.ones_like(actual.sum(-1)), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "case, causal_scoring",
    [("full_segments", False), ("partial_segment", False), ("partial_segment", True), ("offset_per_head", False),
     ("offset_per_head", True), ("one_key_tail", False)],
    ids=str,
)
def test_last_block_permutation_matches_reference(case, causal_scoring):
    q, k, _, config, inputs = case_permutation_inputs(
        CPU_CASES[case], torch.float32, permuter={"name": "last_block", "causal_scoring": causal_scoring}
    )
    layout = inputs.layout
    perm = last_block_permute(config.permuter, inputs).keys
    reference = config.permuter.permute(inputs).keys
    assert perm.indices.shape == (layout.batch, inputs.key_heads, layout.seq_len_k)
    n, s = layout.seq_len_k, layout.segment_size
    assert torch.equal(perm.indices // s, torch.arange(n).expand_as(perm.indices) // s), "keys left their segment"
    scores = reference_key_scores(inputs, causal_scoring)[..., : layout.permutable_key_len]
    assert_same_key_order(perm, reference, scores)


def test_last_block_without_a_full_segment_is_the_identity():
    q, k, _, config, inputs = case_permutation_inputs(NO_FULL_SEGMENT, torch.float32)
    assert inputs.layout.permutable_key_len == 0
    assert last_block_permute(config.permuter, inputs).keys is None
    assert config.permuter.permute(inputs).keys is None


def test_sort_segments_breaks_ties_towards_the_lower_index():
    scores = torch.tensor([[[0.5, 0.5, 0.25, 0.5, 0.0, 1.0, 1.0, 0.0, 0.3]]])
    perm = sort_segments(scores, segment_size=4)
    expected = sort_within_segments(scores, 0, 8, 4)
    assert perm.indices.tolist() == expected.tolist() == [[[0, 1, 3, 2, 5, 6, 4, 7, 8]]]
    # Scores of the full segments only (Eq. 3): the tail of the permutation stays in place.
    short = sort_segments(scores[..., :8], segment_size=4, total_len=11)
    assert short.indices.tolist() == [[[0, 1, 3, 2, 5, 6, 4, 7, 8, 9, 10]]]
    assert torch.equal(short.inverse.gather(-1, short.indices), torch.arange(11).expand(1, 1, 11))
