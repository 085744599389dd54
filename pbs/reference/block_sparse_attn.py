"""Block-sparse attention from a `BlockMask`, in fp32: the kernel's eager twin.

It masks full attention rows to the selected key blocks and applies causality on *original* token
positions, which is what keeps permuted attention exact inside the on-diagonal segment. It is
written for clarity and CPU speed, not to skip work: the kernels do that.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pbs.reference.logits import grouped_logits
from pbs.types import BlockMask

_CHUNK_ELEMENTS = 1 << 25


def block_sparse_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: BlockMask,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    scale: float | None = None,
    causal: bool = True,
    return_lse: bool = False,
    probs_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query over the key blocks its query block selected.

    Args:
        q: ``(B, Hq, Nq, D)`` queries in permuted order.
        k: ``(B, Hk, Nk, D)`` keys in permuted order, ``Hq % Hk == 0`` (``Hk`` = ``Hq`` or ``Hkv``).
        v: ``(B, Hk, Nk, Dv)`` values in the keys' order.
        mask: selected key blocks, ``(B, Hq, Tq, ...)``.
        query_positions: ``(B, Hq, Nq)`` original position of each query slot.
        key_positions: ``(B, Hk, Nk)`` original position of each key slot.
        scale: softmax scale, default ``D ** -0.5``.
        causal: mask pairs with ``key_position > query_position``.
        return_lse: also return the log-sum-exp of each query's scaled scores over the keys it
            attends to.
        probs_transform: applied to each chunk's ``(B, Hq, M, n)`` softmax rows before they
            weight the values (`pbs.reference.fp8` quantizes them there); None: none.

    Returns:
        ``(B, Hq, Nq, Dv)`` float32 in permuted query order. A query with no selected key gets 0.
        With ``return_lse``, also ``(B, Hq, Nq)`` float32 (natural log; ``-inf`` for a query with
        no selected key).

    NaN in, NaN out: a query with a NaN score (from its own row of ``q`` or a key it attends to)
    gets a NaN output row and a NaN LSE; a NaN or inf in ``v`` makes NaN the output of each query
    that attends to its key, and of no other. ``-inf`` stays reserved for "saw no key".
    """
    layout = mask.layout
    b, hq, nq, d = q.shape
    hk, nk, dv = k.shape[1], k.shape[2], v.shape[-1]
    group = hq // hk
    bs = layout.block_size
    scale = d**-0.5 if scale is None else scale
    # The plainest form that is still affordable: full logits of a chunk of query rows, masked by
    # the selected blocks (expanded to tokens) and by causality on original positions. Its cost
    # does not follow the density, but it is one matmul per chunk and nothing is gathered, which
    # on a CPU is several times faster than gathering the selected blocks.
    selected_blocks = mask.to_dense()  # (B, Hq, Tq, Tk)
    k32, v32 = k.float(), v.float()
    # NaN or inf in V would reach, through 0 * NaN, every row whose logits span its key, whether
    # the row attends to it or not: such values are zeroed in the product and their rows marked.
    finite_values = torch.isfinite(v32)
    bad_values, v_finite = None, v32
    if not bool(finite_values.all()):
        bad_values = (~finite_values).float()
        v_finite = v32.masked_fill(~finite_values, 0.0)
    kpos = key_positions.repeat_interleave(group, dim=1) if group > 1 else key_positions
    out = torch.empty(b, hq, nq, dv, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, hq, nq, dtype=torch.float32, device=q.device) if return_lse else None
    rows_per_chunk = max(bs, (_CHUNK_ELEMENTS // max(1, b * hq * nk)) // bs * bs)
    for r0 in range(0, nq, rows_per_chunk):
        r1 = min(nq, r0 + rows_per_chunk)
        m = r1 - r0
        qpos = query_positions[:, :, r0:r1]
        # Key slots that may hold a visible key: a slot holds a token of its own segment (or of
        # the unpermuted tail), so nothing past the segment of the latest query is needed, and
        # nothing before the segment of the earliest query can be in its future.
        n_keys, first_future = nk, 0
        if causal:
            n_keys = min(nk, _segment_end(int(qpos.max()), layout))
            first_future = _segment_start(int(qpos.min()), layout)
        logits = grouped_logits(q[:, :, r0:r1], k32[:, :, :n_keys]) * scale  # (B, Hq, M, n_keys)
        block_rows = selected_blocks[:, :, r0 // bs : -(-r1 // bs)].repeat_interleave(bs, 2)[:, :, :m]
        keep = block_rows[..., : -(-n_keys // bs)].repeat_interleave(bs, 3)[..., :n_keys]
        if causal and first_future < n_keys:
            tail = keep[..., first_future:] & (kpos[:, :, None, first_future:n_keys] <= qpos[..., None])
            keep[..., first_future:] = tail
        logits = logits.masked_fill_(~keep, float("-inf"))
        if lse is not None:
            lse[:, :, r0:r1] = logits.logsumexp(-1)
        # A row that sees no key is all -inf, whose softmax is NaN: it gets 0. A NaN score leaves
        # its row NaN (output and LSE), as in the kernels.
        probs = logits.softmax(-1).masked_fill_(~keep.any(-1, keepdim=True), 0.0)
        if probs_transform is not None:
            probs = probs_transform(probs)
        grouped = probs.view(b, hk, group, m, n_keys)
        chunk_out = torch.einsum("bhgmn,bhnd->bhgmd", grouped, v_finite[:, :, :n_keys])
        if bad_values is not None:
            # A non-finite value reaches the rows that attend to its key, and no other row.
            hits = torch.einsum("bhgmn,bhnd->bhgmd", keep.view(b, hk, group, m, n_keys).float(),
                                bad_values[:, :, :n_keys])
            chunk_out.masked_fill_(hits > 0, float("nan"))
        out[:, :, r0:r1] = chunk_out.reshape(b, hq, m, dv)
    return (out, lse) if lse is not None else out


def _segment_start(position: int, layout) -> int:
    """First key slot whose token may be at or after ``position``."""
    if position >= layout.permutable_key_len:
        return position
    return position // layout.segment_size * layout.segment_size


def _segment_end(position: int, layout) -> int:
    """One past the last key slot whose token may be at or before ``position``."""
    if position >= layout.permutable_key_len:
        return position + 1
    return (position // layout.segment_size + 1) * layout.segment_size
