"""The density probe in three launches: the fast twin of `pbs.reference.density_probe.probe_density`.

The eager twin takes about twenty small PyTorch ops; at 16K tokens their launch cost alone is a
few percent of cuDNN's whole attention, which is the margin the probe must fit in (flat attention
runs the probe and then dense attention). Here:

1. every key block is mean-pooled (one read of K): by one PyTorch reduction when ``Nk`` is a
   multiple of the block size, else by `pbs.kernels.block_means.block_means`; right after a host
   sync a Triton launch cost ~200 us of host time on an H100 machine, a PyTorch launch far less;
2. one zeroed buffer holds the two counters and the kernel's scratch rows;
3. ``_probe_kernel``: one program per (sampled query block, batch x query head) pools its query
   block, scores it against the visible key blocks, and counts the blocks that cover
   ``threshold`` of the row's pooled mass, sink and diagonal blocks first. The count needs the
   other blocks in descending order; instead of sorting, it bisects for the smallest kept
   probability (a row has at most a few thousand key blocks, read from L2 on every step).
   Two int32 counters (kept, visible) are summed with atomics, so the host reads two numbers.

The bisection keeps exactly the blocks the sort would keep, except at probabilities equal to
within 2^-24; the test compares the two twins.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pbs.kernels._common import COMPILE_OPTIONS, LOG2_E
from pbs.kernels.block_means import block_means

_CHUNK = 128  # key blocks per step of the scans
_SCORE_CHUNK = 32  # key blocks per step of the scoring pass (a 32 x D fp32 tile stays in registers)
_BISECTION_STEPS = 24  # resolution 2^-24 of a probability
_SCRATCH_OFFSET = 32  # int32 slots before the scratch rows: the two counters, padded to 128 bytes


@triton.jit
def _free_block_probabilities(p_s, j0, num_key_blocks, first_q, m_i, l_i, BLOCK_SIZE: tl.constexpr,
                              CHUNK: tl.constexpr, CAUSAL: tl.constexpr):
    """Probabilities of key blocks ``j0 .. j0 + CHUNK`` from the scratch row's base-2 logits, and
    which of them are free to keep or drop: visible, not the sink, not on the diagonal."""
    o_j = j0 + tl.arange(0, CHUNK)
    s = tl.load(p_s + o_j, mask=o_j < num_key_blocks, other=-float("inf"))
    free = (s > -float("inf")) & (o_j != 0)
    if CAUSAL:
        free = free & ((o_j + 1) * BLOCK_SIZE <= first_q)
    return tl.exp2(s - m_i) / l_i, free


@triton.jit
def _probe_kernel(
    q_ptr, kmean_ptr, counter_ptr,
    stride_qb, stride_qh, stride_qn,
    heads_q, group, seq_len_q, seq_len_k, dim, num_key_blocks, num_query_blocks, num_samples,
    scale_log2, threshold,
    BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr,
    SCORE_CHUNK: tl.constexpr, CAUSAL: tl.constexpr, STEPS: tl.constexpr, SCRATCH_OFFSET: tl.constexpr,
):
    i_s = tl.program_id(0)
    i_bh = tl.program_id(1)
    scratch_ptr = (counter_ptr + SCRATCH_OFFSET).to(tl.pointer_type(tl.float32))
    i_b = i_bh // heads_q
    i_h = i_bh % heads_q
    # The same blocks as sampled_query_blocks: round(i (Tq - 1) / (P - 1)), halves up.
    if num_samples > 1:
        row = (2 * i_s * (num_query_blocks - 1) + (num_samples - 1)) // (2 * (num_samples - 1))
    else:
        row = num_query_blocks - 1

    # Pool the query block (its valid rows only).
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < dim
    first = row * BLOCK_SIZE
    count = tl.minimum(seq_len_q - first, BLOCK_SIZE)
    p_q = q_ptr + i_b.to(tl.int64) * stride_qb + i_h.to(tl.int64) * stride_qh
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for r0 in range(0, BLOCK_SIZE, ROWS):
        o_r = first + r0 + tl.arange(0, ROWS)
        m_r = o_r < seq_len_q
        x = tl.load(p_q + o_r[:, None].to(tl.int64) * stride_qn + o_d[None, :], mask=m_r[:, None] & m_d[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32), 0)
    q_pooled = acc / count

    offset = seq_len_k - seq_len_q
    first_q = offset + first
    last_q = offset + first + count - 1
    p_k = kmean_ptr + (i_b * (heads_q // group) + i_h // group).to(tl.int64) * num_key_blocks * dim
    p_s = scratch_ptr + (i_bh * num_samples + i_s).to(tl.int64) * num_key_blocks

    # Pass 1: logits (base 2) to the scratch row, with the running max and sum of the visible ones.
    m_i = -float("inf")
    l_i = 0.0
    for j0 in range(0, num_key_blocks, SCORE_CHUNK):
        o_j = j0 + tl.arange(0, SCORE_CHUNK)
        m_j = o_j < num_key_blocks
        if CAUSAL:
            m_j = m_j & (o_j * BLOCK_SIZE <= last_q)
        km = tl.load(p_k + o_j[:, None].to(tl.int64) * dim + o_d[None, :], mask=m_j[:, None] & m_d[None, :], other=0.0)
        s = tl.sum(km * q_pooled[None, :], 1) * scale_log2
        s = tl.where(m_j, s, -float("inf"))
        tl.store(p_s + o_j, s, mask=o_j < num_key_blocks)
        m_new = tl.maximum(m_i, tl.max(s, 0))
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new), 0)
        m_i = m_new

    # Pass 2: the forced blocks' mass and the counts.
    forced_mass = 0.0
    n_forced = 0
    n_visible = 0
    for j0 in range(0, num_key_blocks, CHUNK):
        o_j = j0 + tl.arange(0, CHUNK)
        s = tl.load(p_s + o_j, mask=o_j < num_key_blocks, other=-float("inf"))
        vis = s > -float("inf")
        if CAUSAL:
            forced = vis & ((o_j == 0) | ((o_j + 1) * BLOCK_SIZE > first_q))
        else:
            forced = vis & (o_j == 0)
        p = tl.exp2(s - m_i) / l_i
        forced_mass += tl.sum(tl.where(forced, p, 0.0), 0)
        n_forced += tl.sum(forced.to(tl.int32), 0)
        n_visible += tl.sum(vis.to(tl.int32), 0)

    # Bisection for the smallest probability c whose blocks (p >= c, not forced) still bring the
    # kept mass to the threshold; all of them are kept.
    need = threshold - forced_mass
    lo = 0.0
    hi = 1.0
    for _ in range(STEPS):
        mid = (lo + hi) * 0.5
        total = 0.0
        for j0 in range(0, num_key_blocks, CHUNK):
            p, free = _free_block_probabilities(
                p_s, j0, num_key_blocks, first_q, m_i, l_i, BLOCK_SIZE=BLOCK_SIZE, CHUNK=CHUNK, CAUSAL=CAUSAL
            )
            total += tl.sum(tl.where(free & (p >= mid), p, 0.0), 0)
        if total >= need:
            lo = mid
        else:
            hi = mid
    n_kept = 0
    if need > 0:
        for j0 in range(0, num_key_blocks, CHUNK):
            p, free = _free_block_probabilities(
                p_s, j0, num_key_blocks, first_q, m_i, l_i, BLOCK_SIZE=BLOCK_SIZE, CHUNK=CHUNK, CAUSAL=CAUSAL
            )
            n_kept += tl.sum((free & (p >= lo)).to(tl.int32), 0)
    tl.atomic_add(counter_ptr, n_forced + n_kept)
    tl.atomic_add(counter_ptr + 1, n_visible)


def probe_density_triton(
    q: torch.Tensor, k: torch.Tensor, *, block_size: int, num_blocks: int, threshold: float, scale: float,
    causal: bool = True, block_table: torch.Tensor | None = None, seq_len_k: int | None = None,
) -> float:
    """`pbs.reference.density_probe.probe_density` in three launches and one read of two numbers.

    Args:
        q: ``(B, Hq, Nq, D)``; k: ``(B, Hkv, Nk, D)`` (unit stride along D is not required).
        block_table, seq_len_k: ``k`` is a paged cache ``(num_pages, page_size, Hkv, D)`` holding
            one sequence of ``seq_len_k`` keys through this ``(max_pages,)`` int32 table (``B`` 1),
            pooled in place (`pbs.kernels.block_means.block_means`).

    Returns:
        The estimate as a Python float (the read is the probe's one host sync).
    """
    if threshold >= 1.0:
        return 1.0
    kept, visible = probe_counters_triton(
        q, k, block_size=block_size, num_blocks=num_blocks, threshold=threshold, scale=scale, causal=causal,
        block_table=block_table, seq_len_k=seq_len_k,
    )[:2].tolist()
    return kept / visible


def probe_counters_triton(
    q: torch.Tensor, k: torch.Tensor, *, block_size: int, num_blocks: int, threshold: float, scale: float,
    causal: bool = True, block_table: torch.Tensor | None = None, seq_len_k: int | None = None,
) -> torch.Tensor:
    """The probe's work without the read: an int32 buffer on ``q``'s device whose slots 0 and 1
    will hold (kept, visible), the estimate being ``kept / visible``; slots 2-31 are zero and
    free for a later kernel in the stream (`pbs.kernels.hopper_attn.launch_hopper_dense` takes
    slot 2 as its tile counter). ``threshold`` must be below 1 (at 1 every visible block is kept)."""
    if not threshold < 1.0:
        raise ValueError(f"threshold must be below 1 for the probe to count anything, got {threshold}")
    b, hq, nq, d = q.shape
    if block_table is not None:
        hkv, nk = k.shape[2], seq_len_k
    else:
        _, hkv, nk, _ = k.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    tq, tk = triton.cdiv(nq, block_size), triton.cdiv(nk, block_size)
    if block_table is not None:
        k_means = block_means(k, block_size, block_table=block_table, seq_len=nk)
    elif nk % block_size == 0:
        # One PyTorch reduction: its launch costs a fraction of a Triton launch's host time, which
        # is most of the probe's cost (the probe sits between the call and dense attention).
        k_means = k.unflatten(2, (tk, block_size)).mean(3, dtype=torch.float32).contiguous()
    else:
        k_means = block_means(k, block_size)  # (B, Hkv, Tk, D) fp32, the partial last block too
    samples = min(num_blocks, tq)
    # The two counters and the kernel's scratch rows in one zeroed allocation (one launch fewer).
    counters_and_scratch = torch.zeros(_SCRATCH_OFFSET + b * hq * samples * tk, dtype=torch.int32, device=q.device)
    block_d = triton.next_power_of_2(d)
    _probe_kernel[(samples, b * hq)](
        q, k_means, counters_and_scratch,
        q.stride(0), q.stride(1), q.stride(2),
        hq, hq // hkv, nq, nk, d, tk, tq, samples,
        scale * LOG2_E, threshold,
        BLOCK_SIZE=block_size, BLOCK_D=block_d, ROWS=max(1, min(block_size, 4096 // block_d)), CHUNK=_CHUNK,
        SCORE_CHUNK=_SCORE_CHUNK, CAUSAL=causal, STEPS=_BISECTION_STEPS, SCRATCH_OFFSET=_SCRATCH_OFFSET,
        num_warps=4,
        **COMPILE_OPTIONS,
    )
    return counters_and_scratch
