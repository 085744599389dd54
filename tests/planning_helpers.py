"""Shared cases and comparison helpers of the GPU planning tests (the CPU interpreter runs in
tests/test_block_sets.py, test_block_means.py, test_last_block.py, test_threshold_select.py and
test_selection.py; the GPU runs in tests/test_kernel_gpu_selection.py).

The semantics are the reference's: last_block scores by Eq. 3 (no mask, softmax over the
full-segment keys) unless ``causal_scoring``; the selectors rank the *candidate* blocks (allowed
minus the on-diagonal segment, the partial last segment included, or every allowed block for the
unsegmented ``none`` permuter); XAttention's forced-first rule for unsegmented ``antidiagonal``.
Masks must be identical as sets; the only differences tolerated are those a float near-tie explains
(`assert_same_selection`).
"""

from __future__ import annotations

import torch

import pbs
from pbs.components import PermutationInputs, SelectionInputs
from pbs.permuters._segments import mean_attention_over_queries, scoring_queries
from pbs.planning import make_layout
from pbs.reference.block_sets import finalize_selection
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


def case_config(block, segment, gqa, **extra):
    """The paper's components (``last_block`` + ``mean_pool``, a segmented layout) unless ``extra``
    names others: these cases test the paper's planning, whatever `PBSConfig`'s defaults are."""
    components = {"permuter": "last_block", "selector": "mean_pool"}
    return pbs.PBSConfig(block_size=block, segment_size=segment, gqa=gqa, **{**components, **extra})


def case_qkv(case, dtype=torch.float32):
    b, hq, hkv, n, nq, d, _, _, _ = case
    return pbs.testing.make_qkv(batch=b, heads_q=hq, heads_kv=hkv, seq_len=n, seq_len_q=nq, head_dim=d, dtype=dtype)


def case_permutation_inputs(case, dtype, **config_extra):
    q, k, v = case_qkv(case, dtype)
    block, segment, gqa = case[6:]
    config = case_config(block, segment, gqa, **config_extra)
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


def selection_inputs_of(plan, q_perm, k, scale, permuted: bool) -> SelectionInputs:
    k_arg = plan.key_permutation.apply(k) if permuted else None
    return SelectionInputs(
        q_perm, k_arg, plan.layout, plan.query_positions(), plan.key_positions(), scale,
        source_k=k, key_permutation=plan.key_permutation,
    )
