"""Small shared helpers for the tests."""

from __future__ import annotations

import torch

import pbs
from pbs.layout import Layout


def random_qkv(batch=2, heads_q=4, heads_kv=2, seq_len=300, head_dim=16, seq_len_q=None, seed=0, dtype=torch.float32):
    """Plain Gaussian q, k, v (shapes as in pbs.attention)."""
    gen = torch.Generator().manual_seed(seed)
    nq = seq_len if seq_len_q is None else seq_len_q
    q = torch.randn(batch, heads_q, nq, head_dim, generator=gen).to(dtype)
    k = torch.randn(batch, heads_kv, seq_len, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, heads_kv, seq_len, head_dim, generator=gen).to(dtype)
    return q, k, v


def small_config(**overrides) -> pbs.PBSConfig:
    """Block 32 / segment 64 so that small sequences have several segments."""
    base = dict(block_size=32, segment_size=64)
    base.update(overrides)
    return pbs.PBSConfig(**base)


def layout_of(q, k, config) -> Layout:
    from pbs.planning import make_layout

    return make_layout(q, k, config)
