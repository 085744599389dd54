"""``torch.ops.pbs.attention``: `pbs.attention` as a PyTorch custom op, for ``torch.compile``.

Planning branches on values and launches Triton kernels with host-side arguments, which Dynamo
should not trace; as an opaque custom op with a shape-only fake implementation it compiles into a
graph (no graph break) and runs eagerly inside it. `pbs.attention` routes here by itself when
it is called under ``torch.compile``; the config travels as its JSON string.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("pbs::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config_json: str, scale: float) -> torch.Tensor:
    """PBS attention of ``q (B, Hq, Nq, D)``, ``k (B, Hkv, Nk, D)``, ``v (B, Hkv, Nk, Dv)`` -> ``(B, Hq, Nq, Dv)``."""
    from pbs.api import attention

    return attention(q, k, v, config_json, scale=scale)


@attention_op.register_fake
def _attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config_json: str, scale: float) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1], q.shape[2], v.shape[-1])
