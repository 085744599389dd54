"""Where each packed token sits in a padded batch, and taking the rows back out.

The capturable varlen path (`pbs.serving.capturable`) pads every sequence of a packed or paged
batch to ``(max_q, max_k)`` rows, rounded up to whole blocks, so that every launch has a shape fixed
by the maxima alone (`pbs.ragged_layout.RaggedGeometry` describes the padded grid). The padding
itself is `pbs.backends.padding` (a Triton kernel on CUDA, else `pbs.reference.pad_rows`); the
slots of the packed tokens (`flat_slots`, `sequence_slots`) are the eager twin's. Nothing here
reads a tensor on the host.
"""

from __future__ import annotations

import torch

from pbs.reference.pad_rows import flat_slots, sequence_slots

__all__ = ["flat_slots", "sequence_slots", "unpad_rows"]


def unpad_rows(padded: torch.Tensor, cu_seq_q: torch.Tensor, total: int) -> torch.Tensor:
    """The packed rows of ``padded (N, H, rows, ...)``: ``(total, H, ...)``, token ``t`` of the
    packing taken from its slot (`sequence_slots`)."""
    sequence, row = sequence_slots(cu_seq_q, total, padded.shape[2])
    return padded.transpose(1, 2)[sequence, row]
