"""Block-sparse attention from a :class:`~pbs.types.BlockMask`, in fp32: the kernel's eager twin.

It gathers only the selected key blocks of every query block, so its cost follows the mask's
density, and applies causality on *original* token positions, which is what keeps permuted
attention exact inside the on-diagonal segment.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
) -> torch.Tensor:
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

    Returns:
        ``(B, Hq, Nq, Dv)`` float32 in permuted query order. A query with no selected key gets 0.
    """
    layout = mask.layout
    b, hq, nq, d = q.shape
    hk, nk, dv = k.shape[1], k.shape[2], v.shape[-1]
    group = hq // hk
    bs, tq, tk = layout.block_size, layout.num_query_blocks, layout.num_key_blocks
    scale = d**-0.5 if scale is None else scale

    pad_k = tk * bs - nk
    pad_q = tq * bs - nq
    k_blocks = F.pad(k.float(), (0, 0, 0, pad_k)).view(b, hk, tk, bs, d)
    v_blocks = F.pad(v.float(), (0, 0, 0, pad_k)).view(b, hk, tk, bs, dv)
    # Padded key slots get a position no query reaches and are also masked explicitly.
    kpos_blocks = F.pad(key_positions, (0, pad_k), value=-1).view(b, hk, tk, bs)
    key_real = (torch.arange(tk * bs, device=q.device) < nk).view(tk, bs)
    q_blocks = F.pad(q.float(), (0, 0, 0, pad_q)).view(b, hq, tq, bs, d)
    qpos_blocks = F.pad(query_positions, (0, pad_q), value=-1).view(b, hq, tq, bs)

    batch_idx = torch.arange(b, device=q.device)[:, None, None, None]
    kv_head_idx = (torch.arange(hq, device=q.device) // group)[None, :, None, None]
    out = torch.zeros(b, hq, tq, bs, dv, dtype=torch.float32, device=q.device)
    per_qblock = b * hq * bs * tk * bs
    step = max(1, _CHUNK_ELEMENTS // max(1, per_qblock))
    for i0 in range(0, tq, step):
        i1 = min(tq, i0 + step)
        counts = mask.counts[:, :, i0:i1].long()
        width = int(counts.max()) if counts.numel() else 0
        if width == 0:
            continue
        idx = mask.indices[:, :, i0:i1, :width].long()
        selected = torch.arange(width, device=q.device) < counts[..., None]  # (B, Hq, c, W)
        idx = idx.clamp(min=0)
        k_sel = k_blocks[batch_idx, kv_head_idx, idx]  # (B, Hq, c, W, bs, D)
        v_sel = v_blocks[batch_idx, kv_head_idx, idx]
        kpos = kpos_blocks[batch_idx, kv_head_idx, idx]  # (B, Hq, c, W, bs)
        valid = selected[..., None] & key_real[idx]
        logits = torch.einsum("bhcqd,bhcwkd->bhcqwk", q_blocks[:, :, i0:i1], k_sel) * scale
        keep = valid[:, :, :, None]
        if causal:
            qpos = qpos_blocks[:, :, i0:i1, :, None, None]
            keep = keep & (kpos[:, :, :, None] <= qpos)
        logits = logits.masked_fill(~keep, float("-inf"))
        c = i1 - i0
        probs = logits.view(b, hq, c, bs, width * bs).softmax(-1).nan_to_num_(0.0)
        out[:, :, i0:i1] = torch.einsum("bhcqm,bhcmd->bhcqd", probs, v_sel.view(b, hq, c, width * bs, dv))
    return out.view(b, hq, tq * bs, dv)[:, :, :nq]
