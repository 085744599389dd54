"""The ``ragged`` planner family: selectors and the density probe on a padded batch
(`pbs.ragged_layout.RaggedGeometry`), each sequence planned as it is planned alone, with its
lengths read from the device. `ragged_reasons` derives what the family cannot plan from what is
registered here, so no caller keeps a list of names.

These are the reference selectors' rules (``mean_pool``: `pbs.selectors.mean_pool`;
``vertical_slash``: `pbs.selectors.vertical_slash`; ``union``; the probe:
`pbs.reference.density_probe`) written over ``N`` sequences at once in PyTorch operations whose
shapes depend only on the padded maxima, so that a CUDA graph captured once replays them at new
lengths. A sequence's block scores are masked to its own grid, its pooled blocks average its own
tokens, and its line scores read its own last rows: padding never enters a score. The tests hold
every mask to `pbs.plan` of the sequence alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from pbs.backends.padding import pad_packed
from pbs.backends.planners import pooled_logits
from pbs.backends.registry import planner_for, planners_of, register_planner
from pbs.ragged_layout import RaggedGeometry
from pbs.reference.logits import grouped_logits
from pbs.reference.threshold_select import select_by_cumulative_threshold
from pbs.selectors.vertical_slash import kept_lines, offset_prefix
from pbs.types import BlockMask

RAGGED = "ragged"
"""The planner family of padded batches (`pbs.ragged_layout.RaggedGeometry`): a planner
``fn(selector, inputs: RaggedInputs)`` returns a `BlockMask` over the padded layout with the forced
blocks (the GPU kernels' lists), or the ``(N, Hq, Tq, Tk)`` bool selection before them
(`member_mask` finishes it), each sequence planned as it is alone."""

_SCORE_ELEMENTS = 1 << 26
"""Float32 scores held at once per head chunk (256 MiB)."""


def block_means(x: torch.Tensor, lengths: torch.Tensor, block_size: int, row_starts: torch.Tensor | None = None,
                padded_rows: int | None = None) -> torch.Tensor:
    """``(N, H, T, D)`` float32 means of the blocks of padded ``x (N, H, T * block_size, D)``; a
    sequence's partial last block averages the tokens it has (zeros past it are summed, not
    counted), and blocks past its end are 0. With ``row_starts`` (``cu_seq``), ``x`` is the packed
    ``(total, H, D)`` batch of ``padded_rows`` rows per padded entry (read in place on CUDA)."""
    if uses_gpu_planners(x.device):
        from pbs.kernels.block_means import block_means as block_means_kernel

        return block_means_kernel(x, block_size, lengths=lengths, row_starts=row_starts, padded_rows=padded_rows)
    if row_starts is not None:
        x = pad_packed(x, row_starts, padded_rows)
    n, h, rows, d = x.shape
    blocks = rows // block_size
    # Summed in the token-major order of the padded buffers (`pad_packed`), with no float32 copy.
    tokens = x.transpose(1, 2).reshape(n, blocks, block_size, h, d)
    sums = tokens.sum(2, dtype=torch.float32).transpose(1, 2)
    first = torch.arange(blocks, device=x.device) * block_size
    counts = (lengths[:, None] - first[None, :]).clamp(0, block_size).float()
    return sums / counts.clamp(min=1.0)[:, None, :, None]


def _head_chunk(heads_q: int, group: int, per_head: int) -> int:
    """Query heads scored at once: whole GQA groups within `_SCORE_ELEMENTS`."""
    return max(group, (_SCORE_ELEMENTS // max(1, per_head)) // group * group)


def mean_pool(selector, inputs: "RaggedInputs") -> BlockMask | torch.Tensor:
    """`MeanPoolSelector` per sequence.

    On CUDA the eager path's row kernel (`pbs.kernels.threshold_select.threshold_select_rows`,
    given each sequence's allowed and forced blocks, and its rows to plan) takes the softmax and
    the threshold and writes the lists, forced blocks included: a `BlockMask`. Elsewhere PyTorch
    operations give the ``(N, Hq, Tq, Tk)`` bool selection before the forced blocks.
    """
    geometry, scale = inputs.geometry, inputs.scale
    q_bar, k_bar = inputs.pooled
    n, hq, tq, _ = q_bar.shape
    tk = k_bar.shape[2]
    group = hq // k_bar.shape[1]
    kernel = uses_gpu_planners(q_bar.device)
    if kernel:
        from pbs.kernels.threshold_select import empty_block_mask_tensors, threshold_select_rows

        layout = geometry.layout(hq, k_bar.shape[1])
        counts, indices = empty_block_mask_tensors(layout, q_bar.device)
    else:
        candidates = geometry.allowed[:, None]
        selected = torch.empty(n, hq, tq, tk, dtype=torch.bool, device=q_bar.device)
    step = _head_chunk(hq, group, n * tq * tk)
    for h0 in range(0, hq, step):
        h1 = min(hq, h0 + step)
        if kernel:
            logits = pooled_logits(q_bar, k_bar, h0, h1)
            threshold_select_rows(logits, layout, selector.threshold, counts, indices, head_offset=h0,
                                  key_inverse=None, from_logits=True, logit_scale=scale,
                                  candidates=geometry.allowed, diagonal=inputs.forced,
                                  row_limits=inputs.row_limits, key_limits=inputs.key_limits)
            continue
        logits = grouped_logits(q_bar[:, h0:h1], k_bar[:, h0 // group: h1 // group])
        scores = (logits * scale).masked_fill_(~candidates, float("-inf")).softmax(-1).nan_to_num_(0.0)
        selected[:, h0:h1] = select_by_cumulative_threshold(scores, candidates, selector.threshold)
    return BlockMask(counts, indices, layout) if kernel else selected


def uses_gpu_planners(device: torch.device) -> bool:
    """Whether planning runs the eager path's Triton kernels (on CUDA) rather than PyTorch
    operations (elsewhere; the tests hold the two to each other in the interpreter)."""
    return device.type == "cuda"


def line_scores_torch(selector, geometry: RaggedGeometry, q: torch.Tensor, k: torch.Tensor, scale: float,
                      heads: slice) -> torch.Tensor:
    """Vertical and slash scores of each sequence's last ``min(last_rows, len_q)`` queries for the
    query heads ``heads`` (whole GQA groups): ``(2, N, h, Nk)`` float32, means over those rows,
    0 past each sequence's keys (`pbs.selectors.vertical_slash.vertical_and_slash_scores` per
    sequence)."""
    n, hq, _, d = q.shape
    padded_k = k.shape[2]
    group = hq // k.shape[1]
    device = q.device
    rows = min(selector.last_rows, q.shape[2])
    rows_of = torch.minimum(geometry.len_q, torch.full_like(geometry.len_q, selector.last_rows))  # (N,)
    step = torch.arange(rows, device=device)
    slot = geometry.len_q[:, None] - rows + step[None, :]  # (N, R): the last R slots, oldest first
    real_row = step[None, :] >= (rows - rows_of)[:, None]
    slot = slot.clamp(min=0)
    position = geometry.query_offset[:, None] + slot
    h = heads.stop - heads.start
    queries = q[:, heads].gather(2, slot[:, None, :, None].expand(n, h, rows, d)).float() * scale
    key = torch.arange(padded_k, device=device)
    visible = (key[None, None, :] <= position[:, :, None]) & real_row[:, :, None]  # (N, R, Nk)
    # Offset o of row r is key position(r) - o.
    offset_key = position[:, :, None] - key[None, None, :]
    offset_real = offset_key >= 0
    divisor = rows_of.clamp(min=1).float()[:, None, None]
    logits = grouped_logits(queries, k[:, heads.start // group: heads.stop // group])  # (N, h, R, Nk)
    probs = logits.masked_fill_(~visible[:, None], float("-inf")).softmax(-1).nan_to_num_(0.0)
    vertical = probs.sum(-2) / divisor
    along = probs.gather(-1, offset_key.clamp(min=0)[:, None].expand(n, h, rows, padded_k))
    slash = along.masked_fill_(~offset_real[:, None], 0.0).sum(-2) / divisor
    return torch.stack((vertical, slash))


def _blocks_of_kept_lines(keys_blocks: torch.Tensor, prefix: torch.Tensor, geometry: RaggedGeometry) -> torch.Tensor:
    """Key blocks holding a kept key (``keys_blocks (N, h, Tk)`` bool) or crossed by a kept offset
    (``prefix (N, h, Nk + 1)``, the running count of kept offsets): ``(N, h, Tq, Tk)`` bool, with
    each sequence's offsets clamped to its own key count (`pbs.selectors.vertical_slash.blocks_of_lines`)."""
    n, h = prefix.shape[:2]
    q_lo, q_hi, _ = geometry.query_blocks
    k_lo, k_hi, _ = geometry.key_blocks
    limit = geometry.len_k[:, None, None]
    lo = torch.minimum((q_lo[:, :, None] - k_hi[:, None, :]).clamp(min=0), limit)
    hi = torch.minimum((q_hi[:, :, None] - k_lo[:, None, :] + 1).clamp(min=0), limit)
    tq, tk = lo.shape[1], lo.shape[2]
    flat = (n, h, tq * tk)
    crossed = (prefix.gather(-1, hi.reshape(n, 1, -1).expand(flat))
               - prefix.gather(-1, lo.reshape(n, 1, -1).expand(flat))) > 0
    return crossed.view(n, h, tq, tk) | keys_blocks[:, :, None, :]


def vertical_slash(selector, inputs: "RaggedInputs", extra: BlockMask | None = None) -> BlockMask | torch.Tensor:
    """`VerticalSlashSelector` per sequence.

    Each sequence's last ``min(last_rows, len_q)`` queries are scored against its keys; the
    vertical (per key) and slash (per offset) shares are their means over those rows. On CUDA the
    eager path's kernels do it and write the lists (`pbs.kernels.vertical_slash.line_scores` and
    `lines_to_block_mask` reading the lengths from the device, `kept_line_blocks` between them:
    padding scores are 0, and a zero score is never kept), forced blocks and ``extra``'s blocks
    (a union's other members, a `BlockMask` of the padded layout) included: a `BlockMask`.
    Elsewhere PyTorch operations, a chunk of heads at a time, give the ``(N, Hq, Tq, Tk)`` bool
    selection before the forced blocks (``extra`` ORed in).
    """
    geometry, k, scale = inputs.geometry, inputs.k, inputs.scale
    n, hq = geometry.batch, inputs.heads_q
    bs = geometry.block_size
    if uses_gpu_planners(k.device):
        from pbs.kernels.vertical_slash import kept_line_blocks, line_scores, lines_to_block_mask

        layout = geometry.layout(hq, k.shape[1])
        scores = line_scores(inputs.q, k, layout, scale, selector.last_rows, lengths=inputs.lengths,
                             q_row_starts=inputs.q_row_starts)
        keys_blocks, prefix = kept_line_blocks(scores, selector.threshold, selector.vertical_threshold, bs)
        return lines_to_block_mask(keys_blocks, prefix, layout, inputs.force_sink_block, extra,
                                   lengths=inputs.lengths)
    q = inputs.padded_q
    group = hq // k.shape[1]
    rows = min(selector.last_rows, q.shape[2])
    selected = torch.empty(n, hq, geometry.num_query_blocks, geometry.num_key_blocks, dtype=torch.bool,
                           device=q.device)
    chunk = _head_chunk(hq, group, n * rows * k.shape[2] * 2)
    for h0 in range(0, hq, chunk):
        heads = slice(h0, min(hq, h0 + chunk))
        vertical, slash = line_scores_torch(selector, geometry, q, k, scale, heads)
        keys, offsets = kept_lines(vertical, slash, selector.threshold, selector.vertical_threshold)
        keys_blocks = keys.view(*keys.shape[:2], -1, bs).any(-1)
        selected[:, heads] = _blocks_of_kept_lines(keys_blocks, offset_prefix(offsets), geometry)
    return selected if extra is None else selected | extra.to_dense()


@dataclass(frozen=True)
class RaggedInputs:
    """What a planner of the `RAGGED` family reads.

    Attributes:
        geometry: the padded batch's block geometry, lengths on the device.
        q: ``(N, Hq, Tq * B, D)`` and k: ``(N, Hkv, Tk * B, D)``, padded with zeros; with
            ``q_row_starts``, ``q`` is the packed ``(total, Hq, D)`` queries (`padded_q` pads them
            for a planner that reads the padded layout).
        pooled: their block means ``(q_bar (N, Hq, Tq, D), k_bar (N, Hkv, Tk, D))`` float32.
        scale: softmax scale.
        force_sink_block: the config's ``force_sink_block`` (the forced blocks are the diagonal
            and, with it, the sink block 0).
        planned: ``(N,)`` bool, the sequences to plan (None: all): the others are already decided
            dense and their rows replaced, so a planner may leave them empty.
        q_row_starts: ``(N + 1,)`` int32 (``cu_seq_q``) when ``q`` is packed, else None.
    """

    geometry: RaggedGeometry
    q: torch.Tensor
    k: torch.Tensor
    pooled: tuple[torch.Tensor, torch.Tensor]
    scale: float
    force_sink_block: bool = True
    planned: torch.Tensor | None = None
    q_row_starts: torch.Tensor | None = None

    @property
    def heads_q(self) -> int:
        return self.q.shape[1]  # (N, Hq, rows, D) padded or (total, Hq, D) packed

    @cached_property
    def padded_q(self) -> torch.Tensor:
        """``(N, Hq, Tq * B, D)``: ``q``, padded here once if it is packed."""
        if self.q_row_starts is None:
            return self.q
        return pad_packed(self.q, self.q_row_starts, self.geometry.padded_len_q)

    @cached_property
    def forced(self) -> torch.Tensor:
        """``(N, Tq, Tk)`` bool: the blocks every selection keeps."""
        return self.geometry.forced(self.force_sink_block)

    @cached_property
    def lengths(self) -> torch.Tensor:
        """``(N, 2)`` int32 ``(len_q, len_k)`` for the kernels, ``len_q`` 0 for a sequence not planned
        (no rows scored, empty lists)."""
        len_q = self.geometry.len_q
        if self.planned is not None:
            len_q = torch.where(self.planned, len_q, 0)
        return torch.stack((len_q, self.geometry.len_k), 1).to(torch.int32)

    @cached_property
    def row_limits(self) -> torch.Tensor:
        """``(N,)`` int32: query blocks to plan per sequence (its own, 0 when not planned)."""
        bs = self.geometry.block_size
        return (self.lengths[:, 0] + bs - 1) // bs

    @cached_property
    def key_limits(self) -> torch.Tensor:
        """``(N,)`` int32: each sequence's own key blocks."""
        bs = self.geometry.block_size
        return (self.lengths[:, 1] + bs - 1) // bs


register_planner("selector", "mean_pool", RAGGED)(mean_pool)
register_planner("selector", "vertical_slash", RAGGED)(vertical_slash)


@register_planner("selector", "antidiagonal", RAGGED)
def _antidiagonal_planner(selector, inputs: RaggedInputs) -> torch.Tensor:
    return antidiagonal(selector, inputs)


@register_planner("selector", "union", RAGGED)
def _union_planner(selector, inputs: RaggedInputs) -> BlockMask | torch.Tensor:
    """The members' union; on CUDA a ``vertical_slash`` member's compaction takes the others'
    lists in (as the eager path's union does), with no bool mask in between."""
    lines = next((m for m in selector.selectors if m.name == "vertical_slash"), None)
    if lines is None or not uses_gpu_planners(inputs.k.device):
        result = None
        for member in selector.selectors:
            member_selection = select(member, inputs)  # bool here; a list only from a GPU planner
            if isinstance(member_selection, BlockMask):
                member_selection = member_selection.to_dense()
            result = member_selection if result is None else result | member_selection
        return result
    others = [member_mask(m, inputs) for m in selector.selectors if m is not lines]
    if len(others) > 1:
        union = others[0].to_dense()
        for other in others[1:]:
            union |= other.to_dense()
        others = [BlockMask.from_dense(union, others[0].layout)]
    return vertical_slash(lines, inputs, extra=others[0] if others else None)


def member_mask(selector, inputs: RaggedInputs) -> BlockMask:
    """``selector``'s selection of every padded sequence as a `BlockMask` with the forced blocks,
    limited to each sequence's allowed blocks (its ``full_counts`` may be unset: the caller
    derives them per sequence, `RaggedGeometry.full_counts`)."""
    result = select(selector, inputs)
    if isinstance(result, BlockMask):
        return result
    geometry = inputs.geometry
    result = (result | inputs.forced[:, None]) & geometry.allowed[:, None]
    return BlockMask.from_dense(result, geometry.layout(inputs.heads_q, inputs.k.shape[1]))


def _strided_rows(x: torch.Tensor, stride: int, reverse: bool) -> torch.Tensor:
    """Padded ``(N, H, T, D)`` as ``(N, H, T / stride, stride * D)`` float32, each group of
    ``stride`` rows reversed when ``reverse`` (`pbs.selectors.antidiagonal`'s reshaping)."""
    n, h, rows, d = x.shape
    x = x.float().view(n, h, rows // stride, stride, d)
    if reverse:
        x = x.flip(3)
    return x.reshape(n, h, rows // stride, stride * d)


def antidiagonal(selector, inputs: RaggedInputs) -> torch.Tensor:
    """`AntidiagonalSelector` per sequence, unsegmented (XAttention's estimator): ``(N, Hq, Tq, Tk)``
    bool, the forced sink and diagonal blocks counted first towards the threshold.

    Each sequence's strided queries see its strided keys up to their own causal offset
    (``c * stride <= r * stride + len_k - len_q``) and below ``len_k``; its strided rows past
    ``len_q`` score nothing. PyTorch operations with shapes fixed by the maxima, a chunk of rows at a
    time (`pbs.selectors.antidiagonal.antidiagonal_block_scores` of the sequence alone).
    """
    geometry, stride = inputs.geometry, selector.stride
    bs, tq, tk = geometry.block_size, geometry.num_query_blocks, geometry.num_key_blocks
    per_block = bs // stride
    q_r = _strided_rows(inputs.padded_q, stride, reverse=True)
    k_r = _strided_rows(inputs.k, stride, reverse=False)
    n, hq = q_r.shape[:2]
    device = q_r.device
    key_start = torch.arange(tk * per_block, device=device) * stride
    query_start = torch.arange(tq * per_block, device=device) * stride
    key_valid = key_start[None, :] < geometry.len_k[:, None]  # (N, Tk * pb)
    offset = geometry.query_offset[:, None, None]
    scores = torch.empty(n, hq, tq, tk, dtype=torch.float32, device=device)
    rows_per_chunk = max(1, _SCORE_ELEMENTS // max(1, n * hq * per_block * tk * per_block))
    for i0 in range(0, tq, rows_per_chunk):
        i1 = min(tq, i0 + rows_per_chunk)
        rows = query_start[i0 * per_block:i1 * per_block]
        visible = (key_start[None, None, :] <= rows[None, :, None] + offset) & key_valid[:, None, :]  # (N, R, K)
        logits = grouped_logits(q_r[:, :, i0 * per_block:i1 * per_block], k_r) * (inputs.scale / stride)
        probs = logits.masked_fill_(~visible[:, None], float("-inf")).softmax(-1).nan_to_num_(0.0)
        probs *= (rows[None, :] < geometry.len_q[:, None])[:, None, :, None]
        blocks = probs.view(n, hq, i1 - i0, per_block, tk, per_block).sum((3, 5))
        scores[:, :, i0:i1] = blocks / blocks.sum(-1, keepdim=True).clamp(min=1e-30)
    candidates = geometry.allowed[:, None]
    return select_by_cumulative_threshold(scores, candidates, selector.threshold, ranked_first=inputs.forced[:, None])


def ragged_reasons(config) -> list[str]:
    """Why the `RAGGED` family cannot plan ``config`` (empty: it can), from what is registered:
    a permuter that moves tokens needs a registered ragged permuter planner, and every selector
    (each member of a selector made of selectors) a ragged selector planner."""
    reasons = []
    if type(config.permuter).segmented and planner_for("permuter", config.permuter.name, RAGGED) is None:
        reasons.append(f"config.permuter {config.permuter.name!r} has no planner for padded batches (a permuter "
                       "that moves tokens must be planned with the sequence's length on the host)")
    pending = [config.selector]
    while pending:
        selector = pending.pop()
        if planner_for("selector", selector.name, RAGGED) is None:
            reasons.append(f"config.selector {selector.name!r} has no planner for padded batches")
        pending.extend(getattr(selector, "selectors", ()))
    return reasons


def select(selector, inputs: RaggedInputs) -> BlockMask | torch.Tensor:
    """``selector``'s selection of every padded sequence by the planner registered for it in the
    `RAGGED` family: a `BlockMask` with the forced blocks, or the bool selection before them."""
    planner = planner_for("selector", selector.name, RAGGED)
    if planner is None:
        raise ValueError(f"config.selector {selector.name!r} has no planner for padded batches; planners: "
                         f"{', '.join(planners_of(RAGGED, 'selector'))}")
    return planner(selector, inputs)


def probe_counters(geometry: RaggedGeometry, q_bar: torch.Tensor, k_bar: torch.Tensor,
                   args: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The density probe per sequence (`pbs.reference.density_probe.probe_density`): ``(kept,
    visible)`` int64 ``(N,)`` counters over the sampled query blocks and every query head.
    ``args``: `pbs.dense.DensePolicy.probe_arguments` (``num_blocks``, ``threshold``, ``scale``).

    Each sequence samples ``min(probe_blocks, Tq_i)`` of its own query blocks, evenly spaced with
    its last one included (`sampled_query_blocks`' integer rule), from the pooled blocks
    ``q_bar``/``k_bar`` the planners use.
    """
    share, samples, scale = args["threshold"], args["num_blocks"], args["scale"]
    n, hq, _, d = q_bar.shape
    tk = k_bar.shape[2]
    bs, device = geometry.block_size, q_bar.device
    blocks_q = (geometry.len_q + bs - 1) // bs  # (N,)
    drawn = torch.minimum(blocks_q, torch.full_like(blocks_q, samples))
    i = torch.arange(samples, device=device)
    spread = (2 * i[None, :] * (blocks_q[:, None] - 1) + (drawn[:, None] - 1)) // (2 * (drawn[:, None] - 1)).clamp(min=1)
    rows = torch.where(drawn[:, None] > 1, spread, (blocks_q[:, None] - 1).clamp(min=0))  # (N, P)
    sampled = i[None, :] < drawn[:, None]
    rows = torch.where(sampled, rows, 0)
    if share >= 1.0:
        # Every visible block kept: the estimate is 1, whatever the scores.
        ones = sampled.sum(-1)
        return ones, ones
    q_pooled = q_bar.gather(2, rows[:, None, :, None].expand(n, hq, samples, d))
    logits = grouped_logits(q_pooled, k_bar) * scale  # (N, Hq, P, Tk)

    q_lo_all, q_hi_all, _ = geometry.query_blocks
    first_q, last_q = q_lo_all.gather(1, rows), q_hi_all.gather(1, rows)
    k_lo, _, k_valid = geometry.key_blocks
    block = torch.arange(tk, device=device)
    visible = k_valid[:, None, :] & (k_lo[:, None, :] <= last_q[:, :, None]) & sampled[:, :, None]  # (N, P, Tk)
    diagonal = visible & ((block + 1)[None, None, :] * bs > first_q[:, :, None])
    forced = diagonal | (visible & (block == 0)[None, None, :])
    visible, forced = visible[:, None], forced[:, None]

    probs = logits.masked_fill(~visible, float("-inf")).softmax(-1).nan_to_num(0.0)
    ranked = (probs + 2.0 * forced).sort(-1, descending=True).values
    ranked = ranked - 2.0 * (ranked >= 2.0)
    mass_before = ranked.cumsum(-1) - ranked
    kept = (mass_before < share) | (block < forced.sum(-1, keepdim=True))
    kept = (kept & (block < visible.sum(-1, keepdim=True))).sum((1, 2, 3))
    return kept, visible.sum((1, 2, 3)) * hq
