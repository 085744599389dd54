"""The ``triton`` planners: permuter and selector configs turned into launches of `pbs.kernels`.

Each planner takes ``(config, inputs)`` like the component's reference method and returns the
same result (`Permutations`, or a `BlockMask` with the forced blocks): the differential tests hold
each to its reference. The registrations at the bottom are the one line a new component with a
GPU kernel adds (see docs/contributing.md). Kernels are imported inside the planners, so that
``import pbs`` does not import Triton.

The score-based selectors (``mean_pool``, ``antidiagonal``, ``sampled_rows``) score one chunk of
query heads at a time into a bounded fp32 buffer and hand it to the row kernel of
`pbs.kernels.threshold_select`, so the float scores of all heads never exist at once
(``Hq * Tq * Tk * 4`` bytes would be 2 GiB at 512K tokens). They follow the reference selectors:

* ``mean_pool``: softmax of the pooled logits over the candidate blocks (allowed minus the
  on-diagonal segment, or every allowed block for the unsegmented ``none`` permuter), cumulative
  threshold over the candidates, then the forced blocks (diagonal set and sink) added;
* ``antidiagonal``, segmented layout: the strided softmax sees only strided keys of candidate
  blocks, then the same threshold and forced blocks;
* ``antidiagonal``, unsegmented layout (XAttention's estimator): the strided softmax has a causal
  mask at the strided level, and the forced blocks rank first and count first towards ``tau``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pbs.backends.registry import register_planner
from pbs.components import PermutationInputs, Permutations, SelectionInputs
from pbs.kernels._common import interpreting
from pbs.reference.block_sets import finalize_selection
from pbs.selectors.mean_pool import pooled_keys
from pbs.types import BlockMask, Permutation

FAMILY = "triton"

SCORE_CHUNK_BYTES = 64 * 1024 * 1024
"""Upper bound on the fp32 score buffer of one head chunk."""


def last_block_permute(config, inputs: PermutationInputs) -> Permutations:
    """`LastBlockPermuter`: ``config.causal_scoring`` (on a causal layout) selects the causal
    rule; the default is Eq. 3."""
    from pbs.kernels.last_block import last_block_key_scores, sort_segments

    layout = inputs.layout
    if layout.permutable_key_len == 0:
        return Permutations(keys=None)
    causal = bool(config.causal_scoring) and layout.causal
    m = min(layout.seq_len_q, config.num_queries or layout.block_size)
    scores = last_block_key_scores(inputs.q, inputs.k, layout, inputs.gqa, inputs.scale, m, causal=causal)
    return Permutations(keys=sort_segments(scores, layout.segment_size, total_len=layout.seq_len_k))


def heads_per_chunk(inputs: SelectionInputs, chunk_bytes: int | None = None) -> int:
    """Query heads scored together: as many as fit ``chunk_bytes`` (default
    `SCORE_CHUNK_BYTES`), at least one."""
    layout = inputs.layout
    chunk_bytes = SCORE_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    per_head = layout.batch * layout.num_query_blocks * layout.num_key_blocks * 4
    return max(1, min(layout.heads_q, chunk_bytes // max(1, per_head)))


def permuted_key_rows(inputs: SelectionInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Keys to read and the indices to read them through (None when ``k`` is already permuted).

    Paged keys come gathered: the planners that read pages in place (``mean_pool``'s block means,
    ``vertical_slash``'s line scores) take ``inputs.paged_k`` before they ask here."""
    if inputs.paged_k is not None:
        return inputs.k, None
    if inputs.has_permuted_k or inputs.source_k is None or inputs.key_permutation is None:
        return inputs.k, None
    if inputs.key_permutation.is_identity and inputs.source_k.shape[1] == inputs.key_positions.shape[1]:
        return inputs.source_k, None
    return inputs.source_k, inputs.key_positions


def select_in_head_chunks(
    inputs: SelectionInputs,
    threshold: float,
    score_chunk: Callable[[int, int, torch.Tensor], torch.Tensor],
    from_logits: bool,
    logit_scale: float = 1.0,
    forced_first: bool = False,
    rank_allowed: bool = False,
    heads_step: int | None = None,
) -> BlockMask:
    """Runs ``score_chunk(h0, h1, candidates) -> (B, h1 - h0, Tq, Tk) float32`` per head chunk, then selects.

    ``candidates`` is the layout's ``(Tq, Tk)`` candidate set (`pbs.kernels.block_sets.block_sets`),
    over which shares must sum to one. The sink block and the diagonal set are forced here, as
    `finalize_selection` does for the reference selectors; ``forced_first`` ranks them first (see
    `pbs.kernels.threshold_select.threshold_select_rows`). ``rank_allowed`` ranks every allowed
    block instead of the candidates (selectors that score the forced blocks too); ``heads_step``
    overrides the number of heads scored per chunk.
    """
    from pbs.kernels.block_sets import block_sets
    from pbs.kernels.threshold_select import empty_block_mask_tensors, threshold_select_rows

    layout = inputs.layout
    device = inputs.q.device
    counts, indices = empty_block_mask_tensors(layout, device)
    sets = block_sets(layout, device)
    inverse = None
    if inputs.force_sink_block:
        perm = inputs.key_permutation or Permutation.from_indices(inputs.key_positions)
        inverse = perm.inverse
    ranked = sets.allowed if rank_allowed else sets.candidates
    step = heads_step or heads_per_chunk(inputs)
    for h0 in range(0, layout.heads_q, step):
        h1 = min(layout.heads_q, h0 + step)
        scores = score_chunk(h0, h1, ranked)
        threshold_select_rows(
            scores, layout, threshold, counts, indices, head_offset=h0, key_inverse=inverse,
            from_logits=from_logits, logit_scale=logit_scale, candidates=ranked,
            diagonal=sets.diagonal, forced_first=forced_first,
        )
    return BlockMask(counts=counts, indices=indices, layout=layout)


def mean_pool_select(config, inputs: SelectionInputs) -> BlockMask:
    """`MeanPoolSelector`."""
    from pbs.kernels.block_means import block_means

    layout = inputs.layout
    q_bar = block_means(inputs.q, layout.block_size)  # (B, Hq, Tq, D)
    k_bar = pooled_keys(inputs)  # the whole sequence's, when the call plans a chunk of one
    paged = inputs.paged_k
    if k_bar is None and paged is not None:
        k_bar = block_means(paged.cache, layout.block_size, block_table=paged.block_table, seq_len=paged.length)
    if k_bar is None:
        k_rows, k_indices = permuted_key_rows(inputs)
        k_bar = block_means(k_rows, layout.block_size, k_indices)  # (B, Hk, Tk, D)

    def logits(h0: int, h1: int, candidates: torch.Tensor) -> torch.Tensor:
        # The softmax over the candidates is taken by the threshold kernel.
        return pooled_logits(q_bar, k_bar, h0, h1)

    return select_in_head_chunks(inputs, config.threshold, logits, from_logits=True, logit_scale=inputs.scale)


def pooled_logits(q_bar: torch.Tensor, k_bar: torch.Tensor, h0: int, h1: int) -> torch.Tensor:
    """``(B, h1 - h0, Tq, Tk)`` float32 logits of the pooled queries ``q_bar (B, Hq, Tq, D)`` of
    heads ``[h0, h1)`` against their KV heads' pooled keys ``k_bar (B, Hk, Tk, D)``.

    Each query head's pooled keys are gathered first (``(B, h, Tk, D)``, small next to the
    scores), so that K is never expanded to every query head. The eager and the ragged
    (capturable) planners share it.
    """
    group = q_bar.shape[1] // k_bar.shape[1]
    heads = torch.arange(h0, h1, device=k_bar.device) // group
    keys = k_bar.index_select(1, heads) if group > 1 else k_bar[:, h0:h1]
    return torch.matmul(q_bar[:, h0:h1], keys.transpose(-1, -2))


def antidiagonal_select(config, inputs: SelectionInputs) -> BlockMask:
    """`AntidiagonalSelector`."""
    from pbs.kernels.antidiagonal import antidiagonal_block_shares

    layout = inputs.layout
    k_rows, k_indices = permuted_key_rows(inputs)

    def shares(h0: int, h1: int, candidates: torch.Tensor) -> torch.Tensor:
        # Segmented: the softmax sees the candidate blocks only. Unsegmented: the candidates are
        # the allowed blocks, and the kernel adds XAttention's strided causal mask.
        return antidiagonal_block_shares(
            inputs.q, k_rows, layout, config.stride, inputs.scale, key_indices=k_indices,
            head_start=h0, head_stop=h1, allowed=candidates,
            strided_causal=layout.causal and not layout.segmented,
        )

    return select_in_head_chunks(
        inputs, config.threshold, shares, from_logits=False, forced_first=not layout.segmented
    )


def sampled_rows_select(config, inputs: SelectionInputs) -> BlockMask:
    """`SampledRowsSelector`: like the reference, it ranks every allowed block, the forced ones
    (sink, on-diagonal segment) first with their estimated mass counting towards the threshold."""
    from pbs.kernels.sampled_rows import heads_per_scratch, sampled_block_shares

    k_rows, k_indices = permuted_key_rows(inputs)
    rows = config.rows_per_block

    def shares(h0: int, h1: int, allowed: torch.Tensor) -> torch.Tensor:
        return sampled_block_shares(
            inputs.q, k_rows, inputs.query_positions, inputs.key_positions, inputs.layout, rows,
            inputs.scale, allowed, key_indices=k_indices, head_start=h0, head_stop=h1,
        )

    return select_in_head_chunks(
        inputs, config.threshold, shares, from_logits=False, forced_first=True, rank_allowed=True,
        heads_step=heads_per_scratch(inputs.layout, rows),
    )


def lines_fast_path(inputs: SelectionInputs) -> bool:
    """Whether the line kernels apply: an unsegmented layout with keys and queries in their
    original order, on CUDA or in the interpreter."""
    if inputs.layout.segmented or (inputs.q.device.type != "cuda" and not interpreting()):
        return False
    perm = inputs.key_permutation
    return perm is None or perm.is_identity


def lines_block_mask(config, inputs: SelectionInputs, extra: BlockMask | None = None) -> tuple[BlockMask, torch.Tensor]:
    """`vertical_slash_select`'s fast path, with the vertical scores ``(B, Hq, Nk)`` it used.

    Args:
        extra: another selection of the same layout whose blocks are kept too (a `union`'s other
            member): merged while the lines are compacted.
    """
    from pbs.kernels.vertical_slash import kept_line_blocks, line_scores, lines_to_block_mask

    layout = inputs.layout
    summaries = inputs.summaries
    if summaries is not None and summaries.line_scores is not None:
        # A chunk of a longer sequence: lines kept over the whole sequence, then cut to the call's
        # keys (block and offset prefixes both start at position 0).
        scores = summaries.line_scores
        vertical_blocks, prefix = kept_line_blocks(scores, config.threshold, config.vertical_threshold,
                                                   layout.block_size)
        vertical_blocks = vertical_blocks[..., : layout.num_key_blocks].contiguous()
        prefix = prefix[..., : layout.seq_len_k + 1].contiguous()
        mask = lines_to_block_mask(vertical_blocks, prefix, layout, inputs.force_sink_block, extra)
        return mask, scores[0, ..., : layout.seq_len_k]
    paged = inputs.paged_k
    if paged is not None:
        scores = line_scores(inputs.q, paged.cache, layout, inputs.scale, config.last_rows,
                             block_table=paged.block_table)
    else:
        k = inputs.source_k if inputs.source_k is not None else inputs.k
        scores = line_scores(inputs.q, k, layout, inputs.scale, config.last_rows)
    vertical_blocks, prefix = kept_line_blocks(scores, config.threshold, config.vertical_threshold, layout.block_size)
    mask = lines_to_block_mask(vertical_blocks, prefix, layout, inputs.force_sink_block, extra)
    return mask, scores[0]


def vertical_slash_select(config, inputs: SelectionInputs, extra: BlockMask | None = None) -> BlockMask:
    """`VerticalSlashSelector` (its reference off the fast path, `lines_fast_path`)."""
    if not lines_fast_path(inputs):
        selected = config.select(inputs)
        if extra is not None:
            selected = selected | extra.to_dense()
        return finalize_selection(selected, inputs.layout, inputs.key_positions, inputs.force_sink_block)
    return lines_block_mask(config, inputs, extra)[0]


register_planner("permuter", "last_block", FAMILY)(last_block_permute)
register_planner("selector", "mean_pool", FAMILY)(mean_pool_select)
register_planner("selector", "antidiagonal", FAMILY)(antidiagonal_select)
register_planner("selector", "sampled_rows", FAMILY)(sampled_rows_select)
register_planner("selector", "vertical_slash", FAMILY)(vertical_slash_select)
