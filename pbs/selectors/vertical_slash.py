"""``vertical_slash``: key blocks from the vertical and slash lines of the last queries' attention.

Pooled estimators (``mean_pool``, ``antidiagonal``) score a block by what its *average* query sees.
A query that copies from far back (an induction head reading a repeated passage) attends to one
key at a fixed distance, a different key for every query: averaged over a block that looks like
nothing, yet summed over queries it is a straight line of constant offset (a *slash*). Keys that
every query reads (the sink, a retrieved fact) are *vertical* lines. MInference and FlexPrefill
found that these two shapes hold most of the attention of long prompts, and that the last queries
of the prompt show both: this selector computes the exact softmax of the last ``last_rows``
queries (the same rows the ``last_block`` permuter scores), sums it per key (vertical score) and per
query-key offset (slash score), keeps the fewest keys and the fewest offsets whose shares reach
``threshold`` each, and selects every key block that holds a kept key or that a kept offset
crosses, plus the forced blocks (sink and on-diagonal segment).

Cost: ``last_rows`` rows of the query-key product (the ``last_block`` permuter's own cost), two
sorts of ``Nk`` scores per head and a pass over the ``(Tq, Tk)`` blocks; no per-block scoring.

Offsets and keys are in *original* positions. A block crossed by a kept offset is found from the
smallest and largest position its query and key slots hold: exact for unpermuted layouts,
conservative for permuted ones (a permuted block's positions are not contiguous).
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from pbs.components import SelectionInputs, SelectorConfig, register_selector
from pbs.reference.logits import grouped_logits
from pbs.reference.threshold_select import cumsum_long_rows, select_by_cumulative_threshold

# Score rows held at once (float32): bounded on the CPU, where memory is shared with the model;
# on the GPU fewer, larger chunks save launches.
_CHUNK_ELEMENTS = 1 << 24
_CHUNK_ELEMENTS_CUDA = 1 << 27


def last_rows_queries(inputs: SelectionInputs, last_rows: int, heads: slice) -> tuple[torch.Tensor, int]:
    """The last ``last_rows`` queries by original position, in position order, times the softmax scale.

    Returns:
        ``(queries, last_position)``: ``(B, h, R, D)`` float32 for the query heads ``heads``, and the
        last row's original position.
    """
    layout = inputs.layout
    nq = layout.seq_len_q
    q = inputs.q[:, heads]
    rows = min(last_rows, nq)
    # Query positions are a permutation of query_offset .. query_offset + Nq - 1: the slots of the
    # last R positions come from inverting it (a scatter, cheaper than a top-k on the GPU).
    positions = inputs.query_positions[:, heads] - layout.query_offset
    slot_of = torch.empty_like(positions)
    slot_of.scatter_(-1, positions, torch.arange(nq, device=q.device).expand_as(positions))
    slots = slot_of[..., nq - rows:]
    queries = q.gather(2, slots[..., None].expand(-1, -1, -1, q.shape[-1])).float() * inputs.scale
    return queries, layout.query_offset + nq - 1


def last_rows_attention(
    inputs: SelectionInputs, last_rows: int, heads: slice, reversed_source_k: torch.Tensor | None = None
) -> tuple[torch.Tensor, int]:
    """Exact softmax of the last ``last_rows`` queries (by original position) over every key, with
    the keys in *reversed* original order (entry ``x`` is key ``Nk - 1 - x``: the layout the slash
    scores read without a copy).

    ``heads`` must cover whole GQA groups of ``layout.heads_kv``. With ``reversed_source_k``
    (``inputs.source_k`` flipped along the keys, ``(B, Hkv, Nk, D)``) neither a permuted copy of K
    nor a scatter back is needed; without it the permuted keys are scattered to their positions.

    Returns:
        ``(probs, last_position)``: ``(B, h, R, Nk)`` float32 for the query heads ``heads``, rows in
        position order, and the last row's original position.
    """
    layout = inputs.layout
    nk = layout.seq_len_k
    q_last, last_position = last_rows_queries(inputs, last_rows, heads)
    rows = q_last.shape[2]
    keys = reversed_source_k if reversed_source_k is not None else inputs.k
    group = layout.heads_q // keys.shape[1]
    kv_heads = slice(heads.start // group, heads.stop // group)
    logits = grouped_logits(q_last, keys[:, kv_heads])  # (B, h, R, Nk)
    if reversed_source_k is None:
        key_pos = inputs.key_positions[:, kv_heads]
        if group > 1:
            key_pos = key_pos.repeat_interleave(group, dim=1)
        reversed_pos = (nk - 1 - key_pos)[:, :, None, :].expand_as(logits)
        logits = torch.empty_like(logits).scatter_(-1, reversed_pos, logits)
    if layout.causal:
        # Entry x is key Nk - 1 - x, in the future of row r when x < Nk - 1 - position(r).
        row_pos = torch.arange(last_position - rows + 1, last_position + 1, device=q_last.device)
        future = torch.arange(nk, device=q_last.device)[None, :] < (nk - 1 - row_pos)[:, None]
        logits = logits.masked_fill_(future, float("-inf"))
    return logits.softmax(-1), last_position


def vertical_and_slash_scores(probs: torch.Tensor, last_position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-key and per-offset shares of the rows' attention.

    Args:
        probs: ``(B, h, R, Nk)`` softmax rows, keys at their original positions; row ``r`` is the
            query at position ``last_position - (R - 1 - r)`` (the last ``R`` queries, in order).
        last_position: original position of the last row, at most ``Nk - 1``.

    Returns:
        ``(vertical, slash)``, each ``(B, h, Nk)`` float32 summing to 1: ``vertical[c]`` is the mean
        over rows of the attention to key ``c``; ``slash[o]`` that to the key ``o`` positions before
        the row.
    """
    return _scores_of_reversed_rows(probs.flip(-1), last_position)


def _scores_of_reversed_rows(reversed_probs: torch.Tensor, last_position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`vertical_and_slash_scores` of rows whose keys are in reversed order."""
    b, h, rows, nk = reversed_probs.shape
    if not 0 <= nk - 1 - last_position:
        raise ValueError(f"last_position ({last_position}) must be below the key count ({nk})")
    vertical = reversed_probs.mean(-2).flip(-1)
    lag = nk - 1 - last_position
    padded = torch.nn.functional.pad(reversed_probs, (0, rows + lag))
    return vertical, slash_of_padded_rows(padded, nk, last_position)


def slash_of_padded_rows(padded: torch.Tensor, seq_len_k: int, last_position: int) -> torch.Tensor:
    """Per-offset mean over rows of ``padded``: ``(B, h, R, Nk + R + lag)`` rows with the keys
    reversed in the first ``Nk`` entries and zeros after (``lag = Nk - 1 - last_position``).

    Reading along offsets is a skewed view: with keys reversed (x = Nk - 1 - key), the key at
    offset o of row r sits at x = lag + (R - 1 - r) + o, so a row stride of (L - 1) over rows of
    length L walks the offsets of every row in step, with no index tensor. The zero padding is
    what a row reads past its first key.
    """
    b, h, rows, length = padded.shape
    lag = seq_len_k - 1 - last_position
    if length != seq_len_k + rows + lag or not padded.is_contiguous():
        raise ValueError(f"padded must be contiguous with rows of Nk + R + lag = {seq_len_k + rows + lag} entries")
    along = padded.as_strided(
        (b, h, rows, seq_len_k), (h * rows * length, rows * length, length - 1, 1), padded.storage_offset() + rows - 1 + lag
    )
    return along.mean(-2)


def kept_lines(vertical: torch.Tensor, slash: torch.Tensor, threshold: float,
               vertical_threshold: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The fewest keys and the fewest offsets whose shares reach their thresholds (Algorithm 2's
    cumulative rule, `select_by_cumulative_threshold`, over keys and offsets instead of blocks).

    Returns:
        ``(keys, offsets)``, each ``(B, h, Nk)`` bool; zero scores are never kept.
    """
    keys = select_by_cumulative_threshold(vertical, vertical > 0, vertical_threshold or threshold)
    offsets = select_by_cumulative_threshold(slash, slash > 0, threshold)
    return keys, offsets


def offset_prefix(offsets: torch.Tensor) -> torch.Tensor:
    """``(B, h, Nk + 1)`` int32 running count of kept offsets, 0 first: the kept offsets in
    ``[lo, hi)`` are ``prefix[hi] - prefix[lo]``."""
    return torch.nn.functional.pad(cumsum_long_rows(offsets, torch.int32), (1, 0))


def blocks_of_lines(
    keys: torch.Tensor, offsets: torch.Tensor, inputs: SelectionInputs, heads: slice
) -> torch.Tensor:
    """Key blocks that hold a kept key or that a kept offset crosses.

    Args:
        keys: ``(B, h, Nk)`` bool, kept keys by original position.
        offsets: ``(B, h, Nk)`` bool, kept query-key offsets.

    Returns:
        ``(B, h, Tq, Tk)`` bool (not yet restricted to the allowed blocks).
    """
    layout = inputs.layout
    bs, tq, tk, nk = layout.block_size, layout.num_query_blocks, layout.num_key_blocks, layout.seq_len_k
    device = keys.device
    key_pos = inputs.key_positions
    group = layout.heads_q // key_pos.shape[1]
    if group > 1:
        key_pos = key_pos.repeat_interleave(group, dim=1)
    key_pos = key_pos[:, heads]
    kept_slot = keys.gather(-1, key_pos)  # (B, h, Nk) in slot order
    pad = tk * bs - nk
    vertical = torch.nn.functional.pad(kept_slot, (0, pad)).view(*kept_slot.shape[:2], tk, bs).any(-1)

    # Offsets o with query block i and key block j: o in [q_lo(i) - k_hi(j), q_hi(i) - k_lo(j)],
    # from the positions the blocks really hold (exact for contiguous blocks).
    q_lo, q_hi = _block_position_ranges(inputs.query_positions[:, heads], bs)
    k_lo, k_hi = _block_position_ranges(key_pos, bs)
    lo = (q_lo[..., :, None] - k_hi[..., None, :]).clamp(min=0, max=nk)
    hi = (q_hi[..., :, None] - k_lo[..., None, :] + 1).clamp(min=0, max=nk)
    prefix = offset_prefix(offsets)
    flat = prefix.shape[:2] + (tq * tk,)
    count = prefix.gather(-1, hi.reshape(flat)) - prefix.gather(-1, lo.reshape(flat))
    slash = (count > 0).view(*prefix.shape[:2], tq, tk)
    return slash | vertical[:, :, None, :]


def _block_position_ranges(positions: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Smallest and largest original position in each block of slots: ``(B, h, T)`` each."""
    n = positions.shape[-1]
    blocks = -(-n // block_size)
    pad = blocks * block_size - n
    shape = positions.shape[:-1] + (blocks, block_size)
    # Padding slots repeat the last real slot, which changes neither extreme.
    padded = torch.cat([positions, positions[..., -1:].expand(*positions.shape[:-1], pad)], dim=-1)
    return padded.view(shape).amin(-1), padded.view(shape).amax(-1)


@register_selector
class VerticalSlashSelector(SelectorConfig):
    """Blocks on the vertical and slash lines of the last queries' exact attention.

    Attributes:
        threshold: share of the last rows' attention the kept offsets (slash lines) must reach, in
            ``(0, 1]``; also the kept keys' share unless ``vertical_threshold`` is given.
        vertical_threshold: share the kept keys (vertical lines) must reach; None: ``threshold``.
        last_rows: how many of the last queries (by original position) are scored.
    """

    name: Literal["vertical_slash"] = "vertical_slash"
    knob: ClassVar[str | None] = "threshold"
    sequence_summaries: ClassVar[frozenset[str] | None] = frozenset({"line_scores"})
    threshold: float = Field(0.9, gt=0.0, le=1.0)
    vertical_threshold: float | None = Field(None, gt=0.0, le=1.0)
    last_rows: int = Field(64, ge=1)

    def select(self, inputs: SelectionInputs) -> torch.Tensor:
        layout = inputs.layout
        b, hq = layout.batch, layout.heads_q
        summaries = inputs.summaries
        if summaries is not None and summaries.line_scores is not None:
            # A chunk of a longer sequence: the lines are kept over the whole sequence's scores,
            # then the call's own keys and offsets (both below its Nk) are mapped to its blocks.
            scores, nk = summaries.line_scores, layout.seq_len_k
            keys, offsets = kept_lines(scores[0], scores[1], self.threshold, self.vertical_threshold)
            return blocks_of_lines(keys[..., :nk], offsets[..., :nk], inputs, slice(0, hq))
        group = hq // layout.heads_kv
        per_head = max(1, b * min(self.last_rows, layout.seq_len_q) * layout.seq_len_k)
        budget = _CHUNK_ELEMENTS_CUDA if inputs.q.is_cuda else _CHUNK_ELEMENTS
        heads_per_chunk = max(group, (budget // per_head) // group * group)
        reversed_source_k = inputs.source_k.flip(2) if inputs.source_k is not None else None
        selected = torch.empty(b, hq, layout.num_query_blocks, layout.num_key_blocks, dtype=torch.bool,
                               device=inputs.q.device)
        for h0 in range(0, hq, heads_per_chunk):
            heads = slice(h0, min(hq, h0 + heads_per_chunk))
            probs, last_position = last_rows_attention(inputs, self.last_rows, heads, reversed_source_k)
            vertical, slash = _scores_of_reversed_rows(probs, last_position)
            del probs
            keys, offsets = kept_lines(vertical, slash, self.threshold, self.vertical_threshold)
            selected[:, heads] = blocks_of_lines(keys, offsets, inputs, heads)
        # Planning adds the forced blocks and drops those wholly in the future (finalize_selection).
        return selected
