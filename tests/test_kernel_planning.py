"""GPU planning kernels (block means, last_block scores and sort, threshold selection) against their
reference twins: on CPU through the Triton interpreter in fp32/fp16, on the GPU in bf16."""

from __future__ import annotations

import pytest
import torch

import pbs
from pbs.components import PermutationInputs, SelectionInputs
from pbs.kernels.block_means import block_means
from pbs.kernels.last_block import last_block_key_scores, last_block_permute, sort_segments
from pbs.kernels.selection import heads_per_chunk, mean_pool_select
from pbs.kernels.threshold_select import empty_block_mask_tensors, threshold_select_rows
from pbs.permuters._segments import mean_attention_over_queries, scoring_queries, sort_within_segments
from pbs.permuters.avg_query import block_means as reference_block_means
from pbs.kernels.block_sets import block_sets
from pbs.layout import Layout
from pbs.planning import build_plan, make_layout
from pbs.selectors._threshold import select_by_cumulative_threshold
from pbs.selectors.mean_pool import mean_pool_block_scores
from pbs.types import BlockMask

CPU_CASES = [
    # batch, heads_q, heads_kv, seq_len, seq_len_q, head_dim, block, segment, gqa
    (1, 2, 2, 256, None, 32, 32, 64, "shared"),
    (2, 4, 2, 300, None, 32, 32, 64, "shared"),
    (2, 4, 2, 300, 130, 16, 32, 64, "per_head"),
    (1, 4, 1, 257, None, 48, 16, 64, "shared"),
]


def _config(block, segment, gqa, **extra):
    return pbs.PBSConfig(block_size=block, segment_size=segment, gqa=gqa, **extra)


def _permutation_inputs(case, dtype, device="cpu"):
    b, hq, hkv, n, nq, d, block, segment, gqa = case
    q, k, v = pbs.testing.make_qkv(
        batch=b, heads_q=hq, heads_kv=hkv, seq_len=n, seq_len_q=nq, head_dim=d, dtype=dtype, device=device
    )
    config = _config(block, segment, gqa)
    layout = make_layout(q, k, config)
    return q, k, v, config, PermutationInputs(q=q, k=k, layout=layout, gqa=gqa, scale=d**-0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gather", [False, True])
def test_block_means_match_reference(dtype, gather):
    q, k, _ = pbs.testing.make_qkv(batch=2, heads_q=4, heads_kv=2, seq_len=200, head_dim=24, dtype=dtype)
    if gather:
        perm = pbs.plan(q.float(), k.float(), _config(32, 64, "per_head")).key_permutation
        expected = reference_block_means(perm.apply(k), 32)
        actual = block_means(k, 32, perm.indices)
    else:
        expected = reference_block_means(k, 32)
        actual = block_means(k, 32)
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", CPU_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_last_block_scores_match_reference(case, dtype):
    q, k, _, config, inputs = _permutation_inputs(case, dtype)
    layout = inputs.layout
    m = min(layout.seq_len_q, layout.block_size)
    slots = torch.arange(layout.seq_len_q - m, layout.seq_len_q)
    expected = mean_attention_over_queries(
        scoring_queries(inputs)[:, :, slots], slots + layout.query_offset, k, inputs.scale, layout.causal
    )
    actual = last_block_key_scores(inputs, m)
    tol = 1e-6 if dtype == torch.float32 else 2e-4
    torch.testing.assert_close(actual, expected, atol=tol, rtol=1e-3)


@pytest.mark.parametrize("case", CPU_CASES)
def test_last_block_permutation_sorts_reference_scores(case):
    q, k, _, config, inputs = _permutation_inputs(case, torch.float32)
    layout = inputs.layout
    perm = last_block_permute(config.permuter, inputs).keys
    reference = config.permuter.permute(inputs).keys
    n, s, g = layout.seq_len_k, layout.segment_size, layout.num_full_segments
    # A bijection that moves keys only inside their segment, and its inverse.
    assert torch.equal(perm.indices.sort(-1).values, torch.arange(n).expand_as(perm.indices))
    assert torch.equal(perm.inverse.gather(-1, perm.indices), torch.arange(n).expand_as(perm.indices))
    assert torch.equal(perm.indices // s, torch.arange(n).expand_as(perm.indices) // s)
    # In each segment the reference's scores come out in descending order (up to fp32 noise), and
    # without near-ties the order is exactly the reference's.
    m = min(layout.seq_len_q, layout.block_size)
    slots = torch.arange(layout.seq_len_q - m, layout.seq_len_q)
    scores = mean_attention_over_queries(
        scoring_queries(inputs)[:, :, slots], slots + layout.query_offset, k, inputs.scale, layout.causal
    )
    ordered = scores.gather(-1, perm.indices)[..., : g * s].reshape(*scores.shape[:2], g, s)
    assert (ordered[..., 1:] <= ordered[..., :-1] + 1e-6).all()
    # A slot whose score is clearly apart from both neighbours must hold the reference's key.
    gap = ordered[..., :-1] - ordered[..., 1:]
    inf = torch.full_like(gap[..., :1], float("inf"))
    clear = (torch.cat([inf, gap], -1) > 1e-7) & (torch.cat([gap, inf], -1) > 1e-7)
    clear = clear.reshape(*scores.shape[:2], g * s)
    assert clear.float().mean() > 0.2
    assert torch.equal(perm.indices[..., : g * s][clear], reference.indices[..., : g * s][clear])
    assert torch.equal(perm.indices[..., g * s :], reference.indices[..., g * s :])


def test_sort_segments_breaks_ties_towards_the_lower_index():
    scores = torch.tensor([[[0.5, 0.5, 0.25, 0.5, 0.0, 1.0, 1.0, 0.0, 0.3]]])
    perm = sort_segments(scores, segment_size=4)
    expected = sort_within_segments(scores, 0, 8, 4)
    assert perm.indices.tolist() == expected.tolist() == [[[0, 1, 3, 2, 5, 6, 4, 7, 8]]]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "seq_len_q, seq_len_k, block, segment",
    [(512, 512, 64, 128), (300, 300, 32, 64), (130, 300, 32, 64), (77, 1000, 16, 64), (1000, 1000, 64, 256),
     (40, 40, 16, 64), (257, 513, 32, 96)],
)
def test_block_sets_match_layout(seq_len_q, seq_len_k, block, segment, causal):
    layout = Layout(batch=1, heads_q=1, heads_kv=1, seq_len_q=seq_len_q, seq_len_k=seq_len_k,
                    block_size=block, segment_size=segment, causal=causal)
    allowed, diagonal = block_sets(layout, "cpu")
    assert torch.equal(allowed, layout.allowed_blocks())
    assert torch.equal(diagonal, layout.diagonal_blocks() & layout.allowed_blocks())


def _reference_mask(scores, layout, threshold, key_positions, force_sink=True):
    from pbs.planning import finalize_selection

    selected = select_by_cumulative_threshold(scores, layout.allowed_blocks(), threshold)
    return finalize_selection(selected, layout, key_positions, force_sink)


def test_threshold_select_exact_ties_and_forced_blocks():
    # Shares chosen so every cumulative sum is exact in fp32: the kept sets must match exactly.
    q, k, _ = pbs.testing.make_qkv(batch=1, heads_q=2, heads_kv=1, seq_len=512, head_dim=16)
    layout = make_layout(q, k, _config(64, 128, "shared"))
    tq, tk = layout.num_query_blocks, layout.num_key_blocks
    allowed = layout.allowed_blocks()
    raw = torch.zeros(1, 2, tq, tk)
    raw[0, 0] = 1.0  # uniform rows: pure ties
    raw[0, 1, :, ::2] = 2.0  # two levels
    raw[0, 1, :, 1::2] = 1.0
    shares = raw.masked_fill(~allowed, 0.0)
    shares = shares / shares.sum(-1, keepdim=True)
    key_positions = torch.arange(512).expand(1, 1, 512)
    for threshold in (0.5, 0.75, 1.0):
        expected = _reference_mask(shares, layout, threshold, key_positions)
        counts, indices = empty_block_mask_tensors(layout, shares.device)
        allowed, diagonal = block_sets(layout, shares.device)
        threshold_select_rows(
            shares, layout, threshold, counts, indices, head_offset=0, key_inverse=key_positions,
            from_logits=False, allowed=allowed, diagonal=diagonal,
        )
        assert torch.equal(counts, expected.counts) and torch.equal(indices, expected.indices)


def _assert_same_selection(actual: BlockMask, expected: BlockMask, scores: torch.Tensor, threshold: float):
    """Equal masks, except rows where the reference's own cut is within fp noise of ``threshold``."""
    same_rows = (actual.to_dense() == expected.to_dense()).all(-1)
    if same_rows.all():
        return
    ranked = scores.sort(-1, descending=True).values.cumsum(-1)
    near = ((ranked - threshold).abs() < 1e-4).any(-1)
    assert (same_rows | near).all(), f"{int((~same_rows & ~near).sum())} rows differ away from the threshold"
    assert (~same_rows).float().mean() < 0.05


@pytest.mark.parametrize("case", CPU_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("threshold", [0.5, 0.9])
def test_mean_pool_select_matches_reference(case, dtype, threshold):
    q, k, v, config, _ = _permutation_inputs(case, dtype)
    config = config.model_copy(update={"selector": pbs.selectors.MeanPoolSelector(threshold=threshold)})
    plan, q_perm, _, _ = build_plan(q, k, config, q.shape[-1] ** -0.5)
    inputs = SelectionInputs(
        q_perm, None, plan.layout, plan.query_positions(), plan.key_positions(), q.shape[-1] ** -0.5,
        source_k=k, key_permutation=plan.key_permutation,
    )
    actual = mean_pool_select(config.selector, inputs)
    assert not inputs.has_permuted_k  # K was read through the permutation, never gathered
    reference_inputs = SelectionInputs(
        q_perm, plan.key_permutation.apply(k), plan.layout, plan.query_positions(), plan.key_positions(),
        q.shape[-1] ** -0.5,
    )
    scores = mean_pool_block_scores(reference_inputs)
    _assert_same_selection(actual, plan.mask, scores, threshold)
    assert actual.indices.dtype == plan.mask.indices.dtype


def test_mean_pool_select_in_several_head_chunks(monkeypatch):
    case = (2, 4, 2, 300, None, 32, 32, 64, "shared")
    q, k, _, config, _ = _permutation_inputs(case, torch.float32)
    plan, q_perm, _, _ = build_plan(q, k, config, 32**-0.5)
    inputs = SelectionInputs(
        q_perm, None, plan.layout, plan.query_positions(), plan.key_positions(), 32**-0.5,
        source_k=k, key_permutation=plan.key_permutation,
    )
    layout = plan.layout
    per_head = layout.batch * layout.num_query_blocks * layout.num_key_blocks * 4
    assert heads_per_chunk(inputs, chunk_bytes=per_head) == 1
    assert heads_per_chunk(inputs, chunk_bytes=1) == 1
    # Chunks of 3 heads split the GQA groups of 2: the pooled keys must follow each query head.
    monkeypatch.setattr("pbs.kernels.selection.SCORE_CHUNK_BYTES", per_head * 3)
    chunked = mean_pool_select(config.selector, inputs)
    assert torch.equal(chunked.counts, plan.mask.counts) and torch.equal(chunked.indices, plan.mask.indices)


@pytest.mark.parametrize("selector", ["mean_pool", "antidiagonal"])
def test_plan_uses_the_triton_implementations_when_asked(monkeypatch, selector):
    """The wiring of pbs.plan: with the GPU path forced, the plan equals the reference plan."""
    case = (2, 4, 2, 300, None, 32, 32, 64, "shared")
    q, k, _, config, _ = _permutation_inputs(case, torch.float32)
    config = config.model_copy(update={"selector": pbs.components.selector_registry.parse(selector)})
    reference = pbs.plan(q, k, config)
    calls = []
    import pbs.kernels.last_block as last_block_module

    original = last_block_module.last_block_permute
    monkeypatch.setattr(last_block_module, "last_block_permute", lambda *a: calls.append(1) or original(*a))
    monkeypatch.setattr("pbs.planning.resolve_component_backend", lambda config, device: "triton")
    fast = pbs.plan(q, k, config)
    assert calls, "the triton last_block implementation was not used"
    assert torch.equal(fast.key_permutation.indices, reference.key_permutation.indices)
    same = (fast.mask.to_dense() == reference.mask.to_dense()).all(-1).float().mean()
    assert same > 0.97


@pytest.mark.gpu
@pytest.mark.parametrize("selector", ["mean_pool", "antidiagonal"])
def test_gpu_planning_matches_reference_bf16(selector):
    q, k, _ = pbs.testing.make_qkv(batch=1, heads_q=8, heads_kv=2, seq_len=16384, head_dim=128,
                                   dtype=torch.bfloat16, device="cuda")
    config = pbs.PBSConfig(selector=selector)
    fast = pbs.plan(q, k, config)
    reference = pbs.plan(q, k, config.model_copy(update={"backend": "reference"}))
    # The permutation: each segment's reference scores descend along the fast order.
    layout = fast.layout
    inputs = PermutationInputs(q=q, k=k, layout=layout, gqa="shared", scale=128**-0.5)
    slots = torch.arange(layout.seq_len_q - 128, layout.seq_len_q, device="cuda")
    scores = mean_attention_over_queries(scoring_queries(inputs)[:, :, slots], slots, k, inputs.scale, True)
    g, s = layout.num_full_segments, layout.segment_size
    ordered = scores.gather(-1, fast.key_permutation.indices)[..., : g * s].reshape(1, 2, g, s)
    assert (ordered[..., 1:] <= ordered[..., :-1] + 1e-5).all()
    # The masks: nearly every row equal (bf16 pooled scores differ in the last bits).
    same = (fast.mask.to_dense() == reference.mask.to_dense()).all(-1).float().mean()
    assert same > 0.95
    assert abs(fast.density - reference.density) < 0.01


def test_mean_pool_select_non_causal_matches_reference():
    case = (2, 4, 2, 300, None, 32, 32, 64, "shared")
    q, k, _, config, _ = _permutation_inputs(case, torch.float32)
    config = config.model_copy(update={"causal": False})
    plan, q_perm, _, _ = build_plan(q, k, config, 32**-0.5)
    inputs = SelectionInputs(
        q_perm, None, plan.layout, plan.query_positions(), plan.key_positions(), 32**-0.5,
        source_k=k, key_permutation=plan.key_permutation,
    )
    actual = mean_pool_select(config.selector, inputs)
    # Every block is allowed, so rows may select future blocks; the reference must agree.
    assert (actual.to_dense() & ~plan.layout.diagonal_blocks()).any()
    reference_inputs = SelectionInputs(
        q_perm, plan.key_permutation.apply(k), plan.layout, plan.query_positions(), plan.key_positions(), 32**-0.5,
    )
    _assert_same_selection(actual, plan.mask, mean_pool_block_scores(reference_inputs), 0.9)
