"""GPU planning kernels (block sets, block means, last_block scores and sort, threshold selection, the
selector drivers) against their reference twins, through the Triton interpreter on CPU (fp32/fp16).

The semantics are the reference's (commit "selection follows the paper"): last_block scores by
Eq. 3 (no mask, softmax over the full-segment keys) unless ``causal_scoring``; the selectors rank
the *candidate* blocks (allowed minus the on-diagonal segment, the partial last segment included,
or every allowed block for the unsegmented ``none`` permuter); XAttention's forced-first rule for
unsegmented ``antidiagonal``. Masks must be identical as sets; the only differences tolerated are
those a float near-tie explains (see :func:`assert_same_selection`). The GPU runs of the whole
planning path are in tests/test_kernel_gpu_selection.py.
"""

from __future__ import annotations

import pytest
import torch

import pbs
from pbs.components import PermutationInputs, SelectionInputs, permuter_registry, selector_registry
from pbs.kernels.block_means import block_means
from pbs.kernels.block_sets import block_sets
from pbs.kernels.last_block import last_block_key_scores, last_block_permute, sort_segments
from pbs.kernels.selection import antidiagonal_select, heads_per_chunk, mean_pool_select
from pbs.kernels.threshold_select import empty_block_mask_tensors, threshold_select_rows
from pbs.layout import Layout
from pbs.permuters._segments import mean_attention_over_queries, scoring_queries, sort_within_segments
from pbs.reference.block_means import block_means as reference_block_means
from pbs.planning import build_plan, finalize_selection, make_layout
from pbs.reference.block_sets import forced_blocks
from pbs.reference.threshold_select import select_by_cumulative_threshold
from pbs.selectors.antidiagonal import antidiagonal_block_scores
from pbs.selectors.mean_pool import mean_pool_block_scores
from pbs.selectors.sampled_rows import sampled_block_mass
from pbs.types import BlockMask, Permutation

CPU_CASES = {
    # batch, heads_q, heads_kv, seq_len, seq_len_q, head_dim, block, segment, gqa
    "full_segments": (1, 2, 2, 256, None, 32, 32, 64, "shared"),
    # batch 2, GQA groups of 2, a partial last segment of 44 keys
    "partial_segment": (2, 2, 1, 300, None, 32, 32, 64, "shared"),
    # Nq < Nk with an offset (170) that is not a multiple of the block, per-head GQA
    "offset_per_head": (2, 2, 1, 300, 130, 16, 32, 64, "per_head"),
    # a one-key last segment, block 16
    "one_key_tail": (1, 2, 1, 257, None, 48, 16, 64, "shared"),
}
NO_FULL_SEGMENT = (1, 2, 1, 50, None, 16, 16, 64, "per_head")


def _config(block, segment, gqa, **extra):
    return pbs.PBSConfig(block_size=block, segment_size=segment, gqa=gqa, **extra)


def _qkv(case, dtype=torch.float32):
    b, hq, hkv, n, nq, d, _, _, _ = case
    return pbs.testing.make_qkv(batch=b, heads_q=hq, heads_kv=hkv, seq_len=n, seq_len_q=nq, head_dim=d, dtype=dtype)


def _permutation_inputs(case, dtype, **config_extra):
    q, k, v = _qkv(case, dtype)
    block, segment, gqa = case[6:]
    config = _config(block, segment, gqa, **config_extra)
    layout = make_layout(q, k, config)
    return q, k, v, config, PermutationInputs(q=q, k=k, layout=layout, gqa=gqa, scale=q.shape[-1] ** -0.5)


def reference_key_scores(inputs: PermutationInputs, causal: bool) -> torch.Tensor:
    """Eq. 3 scores of the reference (``causal=False``: full-segment keys only, no mask)."""
    layout = inputs.layout
    m = min(layout.seq_len_q, layout.block_size)
    slots = torch.arange(layout.seq_len_q - m, layout.seq_len_q, device=inputs.q.device)
    keys = inputs.k if causal else inputs.k[:, :, : layout.permutable_key_len]
    return mean_attention_over_queries(
        scoring_queries(inputs)[:, :, slots], slots + layout.query_offset, keys, inputs.scale, causal
    )


# -- comparison helpers (also used by tests/test_kernel_gpu_selection.py) ------------------------
def assert_same_key_order(actual: Permutation, expected: Permutation, scores: torch.Tensor, rtol: float = 1e-5):
    """Equal key orders, except slots whose keys' ``scores`` (the reference's, ``(B, H, L)`` over
    the scored prefix) are equal up to float rounding: only a near-tie may swap two keys."""
    a, e = actual.indices, expected.indices
    assert a.shape == e.shape
    n = a.shape[-1]
    arange = torch.arange(n, device=a.device).expand_as(a)
    assert torch.equal(actual.inverse.gather(-1, a), arange), "inverse does not invert"
    assert torch.equal(a.sort(-1).values, arange), "not a bijection"
    length = scores.shape[-1]
    assert torch.equal(a[..., length:], e[..., length:]), "keys past the full segments must stay in place"
    differ = a[..., :length] != e[..., :length]
    if differ.any():
        sa, se = scores.gather(-1, a[..., :length]), scores.gather(-1, e[..., :length])
        close = (sa - se).abs() <= rtol * se.abs().clamp(min=1e-30)
        assert close[differ].all(), f"{int((differ & ~close).sum())} slots hold a key of a clearly different score"
        assert differ.float().mean() < 0.02, "near-ties explain a few swaps, not this many"


def assert_same_selection(
    actual: BlockMask | torch.Tensor,
    expected: BlockMask | torch.Tensor,
    scores: torch.Tensor,
    candidates: torch.Tensor,
    threshold: float,
    ranked_first: torch.Tensor | None = None,
    atol: float = 1e-6,
    rtol: float = 1e-5,
):
    """``actual`` and ``expected`` are the same sets of blocks, up to float near-ties.

    Outside the candidates (forced and excluded blocks) the masks must be identical. A row may
    differ on its non-forced candidates only when every differing block's reference score is, up
    to ``atol + rtol * score``, the score at the reference's cut (a tie at the cut), or the score
    just past it while the reference's cumulative sum at the cut is that close to ``threshold``
    (rounding moved the cut by one block); the kept counts then differ by at most one.

    Args:
        actual, expected: BlockMasks, or dense ``(..., Tq, Tk)`` bool masks.
        scores: ``(..., Tq, Tk)`` the reference's block scores of the selection.
        candidates: ``(Tq, Tk)`` bool, the ranked blocks.
        ranked_first: as in :func:`select_by_cumulative_threshold` (forced-first mode).
    """
    got = actual.to_dense() if isinstance(actual, BlockMask) else actual
    want = expected.to_dense() if isinstance(expected, BlockMask) else expected
    assert got.shape == want.shape
    cand = candidates.to(got.device).expand_as(got)
    outside = ~cand
    assert torch.equal(got & outside, want & outside), "forced or excluded blocks differ"
    rows = ((got ^ want) & cand).any(-1).nonzero().tolist()
    first = ranked_first.to(got.device).expand_as(got) & cand if ranked_first is not None else torch.zeros_like(cand)
    for idx in rows:
        idx = tuple(idx)
        s, c, f = scores[idx].double().cpu(), cand[idx].cpu(), first[idx].cpu()
        g, w = got[idx].cpu() & c & ~f, want[idx].cpu() & c & ~f
        ranking = s.masked_fill(~c, float("-inf")) + 2.0 * f
        order = ranking.argsort(descending=True, stable=True)
        ranked = s.masked_fill(~c, 0.0)[order]
        cumulative = ranked.cumsum(0)
        kept = int((want[idx].cpu() & c).sum())  # reference's kept candidates (forced ones included)
        tol = lambda x: atol + rtol * abs(x)  # noqa: E731
        boundary = [float(ranked[kept - 1])] if kept >= 1 else []
        if kept >= 1 and abs(float(cumulative[kept - 1]) - threshold) <= tol(threshold) and kept < int(c.sum()):
            boundary.append(float(ranked[kept]))
        if kept >= 2 and abs(float(cumulative[kept - 2]) - threshold) <= tol(threshold):
            boundary.append(float(ranked[kept - 1]))
        differing = (g ^ w).nonzero().flatten().tolist()
        explained = all(any(abs(float(s[j]) - b) <= tol(b) for b in boundary) for j in differing)
        assert explained and abs(int(g.sum()) - int(w.sum())) <= 1, (
            f"row {idx} differs away from any near-tie: blocks {differing}, "
            f"scores {[round(float(s[j]), 8) for j in differing]}, cut at {boundary}"
        )


def reference_scores(selector, inputs: SelectionInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(scores, candidates, ranked_first)`` of the reference selector on ``inputs``."""
    layout = inputs.layout
    candidates = inputs.candidate_blocks()
    if selector.name == "mean_pool":
        return mean_pool_block_scores(inputs), candidates, None
    if selector.name == "sampled_rows":
        forced = forced_blocks(layout, inputs.key_positions, inputs.force_sink_block)
        return sampled_block_mass(inputs, selector.rows_per_block), inputs.allowed_blocks(), forced
    scores = antidiagonal_block_scores(inputs, selector.stride)
    first = None if layout.segmented else forced_blocks(layout, inputs.key_positions, inputs.force_sink_block)
    return scores, candidates, first


def reference_mask(selector, inputs: SelectionInputs) -> BlockMask:
    """The reference selector's finished mask on ``inputs``."""
    selected = selector.select(inputs)
    return finalize_selection(selected, inputs.layout, inputs.key_positions, inputs.force_sink_block)


def _selection_inputs(plan, q_perm, k, scale, permuted: bool) -> SelectionInputs:
    k_arg = plan.key_permutation.apply(k) if permuted else None
    return SelectionInputs(
        q_perm, k_arg, plan.layout, plan.query_positions(), plan.key_positions(), scale,
        source_k=k, key_permutation=plan.key_permutation,
    )


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


# -- last_block ------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CPU_CASES), ids=str)
@pytest.mark.parametrize(
    "dtype, causal", [(torch.float32, False), (torch.float32, True), (torch.float16, False)],
    ids=["fp32-eq3", "fp32-causal", "fp16-eq3"],
)
def test_last_block_scores_match_reference(case, dtype, causal):
    q, k, _, config, inputs = _permutation_inputs(CPU_CASES[case], dtype)
    layout = inputs.layout
    expected = reference_key_scores(inputs, causal)
    actual = last_block_key_scores(inputs, min(layout.seq_len_q, layout.block_size), causal=causal)
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
    q, k, _, config, inputs = _permutation_inputs(
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
    q, k, _, config, inputs = _permutation_inputs(NO_FULL_SEGMENT, torch.float32)
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


# -- threshold selection ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "segmented, forced_first", [(True, False), (False, False), (False, True)],
    ids=["segmented", "unsegmented", "forced_first"],
)
def test_threshold_select_exact_ties_and_forced_blocks(segmented, forced_first):
    # Two heads of exactly tied / two-level shares over the candidates, a partial last segment
    # (Nk = 480, segment 128) and a sink that moved to block 1: the kept sets must match exactly.
    q, k, _ = pbs.testing.make_qkv(batch=1, heads_q=2, heads_kv=1, seq_len=480, head_dim=16)
    config = _config(64, 128, "shared", permuter="last_block" if segmented else "none")
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
    layout = make_layout(q, k, _config(64, 128, "shared"))
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
    q, k, _ = _qkv(CPU_CASES[case], dtype)
    block, segment, gqa = CPU_CASES[case][6:]
    config = _config(
        block, segment, gqa, permuter=permuter, causal=causal,
        selector={"name": selector, "threshold": threshold, **({"stride": 8} if selector == "antidiagonal" else {})},
    )
    scale = q.shape[-1] ** -0.5
    plan, q_perm, _, _ = build_plan(q, k, config, scale)
    assert plan.layout.segmented == (permuter != "none")
    inputs = _selection_inputs(plan, q_perm, k, scale, permuted=False)
    run = mean_pool_select if selector == "mean_pool" else antidiagonal_select
    actual = run(config.selector, inputs)
    if not plan.key_permutation.is_identity:
        assert not inputs.has_permuted_k  # K was read through the permutation, never gathered
    assert actual.indices.dtype == plan.mask.indices.dtype
    reference_inputs = _selection_inputs(plan, q_perm, k, scale, permuted=True)
    scores, candidates, first = reference_scores(config.selector, reference_inputs)
    assert_same_selection(actual, plan.mask, scores, candidates, threshold, ranked_first=first)


def test_unsegmented_antidiagonal_counts_forced_blocks_first():
    # With a low threshold the forced sink and diagonal blocks alone reach tau in most rows, so
    # XAttention's rule keeps little else; Algorithm 2's rule (forced mass not counted) keeps more.
    q, k, _ = _qkv(CPU_CASES["partial_segment"])
    config = _config(32, 64, "shared", permuter="none", selector={"name": "antidiagonal", "threshold": 0.3})
    scale = q.shape[-1] ** -0.5
    plan, q_perm, _, _ = build_plan(q, k, config, scale)
    inputs = _selection_inputs(plan, q_perm, k, scale, permuted=False)
    actual = antidiagonal_select(config.selector, inputs)
    reference_inputs = _selection_inputs(plan, q_perm, k, scale, permuted=True)
    scores, candidates, first = reference_scores(config.selector, reference_inputs)
    assert_same_selection(actual, plan.mask, scores, candidates, 0.3, ranked_first=first)
    not_first = finalize_selection(
        select_by_cumulative_threshold(scores, candidates, 0.3), plan.layout, plan.key_positions(), True
    )
    assert actual.counts.sum() < not_first.counts.sum()


def test_select_in_several_head_chunks(monkeypatch):
    case = (1, 4, 2, 300, None, 32, 32, 64, "shared")
    q, k, _ = _qkv(case)
    config = _config(32, 64, "shared")
    plan, q_perm, _, _ = build_plan(q, k, config, 32**-0.5)
    inputs = _selection_inputs(plan, q_perm, k, 32**-0.5, permuted=False)
    layout = plan.layout
    per_head = layout.batch * layout.num_query_blocks * layout.num_key_blocks * 4
    assert heads_per_chunk(inputs, chunk_bytes=per_head) == 1
    assert heads_per_chunk(inputs, chunk_bytes=1) == 1
    whole = mean_pool_select(config.selector, inputs)
    # Chunks of 3 heads split the GQA groups of 2: the pooled keys must follow each query head.
    monkeypatch.setattr("pbs.kernels.selection.SCORE_CHUNK_BYTES", per_head * 3)
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
    q, k, _ = _qkv(case)
    config = _config(*case[6:], permuter=permuter, selector=selector)
    reference = pbs.plan(q, k, config)
    calls = []
    for registry, component in ((permuter_registry, config.permuter), (selector_registry, config.selector)):
        impl = registry.implementation(component, "triton")
        if impl is not None:
            spy = lambda c, i, impl=impl, n=component.name: calls.append(n) or impl(c, i)  # noqa: E731
            monkeypatch.setitem(registry._impls, (component.name, "triton"), spy)
    monkeypatch.setattr("pbs.planning.planning_implementation", lambda backend, device: "triton")
    fast = pbs.plan(q, k, config)
    assert selector in calls
    assert (config.permuter.name in calls) == (config.permuter.name == "last_block")
    assert torch.equal(fast.key_permutation.indices, reference.key_permutation.indices)
    scale = q.shape[-1] ** -0.5
    inputs = _selection_inputs(reference, reference.query_permutation.apply(q), k, scale, permuted=True)
    scores, candidates, first = reference_scores(config.selector, inputs)
    assert_same_selection(fast.mask, reference.mask, scores, candidates, config.selector.threshold, ranked_first=first)
