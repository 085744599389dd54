"""``vertical_slash`` line scores and their block lists on the GPU: launchers behind the
``triton`` planner of `pbs.selectors.vertical_slash` (`pbs.backends.planners`).

Four launches instead of the reference's dozens of ops:

1. ``_row_stats``: the log-sum-exp of the last ``R`` queries' rows, split over the keys (one
   program per query head, or per few heads of a KV group stacked on one read of K, and key split;
   online softmax);
2. ``_row_lines``: combines those partial statistics once per program, then walks a run of key
   tiles, taking each row's softmax over the tile; the per-key sum (vertical score) is stored
   directly, and the per-offset sums (slash scores) come from the same tile read cyclically
   skewed with ``tl.gather``, so that a masked sum over rows is a sum along one offset, added into
   the offsets with atomics (the probabilities never go to memory);
3. ``_kept_lines``: the reference's cumulative threshold (`kept_lines`: the fewest keys and
   offsets whose shares reach the threshold) without sorting: the cut below which scores are
   dropped is found a few bits of its float pattern at a time, then one pass writes which key
   blocks hold a kept key and the running count of kept offsets;
4. ``_lines_to_blocks`` compacts, per (head, query block), the key blocks that hold a kept key
   or that a kept offset crosses, plus the forced blocks, straight into a `BlockMask`, and counts
   the list's full/masked split on the way; another selection of the same layout can be merged in
   the same pass (a union's other member).

The launchers assume an unsegmented layout with keys and queries in their original order.
Differences to the reference come only from rounding and summation order, which can flip a key or
offset that sits exactly at a threshold.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pbs.kernels._common import COMPILE_OPTIONS, LOG2_E, interpreting, sm_count
from pbs.layout import Layout
from pbs.types import BlockMask, block_index_dtype

PROGRAMS_PER_SM = 8
KEY_TILE = 64
LINES_STAGES = 2
LINES_HEADS_PER_PROGRAM = 2
"""`_row_lines`' launch: programs per SM, keys per tile and pipeline stages, and how many query heads
of a KV group one program of `_row_stats` and `_row_lines` stacks on one read of K: the fastest of
the sweeps in docs/notes.md ("Where a chunk's planning goes")."""
KEPT_LINES_TILES = (8192, 8192)
KEPT_LINES_WARPS = 16
KEPT_LINES_DIGIT_BITS = 4
KEPT_LINES_COMPACT_AFTER: int | None = 3
"""Scores per step of `_kept_lines` below / from 64K keys, its warps, the bits of the cut found per
pass over a row (4: eight passes of 16 candidates; 2: sixteen of 4; 1: thirty-two of 2), and after
how many passes the later ones read only the scores that share the cut's leading digits (None:
every pass reads the whole row; a compaction holds a second copy of the scores): the fastest of the
same sweeps at 32K and 128K."""


@triton.jit
def _stacked_rows(b, head0, heads_q, ROWS: tl.constexpr, HEADS: tl.constexpr):
    """A program's rows: ``HEADS`` query heads of one KV group from ``head0``, ``ROWS`` rows each,
    stacked. Returns each stacked row's row within its head and its (batch x head) line."""
    o = tl.arange(0, HEADS * ROWS)
    return o % ROWS, b * heads_q + head0 + o // ROWS


@triton.jit
def _per_head(x, HEADS: tl.constexpr, ROWS: tl.constexpr):
    """A ``(HEADS * ROWS, N)`` tile of stacked rows summed over each head's rows: ``(HEADS, N)``,
    or ``(N,)`` for one head (the single-head kernel as it was timed, with no reshape)."""
    if HEADS == 1:
        sums = tl.sum(x, 0)
    else:
        sums = tl.sum(tl.reshape(x, (HEADS, ROWS, x.shape[1])), 1)
    return sums


@triton.jit
def _each_head(x, HEADS: tl.constexpr):
    """``x`` ``(N,)`` shaped as `_per_head`'s sums: itself for one head, else ``(HEADS, N)``."""
    if HEADS == 1:
        out = x
    else:
        out = tl.broadcast_to(x[None, :], (HEADS, x.shape[0]))
    return out


@triton.jit
def _head_line_starts(first_line, line_len, HEADS: tl.constexpr):
    """Where the lines of the program's heads start, shaped to add to `_each_head`'s entries."""
    if HEADS == 1:
        out = first_line * line_len
    else:
        out = (first_line + tl.arange(0, HEADS)).to(tl.int64)[:, None] * line_len
    return out


@triton.jit
def _load_rows(q_ptr, q_starts_ptr, b, head0, stride_qb, stride_qh, stride_qn, rows_start, rows,
               ROWS: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
               PACKED_Q: tl.constexpr):
    o = tl.arange(0, HEADS * ROWS)
    o_r = o % ROWS
    o_d = tl.arange(0, D_PAD)
    if PACKED_Q:  # a packed batch (line_scores' q_row_starts): entry b's rows from its first one
        entry = tl.load(q_starts_ptr + b).to(tl.int64) * stride_qn
    else:
        entry = b.to(tl.int64) * stride_qb
    heads = (head0 + o // ROWS).to(tl.int64) * stride_qh
    ptrs = q_ptr + entry + heads[:, None] + (rows_start + o_r)[:, None] * stride_qn
    return tl.load(ptrs + o_d[None, :], mask=(o_r[:, None] < rows) & (o_d[None, :] < HEAD_DIM), other=0.0)


@triton.jit
def _sequence(lens_ptr, b, rows_start, rows, seq_len_k, query_offset, last_rows, RAGGED: tl.constexpr):
    """``(rows_start, rows, seq_len_k, query_offset)`` of batch entry ``b``: the launch's own, or,
    for a padded batch of sequences (``RAGGED``), those of sequence ``b``, whose query and key
    lengths are ``lens_ptr[b]`` and ``lens_ptr[B + b]`` (int32, on the device)."""
    if RAGGED:
        len_q = tl.load(lens_ptr + 2 * b)
        len_k = tl.load(lens_ptr + 2 * b + 1)
        rows = tl.minimum(len_q, last_rows)
        rows_start = len_q - rows
        seq_len_k = len_k
        query_offset = len_k - len_q
    return rows_start, rows, seq_len_k, query_offset


@triton.jit
def _scores(q, k_ptr, table_ptr, b, hk, stride_kb, stride_kh, stride_kn, cols, key_end, row_pos, qk_scale,
            HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
            PAGE_SIZE: tl.constexpr):
    """Logits of the rows against the keys ``cols`` in the log2 domain, -inf where not allowed.

    ``PAGE_SIZE`` > 0: ``k_ptr`` is a paged cache whose page stride is ``stride_kb`` and key ``c``
    is row ``c % PAGE_SIZE`` of page ``table_ptr[c // PAGE_SIZE]`` (batch 1)."""
    o_d = tl.arange(0, D_PAD)
    m_cols = cols < key_end
    if PAGE_SIZE > 0:
        page = tl.load(table_ptr + cols // PAGE_SIZE, mask=m_cols, other=0)
        rows = page.to(tl.int64) * stride_kb + (cols % PAGE_SIZE).to(tl.int64) * stride_kn
    else:
        rows = b.to(tl.int64) * stride_kb + cols.to(tl.int64) * stride_kn
    ptrs = k_ptr + hk.to(tl.int64) * stride_kh + rows[:, None]
    k = tl.load(ptrs + o_d[None, :], mask=m_cols[:, None] & (o_d[None, :] < HEAD_DIM), other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * qk_scale
    valid = cols[None, :] < key_end
    if CAUSAL:
        valid = valid & (cols[None, :] <= row_pos[:, None])
    return tl.where(valid, s, float("-inf"))


@triton.jit
def _row_stats(q_ptr, k_ptr, table_ptr, m_ptr, l_ptr,
               stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
               heads_q, group, rows_start, rows, lens_ptr, q_starts_ptr, last_rows, seq_len_k, query_offset,
               keys_per_split, splits, qk_scale,
               ROWS: tl.constexpr, HEADS: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
               D_PAD: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr, PAGE_SIZE: tl.constexpr,
               RAGGED: tl.constexpr, PACKED_Q: tl.constexpr):
    # One program per (batch, HEADS query heads of a KV group, key split): each K tile is read once
    # for the stacked rows of its heads.
    programs_per_entry = heads_q // HEADS
    b = tl.program_id(0) // programs_per_entry
    head0 = tl.program_id(0) % programs_per_entry * HEADS
    rows_start, rows, seq_len_k, query_offset = _sequence(lens_ptr, b, rows_start, rows, seq_len_k, query_offset,
                                                          last_rows, RAGGED)
    q = _load_rows(q_ptr, q_starts_ptr, b, head0, stride_qb, stride_qh, stride_qn, rows_start, rows, ROWS, HEADS,
                   HEAD_DIM, D_PAD, PACKED_Q)
    o_r, line = _stacked_rows(b, head0, heads_q, ROWS, HEADS)
    row_pos = rows_start + query_offset + o_r
    split = tl.program_id(1)
    m_i = tl.full([HEADS * ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([HEADS * ROWS], tl.float32)
    key_start = split * keys_per_split
    key_end = tl.minimum(key_start + keys_per_split, seq_len_k)
    for n0 in range(key_start, key_end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        s = _scores(q, k_ptr, table_ptr, b, head0 // group, stride_kb, stride_kh, stride_kn, cols, key_end, row_pos,
                    qk_scale, HEAD_DIM, D_PAD, CAUSAL, IEEE, PAGE_SIZE)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
        m_i = m_new
    out = (line * splits + split) * ROWS + o_r
    tl.store(m_ptr + out, m_i)
    tl.store(l_ptr + out, l_i)


@triton.jit
def _log_sum_exp(m_ptr, l_ptr, line, o_r, splits, ROWS: tl.constexpr, SPLITS: tl.constexpr):
    """The stacked rows' log2-sum-exp from `_row_stats`' per-split maxima and sums (a few values per
    row); ``line`` and ``o_r`` from `_stacked_rows`."""
    o_s = tl.arange(0, SPLITS)
    at = (line[:, None] * splits + o_s[None, :]) * ROWS + o_r[:, None]
    m = tl.load(m_ptr + at, mask=o_s[None, :] < splits, other=float("-inf"))
    l = tl.load(l_ptr + at, mask=o_s[None, :] < splits, other=0.0)
    top = tl.max(m, 1)
    top = tl.where(top == float("-inf"), 0.0, top)
    return top + tl.log2(tl.sum(l * tl.exp2(m - top[:, None]), 1))


@triton.jit
def _row_lines(q_ptr, k_ptr, table_ptr, m_ptr, l_ptr, vertical_ptr, slash_ptr,
               stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
               heads_q, group, launch_rows_start, launch_rows, lens_ptr, q_starts_ptr, last_rows, line_len,
               query_offset_0, keys_per_program, splits, qk_scale,
               ROWS: tl.constexpr, HEADS: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
               HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
               PAGE_SIZE: tl.constexpr, RAGGED: tl.constexpr, PACKED_Q: tl.constexpr):
    # One program per (batch, HEADS query heads of a KV group, run of keys): the stacked rows'
    # queries and log-sum-exp are loaded once, and the key loop reads only K (once for the
    # stacked heads), so the compiler can prefetch the next tile.
    programs_per_entry = heads_q // HEADS
    b = tl.program_id(0) // programs_per_entry
    head0 = tl.program_id(0) % programs_per_entry * HEADS
    o_n = tl.arange(0, BLOCK_N)
    # Lines are line_len apart (the padded length of a ragged batch); seq_len_k bounds this one.
    rows_start, rows, seq_len_k, query_offset = _sequence(lens_ptr, b, launch_rows_start, launch_rows, line_len,
                                                          query_offset_0, last_rows, RAGGED)
    key_start = tl.program_id(1) * keys_per_program
    # A ragged sequence's keys past its end score nothing (its lines there stay 0).
    key_end = tl.minimum(key_start + keys_per_program, seq_len_k)
    q = _load_rows(q_ptr, q_starts_ptr, b, head0, stride_qb, stride_qh, stride_qn, rows_start, rows, ROWS, HEADS,
                   HEAD_DIM, D_PAD, PACKED_Q)
    o_r, line = _stacked_rows(b, head0, heads_q, ROWS, HEADS)
    lse = _log_sum_exp(m_ptr, l_ptr, line, o_r, splits, ROWS, SPLITS)
    lse = tl.where(o_r < rows, lse, float("inf"))  # padded rows: probability 0
    first_row_pos = rows_start + query_offset
    lines = _head_line_starts((b * heads_q + head0).to(tl.int64), line_len, HEADS)
    # Rows r and keys c of a tile meet on offset first_row_pos - col0 - (BLOCK_N - 1) + x with
    # x = BLOCK_N - 1 - c + r in [0, ROWS + BLOCK_N - 1). Read the tile cyclically skewed, entry
    # (r, y) being column (BLOCK_N - 1 - y + r) mod BLOCK_N: column y of that read holds offset
    # x = y from rows r <= y and x = y + BLOCK_N from rows r > y, so two masked sums over each
    # head's rows are its per-offset sums, from a gather of the tile's own size.
    o_y = tl.arange(0, BLOCK_N)
    column = (BLOCK_N - 1 - o_y[None, :] + o_r[:, None]) % BLOCK_N
    low = o_r[:, None] <= o_y[None, :]
    far_rows = _each_head(o_y < ROWS - 1, HEADS)
    for col0 in range(key_start, key_end, BLOCK_N):
        cols = col0 + o_n
        s = _scores(q, k_ptr, table_ptr, b, head0 // group, stride_kb, stride_kh, stride_kn, cols, seq_len_k,
                    first_row_pos + o_r, qk_scale, HEAD_DIM, D_PAD, CAUSAL, IEEE, PAGE_SIZE)
        p = tl.exp2(s - lse[:, None])
        at = _each_head(cols, HEADS)
        # A sequence without queries (rows 0) has every p 0: its lines are 0, not 0 / 0.
        tl.store(vertical_ptr + lines + at, _per_head(p, HEADS, ROWS) / tl.maximum(rows, 1), mask=at < seq_len_k)
        skewed = tl.gather(p, column, 1)
        # Negative offsets (keys after the row: non-causal calls) are not slash lines. An offset is
        # shared by at most two tiles (ROWS <= BLOCK_N), and a two-term sum is the same in either
        # order, so the atomics leave the result deterministic.
        at = _each_head(first_row_pos - col0 - (BLOCK_N - 1) + o_y, HEADS)
        tl.atomic_add(slash_ptr + lines + at, _per_head(tl.where(low, skewed, 0.0), HEADS, ROWS), sem="relaxed",
                      mask=(at >= 0) & (at < seq_len_k))
        at += BLOCK_N
        tl.atomic_add(slash_ptr + lines + at, _per_head(tl.where(low, 0.0, skewed), HEADS, ROWS), sem="relaxed",
                      mask=far_rows & (at >= 0) & (at < seq_len_k))


@triton.jit
def _lines_to_blocks(vertical_blocks_ptr, prefix_ptr, counts_ptr, indices_ptr, full_counts_ptr,
                     extra_counts_ptr, extra_indices_ptr, extra_marks_ptr, lens_ptr,
                     num_query_blocks, num_key_blocks, heads_q, prefix_stride, seq_len_q, seq_len_k, query_offset,
                     BLOCK: tl.constexpr, CHUNK: tl.constexpr, CAUSAL: tl.constexpr, FORCE_SINK: tl.constexpr,
                     EXTRA: tl.constexpr, RAGGED: tl.constexpr):
    pid = tl.program_id(0)
    marks = extra_marks_ptr + pid.to(tl.int64) * num_key_blocks
    if EXTRA:
        # Another selection's list for this row (a union's other member) is marked in a zeroed
        # row of flags first, so the walk below can OR it in chunk by chunk.
        extra_count = tl.load(extra_counts_ptr + pid)
        for e0 in range(0, extra_count, CHUNK):
            e = e0 + tl.arange(0, CHUNK)
            listed = e < extra_count
            block = tl.load(extra_indices_ptr + pid.to(tl.int64) * num_key_blocks + e, mask=listed, other=0)
            tl.store(marks + block, 1, mask=listed)
        tl.debug_barrier()
    bh = pid // num_query_blocks
    i = pid % num_query_blocks
    if RAGGED:
        # A padded batch (`pbs.serving.ragged`): this entry's own lengths, rows from 0.
        b = bh // heads_q
        seq_len_q = tl.load(lens_ptr + 2 * b)
        seq_len_k = tl.load(lens_ptr + 2 * b + 1)
        query_offset = seq_len_k - seq_len_q
    first_slot = i * BLOCK
    last_slot = tl.minimum(first_slot + BLOCK, seq_len_q) - 1
    q_lo = first_slot + query_offset
    q_hi = last_slot + query_offset
    written = i * 0
    # The mask's full/masked split (`Layout.first_masked_blocks` for unsegmented layouts): key
    # blocks before the query block's first position's block lie wholly in its past; without
    # causality only a partial last key block needs the per-token check.
    own_key_blocks = (seq_len_k + BLOCK - 1) // BLOCK
    if CAUSAL:
        first_masked = q_lo // BLOCK
        # Key blocks past the query block's last position are never allowed: the walk stops there.
        end = tl.minimum(q_hi // BLOCK + 1, own_key_blocks)
    else:
        first_masked = num_key_blocks
        end = own_key_blocks
    first_masked = tl.where(seq_len_k % BLOCK != 0, tl.minimum(first_masked, own_key_blocks - 1), first_masked)
    end = tl.where(first_slot < seq_len_q, end, 0)  # a padded row past the queries keeps nothing
    full = i * 0
    row = indices_ptr + pid.to(tl.int64) * num_key_blocks
    prefix = prefix_ptr + bh.to(tl.int64) * prefix_stride
    for j0 in range(0, end, CHUNK):
        j = j0 + tl.arange(0, CHUNK)
        in_range = j < end
        k_lo = j * BLOCK
        k_hi = tl.minimum(k_lo + BLOCK, seq_len_k) - 1
        allowed = in_range
        if CAUSAL:
            allowed = allowed & (k_lo <= q_hi)
        # Unsegmented layouts: the diagonal blocks are the key blocks of the query block's positions.
        forced = (j >= q_lo // BLOCK) & (j <= q_hi // BLOCK)
        if FORCE_SINK:
            forced = forced | (j == 0)
        lo = tl.minimum(tl.maximum(q_lo - k_hi, 0), seq_len_k)
        hi = tl.minimum(tl.maximum(q_hi - k_lo + 1, 0), seq_len_k)
        crossed = tl.load(prefix + hi, mask=in_range, other=0) - tl.load(prefix + lo, mask=in_range, other=0)
        vertical = tl.load(vertical_blocks_ptr + bh.to(tl.int64) * num_key_blocks + j, mask=in_range, other=0)
        keep = forced | (vertical != 0) | (crossed > 0)
        if EXTRA:
            keep = keep | (tl.load(marks + j, mask=in_range, other=0, cache_modifier=".cg") != 0)
        keep = allowed & keep
        keep_i = keep.to(tl.int32)
        slot = written + tl.cumsum(keep_i, 0) - 1
        tl.store(row + slot, j.to(indices_ptr.dtype.element_ty), mask=keep)
        written += tl.sum(keep_i, 0)
        full += tl.sum((keep & (j < first_masked)).to(tl.int32), 0)
    tl.store(counts_ptr + pid, written)
    tl.store(full_counts_ptr + pid, full)


def line_scores(q: torch.Tensor, k: torch.Tensor, layout: Layout, scale: float, last_rows: int,
                block_table: torch.Tensor | None = None, lengths: torch.Tensor | None = None,
                q_row_starts: torch.Tensor | None = None) -> torch.Tensor:
    """Vertical and slash scores of the last ``last_rows`` queries: ``(2, B, Hq, Nk)`` float32.

    Index 0 holds each key's mean attention from those rows, index 1 each offset's; both equal
    `pbs.selectors.vertical_slash.vertical_and_slash_scores` up to rounding.

    Args:
        q: ``(B, Hq, Nq, D)`` queries, original order; k: ``(B, Hkv, Nk, D)`` keys, original order.
        layout: the call's geometry (unsegmented).
        scale: softmax scale.
        block_table: ``(max_pages,)`` int32: ``k`` is then a paged cache
            ``(num_pages, page_size, Hkv, D)`` read in place, key ``t`` at row ``t % page_size``
            of page ``block_table[t // page_size]``, ``Nk = layout.seq_len_k`` and ``B`` 1.
        lengths: ``(B, 2)`` int32 on the device: ``q`` and ``k`` are then a padded batch of
            sequences (`pbs.serving.ragged`) and entry ``b`` holds ``len_q`` queries and ``len_k``
            keys (rows from 0); its scores are those of the sequence alone, 0 past ``len_k``, and
            both its lines are divided by its own row count. No host read.
        q_row_starts: ``(B + 1,)`` int32 on the device, with ``lengths``: ``q`` is then the packed
            ``(Tq, Hq, D)`` queries read in place, entry ``b`` from row ``q_row_starts[b]``
            (``cu_seq_q``), and ``layout`` gives the padded batch's ``B`` and ``Nq``.
    """
    if q_row_starts is not None:
        if lengths is None:
            raise ValueError("line_scores of packed queries (q_row_starts) needs the lengths of the padded batch")
        q = q.transpose(0, 1)[None]  # (1, Hq, Tq, D): the row stride is the token's
        b, hq, nq, d = layout.batch, q.shape[1], layout.seq_len_q, q.shape[3]
    else:
        b, hq, nq, d = q.shape
    if block_table is None:
        hk, nk = k.shape[1], k.shape[2]
        page_size, table = 0, k
        k_strides = (k.stride(0), k.stride(1), k.stride(2))
    else:
        hk, nk, page_size, table = k.shape[2], layout.seq_len_k, k.shape[1], block_table
        k_strides = (k.stride(0), k.stride(2), k.stride(1))  # page, head, row
    group = hq // hk
    rows = min(last_rows, nq)
    rows_start = nq - rows
    rows_pad = max(16, triton.next_power_of_2(rows))
    d_pad = max(16, triton.next_power_of_2(d))
    block_n = max(KEY_TILE, rows_pad)  # at least ROWS: then an offset spans at most two key tiles (see _row_lines)
    ieee = q.dtype == torch.float32
    qk_scale = scale * LOG2_E
    ragged = lengths is not None
    lens = lengths if ragged else part_lengths_placeholder(q.device)
    q_starts = lens if q_row_starts is None else q_row_starts
    common = (q.stride(0), q.stride(1), q.stride(2), *k_strides, hq, group, rows_start, rows, lens, q_starts,
              last_rows)
    heads = _heads_per_program(group, rows_pad)
    meta = dict(ROWS=rows_pad, HEADS=heads, BLOCK_N=block_n, HEAD_DIM=d, D_PAD=d_pad, CAUSAL=layout.causal,
                IEEE=ieee, PAGE_SIZE=page_size, RAGGED=ragged, PACKED_Q=q_row_starts is not None)
    row_programs = b * hq // heads
    # Enough programs to fill the GPU: split the keys of each program's rows.
    splits = max(1, min(triton.cdiv(nk, 4 * block_n), triton.cdiv(264, row_programs)))
    keys_per_split = triton.cdiv(triton.cdiv(nk, splits), block_n) * block_n
    splits = triton.cdiv(nk, keys_per_split)
    part_max = torch.empty(b * hq, splits, rows_pad, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    _row_stats[(row_programs, splits)](q, k, table, part_max, part_sum, *common, nk, layout.query_offset,
                                       keys_per_split, splits, qk_scale, **meta, **COMPILE_OPTIONS)
    # One buffer for both line scores, so that `kept_line_blocks` reads them in one launch.
    # Ragged: keys past a sequence's end get no store, so they start at 0.
    scores = (torch.zeros if ragged else torch.empty)(2, b, hq, nk, dtype=torch.float32, device=q.device)
    vertical, slash = scores[0], scores[1].zero_()
    # Each program's keys in runs, enough programs to fill the GPU a few times over.
    runs = max(1, min(triton.cdiv(nk, block_n), triton.cdiv(PROGRAMS_PER_SM * _programs_base(q.device), row_programs)))
    keys_per_program = triton.cdiv(triton.cdiv(nk, runs), block_n) * block_n
    runs = triton.cdiv(nk, keys_per_program)
    _row_lines[(row_programs, runs)](q, k, table, part_max, part_sum, vertical, slash, *common, nk,
                                     layout.query_offset, keys_per_program, splits, qk_scale,
                                     SPLITS=triton.next_power_of_2(splits), num_stages=LINES_STAGES, **meta,
                                     **COMPILE_OPTIONS)
    if ragged:
        slash.div_(lengths[:, 0].clamp(min=1, max=last_rows).float()[:, None, None])
    else:
        slash.div_(rows)
    return scores


def part_lengths_placeholder(device: torch.device) -> torch.Tensor:
    """Any int32 tensor on ``device`` for the unused lengths pointer of a launch of one length."""
    return torch.empty(2, dtype=torch.int32, device=device)


@triton.jit
def _share_at_or_above(row_ptr, seq_len, cut, TILE: tl.constexpr, SHIFT: tl.constexpr, CANDIDATES: tl.constexpr):
    """Per candidate ``c = cut + k << SHIFT`` (k < CANDIDATES): the sum of the row's scores whose float
    bits are ``>= c`` (non-negative floats order like their bits; candidates past the largest int32
    are clamped to it, which no score reaches)."""
    o_c = tl.arange(0, CANDIDATES)
    cands = tl.minimum(cut.to(tl.int64) + (o_c.to(tl.int64) << SHIFT), 0x7FFFFFFF).to(tl.int32)
    sums = tl.zeros([CANDIDATES], tl.float32)
    for t0 in range(0, seq_len, TILE):
        cols = t0 + tl.arange(0, TILE)
        x = tl.load(row_ptr + cols, mask=cols < seq_len, other=0.0)
        bits = x.to(tl.int32, bitcast=True)
        sums += tl.sum(tl.where(bits[None, :] >= cands[:, None], x[None, :], 0.0), 1)
    return sums


@triton.jit
def _compact_bucket(row_ptr, bucket_ptr, seq_len, cut, SHIFT: tl.constexpr, TILE: tl.constexpr):
    """Copies the row's scores whose float bits lie in ``[cut, cut + 1 << SHIFT)`` to ``bucket_ptr``
    in index order; returns how many."""
    end = tl.minimum(cut.to(tl.int64) + (1 << SHIFT), 0x7FFFFFFF)
    count = tl.zeros([], tl.int32)
    for t0 in range(0, seq_len, TILE):
        cols = t0 + tl.arange(0, TILE)
        x = tl.load(row_ptr + cols, mask=cols < seq_len, other=0.0)
        bits = x.to(tl.int32, bitcast=True)
        inside = (cols < seq_len) & (bits >= cut) & (bits.to(tl.int64) < end)
        slot = count + tl.cumsum(inside.to(tl.int32), 0) - 1
        tl.store(bucket_ptr + slot, x, mask=inside)
        count += tl.sum(inside.to(tl.int32), 0)
    return count


@triton.jit
def _kept_lines(scores_ptr, vertical_blocks_ptr, prefix_ptr, bucket_ptr, lines, seq_len, num_key_blocks,
                vertical_share, slash_share, TILE: tl.constexpr, BLOCK: tl.constexpr, DIGIT_BITS: tl.constexpr,
                COMPACT_AFTER: tl.constexpr):
    # One program per (line kind, batch x head) row of Nk scores. The kept set of Algorithm 2's
    # cumulative rule is "every score above a cut, plus the first few equal to it": the cut is
    # the largest float c whose scores >= c still sum to the share, found digit by digit
    # (DIGIT_BITS bits of the float's bit pattern per pass over the row, 2**DIGIT_BITS candidates
    # at once) instead of sorting. After COMPACT_AFTER passes the scores that share the cut's
    # leading digits (its bucket) are copied out, and the later passes read only them: every
    # score above the bucket counts for every later candidate, every score below it for none.
    CANDIDATES: tl.constexpr = 1 << DIGIT_BITS
    row = tl.program_id(0)
    kind = tl.program_id(1)  # 0: keys (vertical scores), 1: offsets (slash scores)
    share = tl.where(kind == 0, vertical_share, slash_share)
    row_ptr = scores_ptr + (kind * lines + row).to(tl.int64) * seq_len
    bucket_row = bucket_ptr + (kind * lines + row).to(tl.int64) * seq_len
    o_c = tl.arange(0, CANDIDATES)
    cut = tl.zeros([], tl.int32)
    above = tl.zeros([], tl.float32)  # the sum of the scores at or above the next candidate over the cut
    total = tl.zeros([], tl.float32)
    over_bucket = tl.zeros([], tl.float32)
    in_bucket = seq_len
    for digit in tl.static_range(32 // DIGIT_BITS):
        # This pass's digit is the bits from 32 - DIGIT_BITS * (digit + 1) up (a constant per pass:
        # written out, since a constexpr name cannot be rebound in an unrolled loop).
        if digit >= COMPACT_AFTER:
            sums = over_bucket + _share_at_or_above(bucket_row, in_bucket, cut, TILE, 32 - DIGIT_BITS * (digit + 1),
                                                    CANDIDATES)
        else:
            sums = _share_at_or_above(row_ptr, seq_len, cut, TILE, 32 - DIGIT_BITS * (digit + 1), CANDIDATES)
        if digit == 0:
            total = tl.sum(tl.where(o_c == 0, sums, 0.0), 0)  # candidate 0 of the first pass: every score
        k = tl.sum((sums >= share).to(tl.int32), 0) - 1
        above = tl.where(k < CANDIDATES - 1, tl.sum(tl.where(o_c == k + 1, sums, 0.0), 0), above)
        cut += tl.maximum(k, 0) << (32 - DIGIT_BITS * (digit + 1))
        if digit + 1 == COMPACT_AFTER:
            # The bucket is [cut, cut + 1 << that shift); `above` sums the scores from its end up.
            over_bucket = above
            in_bucket = _compact_bucket(row_ptr, bucket_row, seq_len, cut, 32 - DIGIT_BITS * (digit + 1), TILE)
            tl.debug_barrier()  # the copies are read back by other threads of the program
    keep_all = total < share  # rounding left the whole row short of the share: keep every score > 0
    cut_value = cut.to(tl.float32, bitcast=True)
    # Scores equal to the cut are taken in index order (the reference's stable sort) until the share is reached.
    ties = tl.minimum(tl.maximum(tl.ceil((share - above) / tl.maximum(cut_value, 1e-38)), 1.0), 2.0**30).to(tl.int32)
    if keep_all:
        cut = tl.zeros([], tl.int32)
        ties = tl.zeros([], tl.int32)
    seen = tl.zeros([], tl.int32)
    kept_before = tl.zeros([], tl.int32)
    out = row.to(tl.int64)
    for t0 in range(0, seq_len, TILE):
        cols = t0 + tl.arange(0, TILE)
        x = tl.load(row_ptr + cols, mask=cols < seq_len, other=0.0)
        bits = x.to(tl.int32, bitcast=True)
        tie = bits == cut
        rank = seen + tl.cumsum(tie.to(tl.int32), 0) - 1
        keep = (bits > cut) | (tie & (rank < ties) & (x > 0))
        seen += tl.sum(tie.to(tl.int32), 0)
        if kind == 0:
            # Key blocks that hold a kept key (tiles start on block boundaries).
            per_block = tl.max(tl.reshape(keep.to(tl.int8), (TILE // BLOCK, BLOCK)), 1)
            block = t0 // BLOCK + tl.arange(0, TILE // BLOCK)
            tl.store(vertical_blocks_ptr + out * num_key_blocks + block, per_block, mask=block < num_key_blocks)
        else:
            # Running count of kept offsets, 0 first: offsets kept in [lo, hi) = prefix[hi] - prefix[lo].
            running = kept_before + tl.cumsum(keep.to(tl.int32), 0)
            tl.store(prefix_ptr + out * (seq_len + 1) + 1 + cols, running, mask=cols < seq_len)
            kept_before += tl.sum(keep.to(tl.int32), 0)
    if kind == 1:
        tl.store(prefix_ptr + out * (seq_len + 1), 0)


def kept_line_blocks(scores: torch.Tensor, threshold: float, vertical_threshold: float | None,
                     block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`pbs.selectors.vertical_slash.kept_lines` in one launch, in the form the compaction reads.

    Args:
        scores: ``(2, B, Hq, Nk)`` float32 from `line_scores` (vertical, then slash).

    Returns:
        ``(vertical_blocks, prefix)``: ``(B, Hq, Tk)`` int8, 1 where a key block holds a kept key,
        and ``(B, Hq, Nk + 1)`` int32, `pbs.selectors.vertical_slash.offset_prefix` of the kept
        offsets.
    """
    _, b, hq, nk = scores.shape
    tk = triton.cdiv(nk, block_size)
    vertical_blocks = torch.empty(b, hq, tk, dtype=torch.int8, device=scores.device)
    prefix = torch.empty(b, hq, nk + 1, dtype=torch.int32, device=scores.device)
    tile = max(block_size, 1024 if interpreting() else KEPT_LINES_TILES[nk >= 65536])
    compact = KEPT_LINES_COMPACT_AFTER is not None
    bucket = torch.empty_like(scores) if compact else scores  # unread without compaction
    _kept_lines[(b * hq, 2)](scores, vertical_blocks, prefix, bucket, b * hq, nk, tk,
                             float(vertical_threshold or threshold), float(threshold),
                             TILE=tile, BLOCK=block_size, DIGIT_BITS=KEPT_LINES_DIGIT_BITS,
                             COMPACT_AFTER=KEPT_LINES_COMPACT_AFTER if compact else 64, num_warps=KEPT_LINES_WARPS,
                             **COMPILE_OPTIONS)
    return vertical_blocks, prefix


def _heads_per_program(group: int, rows_pad: int) -> int:
    """Query heads whose rows one line-score program stacks: at most `LINES_HEADS_PER_PROGRAM`, a
    power of two that divides the KV group (so the stacked heads share one K), at most 256 rows."""
    heads = 1
    while heads * 2 <= LINES_HEADS_PER_PROGRAM and group % (heads * 2) == 0 and heads * 2 * rows_pad <= 256:
        heads *= 2
    return heads


def _programs_base(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter runs programs one after another: a few exercise the tile loop
    return sm_count(device)


def lines_to_block_mask(
    vertical_blocks: torch.Tensor, prefix: torch.Tensor, layout: Layout, force_sink_block: bool,
    extra: BlockMask | None = None, lengths: torch.Tensor | None = None,
) -> BlockMask:
    """The `BlockMask` of the kept lines (`kept_line_blocks`), forced blocks included.

    Args:
        vertical_blocks: ``(B, Hq, Tk)`` int8; prefix: ``(B, Hq, Nk + 1)`` int32.
        layout: the call's geometry (unsegmented, keys in original order).
        force_sink_block: keep key block 0.
        extra: another selection of the same layout whose blocks are kept too (a union's other
            member), merged in the same compaction with no dense mask in between.
        lengths: ``(B, 2)`` int32 on the device: a padded batch (`line_scores`' ``lengths``); entry
            ``b`` gets the mask of its ``len_q`` queries and ``len_k`` keys alone (causal layouts),
            and empty lists past its own blocks. No host read.
    """
    b, hq = layout.batch, layout.heads_q
    tq, tk, nk, bs = layout.num_query_blocks, layout.num_key_blocks, layout.seq_len_k, layout.block_size
    device = prefix.device
    counts = torch.empty(b, hq, tq, dtype=torch.int32, device=device)
    full_counts = torch.empty_like(counts)
    indices = torch.full((b, hq, tq, tk), -1, dtype=block_index_dtype(tk), device=device)
    if extra is None:
        extra_counts, extra_indices, marks = counts, indices, counts  # never read
    else:
        if tuple(extra.indices.shape) != (b, hq, tq, tk):
            raise ValueError(f"extra must be a BlockMask of shape {(b, hq, tq, tk)}, got {tuple(extra.indices.shape)}")
        extra_counts, extra_indices = extra.counts.contiguous(), extra.indices.contiguous()
        marks = torch.zeros(b, hq, tq, tk, dtype=torch.int8, device=device)
    ragged = lengths is not None
    _lines_to_blocks[(b * hq * tq,)](
        vertical_blocks, prefix, counts, indices, full_counts, extra_counts, extra_indices, marks,
        lengths if ragged else part_lengths_placeholder(device),
        tq, tk, hq, prefix.shape[-1], layout.seq_len_q, nk, layout.query_offset,
        BLOCK=bs, CHUNK=min(1024, triton.next_power_of_2(tk)), CAUSAL=layout.causal,
        FORCE_SINK=force_sink_block, EXTRA=extra is not None, RAGGED=ragged,
        **COMPILE_OPTIONS,
    )
    return BlockMask(counts=counts, indices=indices, layout=layout, full_counts=full_counts)
