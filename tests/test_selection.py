"""The GPU selector planners (`pbs.backends.planners`: `mean_pool`, `antidiagonal`) against the
reference selectors, and the wiring of `pbs.plan` to the `triton` planners, through the
Triton interpreter on CPU (fp32/fp16). The GPU runs are in tests/test_kernel_gpu_selection.py."""

from __future__ import annotations

import pytest
import torch

import pbs
from pbs.backends import registry as backend_registry
from pbs.backends.planners import antidiagonal_select, heads_per_chunk, mean_pool_select
from pbs.planning import build_plan
from pbs.reference.block_sets import finalize_selection
from pbs.reference.threshold_select import select_by_cumulative_threshold
from tests.planning_helpers import (
    case_config,
    case_qkv,
    assert_same_selection,
    reference_scores,
    selection_inputs_of,
    CPU_CASES,
)


# -- the selector drivers against the reference selectors -----------------------------------------
SELECT_CASES = [
    # case, permuter, selector, dtype, threshold, causal
    ("full_segments", "last_block", "mean_pool", torch.float32, 0.9, True),
    ("partial_segment", "last_block", "mean_pool", torch.float16, 0.5, True),
    ("partial_segment", "none", "mean_pool", torch.float32, 0.9, True),
    ("offset_per_head", "last_block", "mean_pool", torch.float32, 0.9, True),
    ("offset_per_head", "none", "mean_pool", torch.float16, 0.5, True),
    ("one_key_tail", "none", "mean_pool", torch.float32, 0.95, True),
    ("partial_segment", "last_block", "mean_pool", torch.float32, 0.9, False),
    ("partial_segment", "last_block", "antidiagonal", torch.float32, 0.9, True),
    ("partial_segment", "none", "antidiagonal", torch.float32, 0.9, True),
    ("offset_per_head", "none", "antidiagonal", torch.float32, 0.5, True),
    ("offset_per_head", "last_block", "antidiagonal", torch.float16, 0.95, True),
    ("partial_segment", "none", "antidiagonal", torch.float32, 0.9, False),
]


@pytest.mark.parametrize("case, permuter, selector, dtype, threshold, causal", SELECT_CASES, ids=str)
def test_select_matches_reference(case, permuter, selector, dtype, threshold, causal):
    """The triton selector drivers on the reference permutation, K read through the permutation."""
    q, k, _ = case_qkv(CPU_CASES[case], dtype)
    block, segment, gqa = CPU_CASES[case][6:]
    config = case_config(
        block, segment, gqa, permuter=permuter, causal=causal,
        selector={"name": selector, "threshold": threshold, **({"stride": 8} if selector == "antidiagonal" else {})},
    )
    scale = q.shape[-1] ** -0.5
    plan, q_perm, _, _ = build_plan(q, k, config, scale)
    assert plan.layout.segmented == (permuter != "none")
    inputs = selection_inputs_of(plan, q_perm, k, scale, permuted=False)
    run = mean_pool_select if selector == "mean_pool" else antidiagonal_select
    actual = run(config.selector, inputs)
    if not plan.key_permutation.is_identity:
        assert not inputs.has_permuted_k  # K was read through the permutation, never gathered
    assert actual.indices.dtype == plan.mask.indices.dtype
    reference_inputs = selection_inputs_of(plan, q_perm, k, scale, permuted=True)
    scores, candidates, first = reference_scores(config.selector, reference_inputs)
    assert_same_selection(actual, plan.mask, scores, candidates, threshold, ranked_first=first)


def test_unsegmented_antidiagonal_counts_forced_blocks_first():
    # With a low threshold the forced sink and diagonal blocks alone reach tau in most rows, so
    # XAttention's rule keeps little else; Algorithm 2's rule (forced mass not counted) keeps more.
    q, k, _ = case_qkv(CPU_CASES["partial_segment"])
    config = case_config(32, 64, "shared", permuter="none", selector={"name": "antidiagonal", "threshold": 0.3})
    scale = q.shape[-1] ** -0.5
    plan, q_perm, _, _ = build_plan(q, k, config, scale)
    inputs = selection_inputs_of(plan, q_perm, k, scale, permuted=False)
    actual = antidiagonal_select(config.selector, inputs)
    reference_inputs = selection_inputs_of(plan, q_perm, k, scale, permuted=True)
    scores, candidates, first = reference_scores(config.selector, reference_inputs)
    assert_same_selection(actual, plan.mask, scores, candidates, 0.3, ranked_first=first)
    not_first = finalize_selection(
        select_by_cumulative_threshold(scores, candidates, 0.3), plan.layout, plan.key_positions(), True
    )
    assert actual.counts.sum() < not_first.counts.sum()


def test_select_in_several_head_chunks(monkeypatch):
    case = (1, 4, 2, 300, None, 32, 32, 64, "shared")
    q, k, _ = case_qkv(case)
    config = case_config(32, 64, "shared")
    plan, q_perm, _, _ = build_plan(q, k, config, 32**-0.5)
    inputs = selection_inputs_of(plan, q_perm, k, 32**-0.5, permuted=False)
    layout = plan.layout
    per_head = layout.batch * layout.num_query_blocks * layout.num_key_blocks * 4
    assert heads_per_chunk(inputs, chunk_bytes=per_head) == 1
    assert heads_per_chunk(inputs, chunk_bytes=1) == 1
    whole = mean_pool_select(config.selector, inputs)
    # Chunks of 3 heads split the GQA groups of 2: the pooled keys must follow each query head.
    monkeypatch.setattr("pbs.backends.planners.SCORE_CHUNK_BYTES", per_head * 3)
    chunked = mean_pool_select(config.selector, inputs)
    assert torch.equal(chunked.counts, whole.counts) and torch.equal(chunked.indices, whole.indices)


# -- the wiring of pbs.plan ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "permuter, selector",
    [("last_block", "mean_pool"), ("none", "antidiagonal"), ({"name": "last_block", "causal_scoring": True}, "antidiagonal")],
    ids=["last_block-mean_pool", "none-antidiagonal", "causal_scoring-antidiagonal"],
)
def test_plan_uses_the_triton_implementations_when_asked(monkeypatch, permuter, selector):
    """With the GPU path forced, pbs.plan equals the reference plan; ``none`` has no triton
    permuter and falls back to its reference ``permute``."""
    case = CPU_CASES["offset_per_head"]
    q, k, _ = case_qkv(case)
    config = case_config(*case[6:], permuter=permuter, selector=selector)
    reference = pbs.plan(q, k, config)
    calls = []
    for kind, component in (("permuter", config.permuter), ("selector", config.selector)):
        impl = backend_registry.planner_for(kind, component.name, "triton")
        if impl is not None:
            spy = lambda c, i, impl=impl, n=component.name: calls.append(n) or impl(c, i)  # noqa: E731
            monkeypatch.setitem(backend_registry._PLANNERS, (kind, component.name, "triton"), spy)
    monkeypatch.setattr("pbs.planning.planning_family", lambda backend, device: "triton")
    fast = pbs.plan(q, k, config)
    assert selector in calls
    assert (config.permuter.name in calls) == (config.permuter.name == "last_block")
    assert torch.equal(fast.key_permutation.indices, reference.key_permutation.indices)
    scale = q.shape[-1] ** -0.5
    inputs = selection_inputs_of(reference, reference.query_permutation.apply(q), k, scale, permuted=True)
    scores, candidates, first = reference_scores(config.selector, inputs)
    assert_same_selection(fast.mask, reference.mask, scores, candidates, config.selector.threshold, ranked_first=first)
