"""XAttention's strided antidiagonal block shares in Triton: the fast twin of
`pbs.selectors.antidiagonal.antidiagonal_block_scores`.

The reference concatenates ``stride`` consecutive queries in reverse order and ``stride``
consecutive keys in order, so the strided logit of row ``r`` and column ``c`` is
``sum_s q[r * stride + stride - 1 - s] . k[c * stride + s]``. The kernel never builds those
reshaped copies: for each ``s`` it loads every ``stride``-th row of Q and K (a strided row load)
and adds one ``tl.dot``.

One program handles ``BLOCK_QB`` query blocks of one (batch, query head): their strided rows form
the N side of the dot and ``BLOCK_KB`` key blocks' strided keys the M side (the logits are computed
transposed, keys x rows, so that the many keys fill the tensor core's M dimension even when a
program has only 16 rows). Two passes walk the key blocks from the first to the last allowed one of
the program's query blocks, masked with ``allowed`` (block level) and, for XAttention's estimator,
a strided causal mask, as in the reference:

1. online softmax statistics (running max and sum of ``exp2``) of every strided row;
2. the logits again, turned into probabilities and summed per (query block, key block) tile.

Every valid strided row with any allowed key sums to one, so a query block's row total, by which
the reference divides, is its number of such rows: known after pass 1, which lets pass 2 store
finished shares without a third pass. Key blocks outside the walked range are stored as zeros.

By default the walk is done once instead (``one_pass``, while its scratch fits
`ONE_PASS_SCRATCH_BYTES`): each step stores every strided row's partial sum per key block and the
step's running max in float32 scratch, and once the walk has the rows' final max and total the
program rescales those sums into shares. Half the logits, for about ``rows x Tk`` floats of scratch
per program (docs/notes.md, "The antidiagonal share kernel in one walk").

Which strided keys a row sees follows the reference's layout rule (the selector passes it in):

* segmented layout (every permuter but ``none``): ``allowed`` is the layout's *candidate* set, the
  allowed blocks minus the query block's on-diagonal segment (Algorithm 2's ``C``), so the walk
  stops before the own segment and no per-token mask is needed (candidates lie wholly in the past);
* unsegmented layout (``none``, XAttention's ``xattn_estimate``): ``allowed`` is the allowed set and
  ``strided_causal`` adds the strided-level causal mask, strided key ``c`` visible to strided row
  ``r`` iff ``c * stride <= r * stride + (Nk - Nq)``. Every valid row then sees key 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pbs.kernels._common import COMPILE_OPTIONS, LOG2_E, interpreting, sm_count
from pbs.layout import Layout, cdiv



@triton.jit
def _strided_logits_t(
    q_head,
    k_head,
    idx_head,
    stride_qn,
    stride_kn,
    row_tok,
    row_valid,
    col_tok,
    col_valid,
    seq_len_q,
    seq_len_k,
    head_dim,
    STRIDE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_INDICES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Raw strided logits, transposed: ``(BLOCK_C, BLOCK_R)`` float32 (keys x query rows).

    Tokens past ``Nq`` / ``Nk`` read as zero, like the reference's zero padding.
    """
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < head_dim
    acc = tl.zeros([BLOCK_C, BLOCK_R], dtype=tl.float32)
    for s in range(STRIDE):
        q_tok = row_tok + (STRIDE - 1 - s)
        m_q = (row_valid & (q_tok < seq_len_q))[:, None] & m_d[None, :]
        p_q = q_head + q_tok.to(tl.int64)[:, None] * stride_qn + o_d[None, :]
        b_q = tl.load(p_q, mask=m_q, other=0.0)
        k_tok = col_tok + s
        m_k_row = col_valid & (k_tok < seq_len_k)
        if USE_INDICES:
            k_row = tl.load(idx_head + k_tok, mask=m_k_row, other=0)
        else:
            k_row = k_tok
        p_k = k_head + k_row.to(tl.int64)[:, None] * stride_kn + o_d[None, :]
        b_k = tl.load(p_k, mask=m_k_row[:, None] & m_d[None, :], other=0.0)
        acc = tl.dot(b_k, tl.trans(b_q), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _masked_step_logits(
    q_head, k_head, idx_head, allowed_ptr, stride_qn, stride_kn, row_tok, row_valid, qb, kb, c_in,
    seq_len_q, seq_len_k, num_q_blocks, num_k_blocks, head_dim, qk_scale, query_offset,
    BLOCK_SIZE: tl.constexpr, STRIDE: tl.constexpr, PER_BLOCK: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, USE_INDICES: tl.constexpr, DOT_PRECISION: tl.constexpr,
    STRIDED_CAUSAL: tl.constexpr,
):
    """One key step of either pass: ``log2``-scaled strided logits ``(BLOCK_C, BLOCK_R)``, -inf
    where the block pair is not allowed, a row/column is padding or (``STRIDED_CAUSAL``) the
    strided key starts after the strided row's first query position."""
    col_tok = kb * BLOCK_SIZE + c_in * STRIDE
    col_valid = (c_in < PER_BLOCK) & (col_tok < seq_len_k)
    b_s = _strided_logits_t(
        q_head, k_head, idx_head, stride_qn, stride_kn, row_tok, row_valid, col_tok, col_valid,
        seq_len_q, seq_len_k, head_dim,
        STRIDE, BLOCK_R, BLOCK_C, BLOCK_D, USE_INDICES, DOT_PRECISION,
    )
    b_allowed = tl.load(
        allowed_ptr + qb[None, :] * num_k_blocks + kb[:, None],
        mask=(kb < num_k_blocks)[:, None] & (qb < num_q_blocks)[None, :],
        other=0,
    )
    m_keep = (b_allowed != 0) & col_valid[:, None] & row_valid[None, :]
    if STRIDED_CAUSAL:
        m_keep = m_keep & (col_tok[:, None] <= row_tok[None, :] + query_offset)
    return tl.where(m_keep, b_s * qk_scale, float("-inf"))


@triton.jit
def _row_weights(l_i, BLOCK_QB: tl.constexpr, PB: tl.constexpr, BLOCK_R: tl.constexpr):
    """Each strided row's factor ``1 / (l_r * n_seen)``, 0 for a row that sees no key.

    The reference divides each query block's tile sums by their total, which is the number of its
    strided rows that see any key (each such row's probabilities sum to one)."""
    seen = (l_i > 0.0).to(tl.float32)
    n_seen = tl.sum(tl.reshape(seen, [BLOCK_QB, PB]), 1)
    n_seen_r = tl.reshape(tl.broadcast_to(n_seen[:, None], [BLOCK_QB, PB]), [BLOCK_R])
    return tl.where(l_i > 0.0, 1.0 / (tl.where(l_i > 0.0, l_i, 1.0) * tl.maximum(n_seen_r, 1.0)), 0.0)


@triton.jit
def _store_tile_shares(b_s, m_i, w_r, out_head, o_qb, o_k, stride_oq, num_k_blocks, m_out_q,
                       BLOCK_KB: tl.constexpr, BLOCK_QB: tl.constexpr, PB: tl.constexpr):
    """Pass 2 of one key step: probabilities summed per (key block, query block) tile, stored."""
    b_p = tl.math.exp2(b_s - m_i[None, :]) * w_r[None, :]
    b_tile = tl.sum(tl.sum(tl.reshape(b_p, [BLOCK_KB, PB, BLOCK_QB, PB]), 3), 1)
    p_out = out_head + o_qb[None, :] * stride_oq + o_k[:, None]
    tl.store(p_out, b_tile, mask=(o_k < num_k_blocks)[:, None] & m_out_q)


@triton.jit
def _antidiagonal_shares_kernel(
    q_ptr,
    k_ptr,
    idx_ptr,
    allowed_ptr,
    lo_ptr,
    hi_ptr,
    out_ptr,
    part_ptr,
    step_max_ptr,
    pid_offset,
    max_steps,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_ib,
    stride_ih,
    stride_ob,
    stride_oh,
    stride_oq,
    n_heads,
    head_start,
    q_group,
    k_group,
    num_groups,
    seq_len_q,
    seq_len_k,
    num_q_blocks,
    num_k_blocks,
    head_dim,
    qk_scale,
    query_offset,
    BLOCK_SIZE: tl.constexpr,
    STRIDE: tl.constexpr,
    PER_BLOCK: tl.constexpr,
    PB: tl.constexpr,
    BLOCK_QB: tl.constexpr,
    BLOCK_KB: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_INDICES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    STRIDED_CAUSAL: tl.constexpr,
    ONE_PASS: tl.constexpr,
):
    BLOCK_R: tl.constexpr = BLOCK_QB * PB
    BLOCK_C: tl.constexpr = BLOCK_KB * PB

    # Program order (fastest first): query head, query-block group (the longest rows first, so
    # short ones fill the tail of a causal launch), batch. Neighbouring heads of one GQA group run
    # together and walk the same keys, which then stay in L2.
    i_pid = tl.program_id(0) + pid_offset
    i_h = i_pid % n_heads
    i_rest = i_pid // n_heads
    i_g = num_groups - 1 - i_rest % num_groups
    i_b = i_rest // num_groups
    i_hq = head_start + i_h
    i_hk = i_hq // q_group

    q_head = q_ptr + i_b.to(tl.int64) * stride_qb + i_hq.to(tl.int64) * stride_qh
    k_head = k_ptr + i_b.to(tl.int64) * stride_kb + (i_hk // k_group).to(tl.int64) * stride_kh
    idx_head = idx_ptr
    if USE_INDICES:
        idx_head = idx_ptr + i_b.to(tl.int64) * stride_ib + i_hk.to(tl.int64) * stride_ih
    out_head = out_ptr + i_b.to(tl.int64) * stride_ob + i_h.to(tl.int64) * stride_oh

    # Strided query rows: PB (PER_BLOCK rounded up to a power of two) per query block.
    o_r = tl.arange(0, BLOCK_R)
    r_in = o_r % PB
    qb = i_g * BLOCK_QB + o_r // PB
    row_tok = qb * BLOCK_SIZE + r_in * STRIDE
    # As in the reference, a strided row counts when its first token is a real query.
    row_valid = (r_in < PER_BLOCK) & (row_tok < seq_len_q)

    o_c = tl.arange(0, BLOCK_C)
    c_in = o_c % PB
    kb_local = o_c // PB
    o_qb = i_g * BLOCK_QB + tl.arange(0, BLOCK_QB)
    o_kb = tl.arange(0, BLOCK_KB)

    lo = tl.load(lo_ptr + i_g)
    hi = tl.load(hi_ptr + i_g)
    end = lo + tl.cdiv(hi - lo, BLOCK_KB) * BLOCK_KB

    # XAttention's strided causal mask matters only on the key steps that reach past the earliest
    # row's first query position: the steps before `mid` run without it (like FlashAttention's
    # split of the causal loop), so the mask costs nothing away from the diagonal.
    mid = end
    if STRIDED_CAUSAL:
        first_row = i_g * BLOCK_QB * BLOCK_SIZE
        n_free = (first_row + query_offset + STRIDE - lo * BLOCK_SIZE) // (BLOCK_KB * BLOCK_SIZE)
        mid = tl.minimum(lo + tl.maximum(n_free, 0) * BLOCK_KB, end)

    # The two passes of the module docstring, over the same key steps; the loops over passes and
    # parts unroll at compile time, so each pass and part is its own loop in the compiled kernel.
    # A pass walks the steps before `mid` without the strided causal mask, then, for XAttention's
    # estimator, those from `mid` to `end` with it.
    # i_pass 0: softmax statistics per strided row, in the log2 domain. A finite start for the
    #   running max keeps rows that see no key free of inf - inf.
    # i_pass 1: probabilities summed per (key block, query block) tile; finished shares are stored.
    # ONE_PASS walks once: each step also stores, per strided row and key block, its exp2 sum
    # relative to the row's running max at that step (and that max); once the walk has the rows'
    # final max and total, the stored sums are rescaled, weighted and summed per tile. Half the
    # logits of two passes, for a scratch slot of max_steps x BLOCK_KB x BLOCK_R floats per program.
    m_i = tl.full([BLOCK_R], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    m_out_q = (o_qb < num_q_blocks)[None, :]
    slot = tl.program_id(0).to(tl.int64)
    part_slot = part_ptr + slot * max_steps * BLOCK_KB * BLOCK_R
    max_slot = step_max_ptr + slot * max_steps * BLOCK_R
    o_part = o_kb[:, None] * BLOCK_R + o_r[None, :]
    for i_pass in tl.static_range(1 if ONE_PASS else 2):
        if i_pass == 1:
            w_r = _row_weights(l_i, BLOCK_QB, PB, BLOCK_R)
        for i_part in tl.static_range(2 if STRIDED_CAUSAL else 1):
            for kb0 in range(lo if i_part == 0 else mid, mid if i_part == 0 else end, BLOCK_KB):
                b_s = _masked_step_logits(
                    q_head, k_head, idx_head, allowed_ptr, stride_qn, stride_kn, row_tok, row_valid, qb,
                    kb0 + kb_local, c_in, seq_len_q, seq_len_k, num_q_blocks, num_k_blocks, head_dim, qk_scale,
                    query_offset, BLOCK_SIZE, STRIDE, PER_BLOCK, BLOCK_R, BLOCK_C, BLOCK_D, USE_INDICES,
                    DOT_PRECISION, i_part == 1,
                )
                if i_pass == 0:
                    m_new = tl.maximum(m_i, tl.max(b_s, 0))
                    b_p = tl.math.exp2(b_s - m_new[None, :])
                    l_i = l_i * tl.math.exp2(m_i - m_new) + tl.sum(b_p, 0)
                    m_i = m_new
                    if ONE_PASS:
                        step = (kb0 - lo) // BLOCK_KB
                        b_part = tl.sum(tl.reshape(b_p, [BLOCK_KB, PB, BLOCK_R]), 1)
                        tl.store(part_slot + step * BLOCK_KB * BLOCK_R + o_part, b_part)
                        tl.store(max_slot + step * BLOCK_R + o_r, m_new)
                else:
                    _store_tile_shares(b_s, m_i, w_r, out_head, o_qb, kb0 + o_kb, stride_oq, num_k_blocks,
                                       m_out_q, BLOCK_KB, BLOCK_QB, PB)
    if ONE_PASS:
        w_r = _row_weights(l_i, BLOCK_QB, PB, BLOCK_R)
        for kb0 in range(lo, end, BLOCK_KB):
            step = (kb0 - lo) // BLOCK_KB
            b_part = tl.load(part_slot + step * BLOCK_KB * BLOCK_R + o_part)
            f_r = tl.math.exp2(tl.load(max_slot + step * BLOCK_R + o_r) - m_i) * w_r
            b_tile = tl.sum(tl.reshape(b_part * f_r[None, :], [BLOCK_KB, BLOCK_QB, PB]), 2)
            o_k = kb0 + o_kb
            tl.store(out_head + o_qb[None, :] * stride_oq + o_k[:, None], b_tile,
                     mask=(o_k < num_k_blocks)[:, None] & m_out_q)

    # Key blocks outside the walked range are not allowed for any query block here.
    zeros = tl.zeros([BLOCK_KB, BLOCK_QB], dtype=tl.float32)
    for kb0 in range(0, lo, BLOCK_KB):
        o_k = kb0 + o_kb
        tl.store(out_head + o_qb[None, :] * stride_oq + o_k[:, None], zeros, mask=(o_k < lo)[:, None] & m_out_q)
    for kb0 in range(end, num_k_blocks, BLOCK_KB):
        o_k = kb0 + o_kb
        tl.store(
            out_head + o_qb[None, :] * stride_oq + o_k[:, None], zeros, mask=(o_k < num_k_blocks)[:, None] & m_out_q
        )


def _walk_ranges(allowed: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """First and one-past-last allowed key block of each group of ``group`` query blocks.

    Returns:
        ``(lo, hi)``, each ``(ceil(Tq / group),)`` int32; ``lo == hi == 0`` for a group that sees
        nothing.
    """
    tq, tk = allowed.shape
    a8 = allowed.to(torch.uint8)
    seen = allowed.any(-1)
    # argmax returns the first maximal index: the first allowed block, and (flipped) the last one.
    first = torch.where(seen, a8.argmax(-1), tk)
    last = torch.where(seen, tk - a8.flip(-1).argmax(-1), 0)
    pad = cdiv(tq, group) * group - tq
    if pad:
        first = torch.cat([first, first.new_full((pad,), tk)])
        last = torch.cat([last, last.new_zeros(pad)])
    hi = last.view(-1, group).amax(-1)
    lo = torch.minimum(first.view(-1, group).amin(-1), hi)
    return lo.to(torch.int32).contiguous(), hi.to(torch.int32).contiguous()


GPU_TILE = (128, 128, 8, 3)
"""``(strided rows, strided keys, warps, stages)`` per program on the GPU (``gpu_tile`` of
`antidiagonal_block_shares` picks another; benchmarks/sweep_antidiagonal.py times the variants).

128 x 128 with 8 warps and 3 stages won the tile sweep (docs/benchmarks.md gives the times): every
K row a program loads serves twice the query rows of a 64 x 128 tile, which halves the L2 traffic."""


ONE_PASS_SCRATCH_BYTES = 256 * 1024 * 1024
"""Upper bound on the one-pass walk's float32 scratch (partial sums and step maxima) per launch."""


def _blocks_per_program(per_block_pow2: int, rows: int, cols: int) -> tuple[int, int]:
    """``(BLOCK_QB, BLOCK_KB)`` giving about ``rows`` strided rows and ``cols`` strided keys (>= 16 each)."""
    return max(1, max(rows, 16) // per_block_pow2), max(1, max(cols, 16) // per_block_pow2)


def antidiagonal_block_shares(
    q: torch.Tensor,
    k: torch.Tensor,
    layout: Layout,
    stride: int,
    scale: float,
    key_indices: torch.Tensor | None = None,
    head_start: int = 0,
    head_stop: int | None = None,
    allowed: torch.Tensor | None = None,
    *,
    strided_causal: bool | None = None,
    out: torch.Tensor | None = None,
    query_blocks_per_program: int | None = None,
    key_blocks_per_step: int | None = None,
    gpu_tile: tuple[int, int, int, int] = GPU_TILE,
    one_pass: bool | None = None,
    programs_per_launch: int | None = None,
) -> torch.Tensor:
    """Strided antidiagonal block shares of attention, equal to ``antidiagonal_block_scores``.

    With the defaults of ``allowed`` and ``strided_causal`` the result is the reference's for
    ``layout`` (candidate blocks when segmented; allowed blocks and the strided causal mask when not).

    Args:
        q: ``(B, Hq, Nq, D)`` queries in permuted order (fp16, bf16 or fp32).
        k: ``(B, Hk, Nk, D)`` keys in permuted order with ``Hq % Hk == 0`` (query head ``h`` reads
            key head ``h // (Hq // Hk)``); with ``key_indices``, ``(B, Hkv, Nk, D)`` keys in
            original order with ``Hk % Hkv == 0``.
        layout: geometry of the call (block size, lengths, causality).
        stride: antidiagonal stride; must divide ``layout.block_size``.
        scale: softmax scale (the strided logits use ``scale / stride``, as the reference).
        key_indices: ``(B, Hk, Nk)`` int64 or None: permuted key slot ``t`` of key head ``h`` is row
            ``key_indices[b, h, t]`` of ``k``'s head ``h * Hkv // Hk``; None when ``k`` is permuted.
        head_start, head_stop: compute query heads ``[head_start, head_stop)`` only.
        allowed: ``(Tq, Tk)`` bool block mask of the softmax, default ``layout.candidate_blocks``
            (the allowed blocks when the layout is unsegmented).
        strided_causal: also mask strided key ``c`` for strided row ``r`` unless
            ``c * stride <= r * stride + (Nk - Nq)`` (XAttention's estimator); default
            ``layout.causal and not layout.segmented``.
        out: optional ``(B, head_stop - head_start, Tq, Tk)`` float32 buffer to write (every
            element is written); allocated when None.
        query_blocks_per_program, key_blocks_per_step: tuning overrides (powers of two); by default
            about ``gpu_tile``'s strided rows x strided keys per step on a GPU, 16 x 32 in the interpreter.
        gpu_tile: ``(strided rows, strided keys, warps, stages)`` per program on a GPU (`GPU_TILE`).
        one_pass: walk the strided logits once instead of twice (statistics, then shares), keeping
            each strided row's partial sum per key block in float32 scratch (about ``rows x Tk``
            floats per program of a launch); the programs then run in launches of
            ``programs_per_launch`` (default two per SM on a GPU, all of them in the interpreter).
            None (default): one pass when the scratch of one program per SM (of every program in
            the interpreter) fits `ONE_PASS_SCRATCH_BYTES`, else two passes. Both walks give
            the same shares up to float rounding.

    Returns:
        ``(B, head_stop - head_start, Tq, Tk)`` float32: per query block, the share of its strided
        attention that falls in each key block (rows sum to one, or are all zero).
    """
    b, hq, nq, d = q.shape
    bs = layout.block_size
    if stride <= 0 or bs % stride:
        raise ValueError(f"stride ({stride}) must divide block_size ({bs})")
    if nq != layout.seq_len_q or k.shape[2] != layout.seq_len_k or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} do not match the layout {layout}")
    if key_indices is None:
        hk = k.shape[1]
        k_group = 1
    else:
        hk = key_indices.shape[1]
        if key_indices.shape != (b, hk, layout.seq_len_k) or hk % k.shape[1]:
            raise ValueError(f"key_indices {tuple(key_indices.shape)} do not fit k {tuple(k.shape)}")
        k_group = hk // k.shape[1]
    if k.dtype != q.dtype:
        raise ValueError(f"q and k must have one dtype, got {q.dtype} and {k.dtype}")
    if hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of key heads ({hk})")
    head_stop = hq if head_stop is None else head_stop
    if not 0 <= head_start < head_stop <= hq:
        raise ValueError(f"head range [{head_start}, {head_stop}) is not inside [0, {hq})")
    tq, tk = layout.num_query_blocks, layout.num_key_blocks
    if allowed is None:
        allowed = layout.candidate_blocks(q.device)
    if strided_causal is None:
        strided_causal = layout.causal and not layout.segmented
    if allowed.shape != (tq, tk):
        raise ValueError(f"allowed must be ({tq}, {tk}), got {tuple(allowed.shape)}")
    allowed = allowed.to(device=q.device, dtype=torch.bool).contiguous()

    n_heads = head_stop - head_start
    if out is None:
        out = torch.empty(b, n_heads, tq, tk, dtype=torch.float32, device=q.device)
    elif out.shape != (b, n_heads, tq, tk) or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"out must be float32 ({b}, {n_heads}, {tq}, {tk}) with unit last stride")
    if out.numel() == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if key_indices is not None and key_indices.stride(-1) != 1:
        key_indices = key_indices.contiguous()

    per_block = bs // stride
    pb = triton.next_power_of_2(per_block)
    on_gpu = q.is_cuda and not interpreting()
    # GPU: `gpu_tile` (GPU_TILE). The interpreter: small tiles, so the tests' short sequences still
    # take several steps and groups.
    rows, cols, num_warps, num_stages = gpu_tile if on_gpu else (16, 32, 4, 1)
    qb_per, kb_per = _blocks_per_program(pb, rows, cols)
    if query_blocks_per_program is not None:
        qb_per = query_blocks_per_program
    if key_blocks_per_step is not None:
        kb_per = key_blocks_per_step
    if qb_per * pb < 16 or kb_per * pb < 16:
        raise ValueError("a program needs at least 16 strided rows and 16 strided keys (tl.dot)")
    if on_gpu:
        # Short sequences: fewer query blocks per program rather than idle SMs.
        sms = sm_count(q.device)
        while qb_per * pb > 16 and b * n_heads * cdiv(tq, qb_per) < 2 * sms:
            qb_per //= 2

    lo, hi = _walk_ranges(allowed, qb_per)
    num_groups = lo.shape[0]
    idx = key_indices if key_indices is not None else lo  # any pointer; not read without indices
    programs = b * n_heads * num_groups
    block_r = qb_per * pb
    steps = cdiv(tk, kb_per)
    program_scratch_bytes = steps * (kb_per + 1) * block_r * 4
    if one_pass is None or (one_pass and programs_per_launch is None):
        # Two programs per SM on a GPU, as many as the budget holds; every program in one launch
        # when interpreted.
        sms = sm_count(q.device) if on_gpu else programs
        fitting = ONE_PASS_SCRATCH_BYTES // program_scratch_bytes
        if one_pass is None:
            one_pass = fitting >= min(sms, programs)
        if programs_per_launch is None:
            programs_per_launch = max(1, min(2 * sms, fitting)) if on_gpu else programs
    # Two passes read no scratch: a constant 0 keeps the compiled variants to those of before.
    max_steps = steps if one_pass else 0
    if one_pass:
        per_launch = max(1, min(programs, programs_per_launch))
        part = torch.empty(per_launch * max_steps * kb_per * block_r, dtype=torch.float32, device=q.device)
        step_max = torch.empty(per_launch * max_steps * block_r, dtype=torch.float32, device=q.device)
    else:
        per_launch = programs
        part = step_max = lo  # any pointer; not read in two passes
    for first in range(0, programs, per_launch):
        _antidiagonal_shares_kernel[(min(per_launch, programs - first),)](
            q, k, idx, allowed.view(torch.uint8), lo, hi, out, part, step_max, first, max_steps,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            *(key_indices.stride()[:2] if key_indices is not None else (0, 0)),
            out.stride(0), out.stride(1), out.stride(2),
            n_heads, head_start, hq // hk, k_group, num_groups,
            layout.seq_len_q, layout.seq_len_k, tq, tk, d,
            scale / stride * LOG2_E,
            layout.query_offset,
            BLOCK_SIZE=bs,
            STRIDE=stride,
            PER_BLOCK=per_block,
            PB=pb,
            BLOCK_QB=qb_per,
            BLOCK_KB=kb_per,
            BLOCK_D=max(16, triton.next_power_of_2(d)),
            USE_INDICES=key_indices is not None,
            # fp32: exact products so that the result matches the fp32 reference closely.
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
            STRIDED_CAUSAL=bool(strided_causal),
            ONE_PASS=one_pass,
            num_warps=num_warps,
            num_stages=num_stages,
            **COMPILE_OPTIONS,
        )
    return out
