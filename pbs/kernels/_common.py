"""Constants and small helpers that several kernels share, kept once.

Nothing here imports Triton, so `pbs.kernels` can ask `interpreting` while deciding which backend
runs, before any kernel (and Triton) is loaded.
"""

from __future__ import annotations

import os
from typing import Any

import torch

LOG2_E = 1.4426950408889634
"""log2(e): the kernels compute ``exp(x)`` as ``exp2(x * LOG2_E)``, with the factor folded into the
softmax scale they are passed."""

# int32 scores s of int8 Q.K^T read as the float32 SCORE_OFFSET + s once SCORE_OFFSET_BITS is added
# to their bits: exact while |s| < 2^22, and |s| <= D * 127^2 < 2^22 for head dims up to 256. Both
# kernels read their int8 scores so, with no conversion instruction (I2F) per score.
SCORE_OFFSET = 12582912.0  # 1.5 * 2^23: its float32 neighbours are 1 apart
SCORE_OFFSET_BITS = 0x4B400000  # its bits

FAR_FUTURE = 1 << 30
"""The position given to padded key (and query) slots: later than every real token, so the causal
check ``key_position <= query_position`` drops them without a bounds test of its own.

The Triton and Gluon kernels cast the positions they load to int32, so the value must survive that
cast; ``1 << 30`` does, and is above every real position (a sequence of 2**30 tokens is far beyond
any input these kernels run, whose positions must fit int32 anyway). The
FlexAttention lowering once used ``1 << 62``: harmless in its int64 ``mask_mod``, but the same
value in a Triton kernel would wrap to 0 on the cast and make padded slots the *first* token,
visible to every query. One value, valid in both, is used everywhere. Triton reads module globals
inside ``@jit`` functions only as constexprs, so a kernel module wraps it:
``_FAR_FUTURE = tl.constexpr(FAR_FUTURE)``.
"""

COMPILE_OPTIONS = {"enable_fp_fusion": True}
"""Compile options every kernel launch passes (``kernel[grid](..., **COMPILE_OPTIONS)``).

The kernels are written for fused multiply-adds (the softmax's scale and row max in one FFMA per
score, the polynomials): Triton 3.9 warns that an unset default will turn fusion off in 3.10,
which would slow every kernel here without a word. Asking for it at each launch keeps the
kernels' arithmetic the same on every Triton release and ``TRITON_DEFAULT_FP_FUSION`` setting.
"""


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (Triton's own ``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def pow2_at_least(n: int, floor: int = 16) -> int:
    """The smallest power of two ``>= n`` and ``>= floor``."""
    p = floor
    while p < n:
        p *= 2
    return p


def tma_strides(x: torch.Tensor) -> list[int]:
    """Strides with those of size-1 dims made "contiguous": they never move the address, and TMA
    wants every stride 16-byte aligned."""
    strides = list(x.stride())
    for i in range(x.dim() - 2, -1, -1):
        if x.shape[i] == 1:
            strides[i] = strides[i + 1] * x.shape[i + 1]
    return strides


def tma_descriptor(descriptor_type: type, x: torch.Tensor, rows: int, cols: int, **extra: Any) -> Any:
    """A host tensor descriptor of ``x`` ``(B, H, N, D)`` that moves ``[1, 1, rows, cols]`` tiles.

    ``descriptor_type`` is Triton's ``triton.tools.tensor_descriptor.TensorDescriptor`` or Gluon's
    Hopper one (which also takes ``layout=``, the shared-memory layout, in ``extra``).
    """
    return descriptor_type(x, list(x.shape), tma_strides(x), [1, 1, rows, cols], **extra)


def descriptor_ready(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself if TMA can address it (16-byte aligned base and strides, unit last stride), else a contiguous copy."""
    elem = x.element_size()
    strides = tma_strides(x)
    if strides[-1] == 1 and x.data_ptr() % 16 == 0 and all((s * elem) % 16 == 0 for s in strides[:-1]):
        return x
    return x.contiguous() if not x.is_contiguous() else x.clone()


_SM_COUNTS: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached per device: launchers ask per call)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]
