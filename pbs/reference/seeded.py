"""Seeded random draws shared by the seeded components (the ``random`` permuter, the ``budget``
selector), and the head-shard context that keeps them identical under tensor parallelism."""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

import torch
from pydantic import AfterValidator

SEED_LIMIT = 2**64
"""Seeds lie in ``0 <= seed < 2**64``: what `torch.Generator.manual_seed` takes (it reads a uint64;
a negative seed would alias ``seed + 2**64``, and 2**64 or more overflows)."""


def check_seed(seed: int) -> int:
    """Returns ``seed`` if `torch.Generator.manual_seed` takes it as it is; raises ``ValueError`` otherwise."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed must be an integer with 0 <= seed < 2**64 (a torch.Generator seed), got {seed!r}")
    return seed


Seed = Annotated[int, AfterValidator(check_seed)]
"""The type of a component's ``seed`` field: an int that `check_seed` accepts."""


def seeded_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A seeded generator; the CPU default gives the same draws whatever device the data is on."""
    check_seed(seed)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


# (rank, size) while the heads of a call are one rank's share of a tensor-parallel layer; see head_shard.
_HEAD_SHARD: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar("pbs_head_shard", default=None)


@contextmanager
def head_shard(rank: int, size: int) -> Iterator[None]:
    """Seeded draws inside the block give the heads of ``rank`` what the whole layer would draw.

    Under tensor parallelism each of ``size`` ranks holds an equal, contiguous share of the query
    and KV heads (rank ``r`` holds heads ``r * H_local`` to ``(r + 1) * H_local - 1``). Seeded
    components (the ``random`` permuter, the ``budget`` selector) draw one tensor over the head
    axis, so a rank drawing for its ``H_local`` heads alone would give them the draws of heads
    ``0 .. H_local - 1``; `seeded_rand` draws for all ``size * H_local`` heads instead and keeps
    this rank's slice, so a sharded run selects exactly what one process would.
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank must be in [0, size), got rank={rank}, size={size}")
    token = _HEAD_SHARD.set((rank, size) if size > 1 else None)
    try:
        yield
    finally:
        _HEAD_SHARD.reset(token)


def seeded_rand(
    shape: tuple[int, ...], seed: int, device: torch.device | str = "cpu", *, head_dim: int = 1
) -> torch.Tensor:
    """``torch.rand(shape)`` in float32 from a generator seeded with ``seed``, on ``device``.

    float32 whatever `torch.get_default_dtype` says: a float64 draw gives other values, and so a
    seeded component would choose differently under ``torch.set_default_dtype(torch.float64)``.

    Inside `head_shard`, ``shape[head_dim]`` is this rank's share of the heads: the draw is made
    for every rank's heads and this rank's slice is returned, so the values do not depend on how
    the heads are split.
    """
    shard = _HEAD_SHARD.get()
    generator = seeded_generator(seed, device)
    if shard is None:
        return torch.rand(shape, generator=generator, dtype=torch.float32, device=device)
    rank, size = shard
    heads = shape[head_dim]
    full = list(shape)
    full[head_dim] = heads * size
    draw = torch.rand(full, generator=generator, dtype=torch.float32, device=device)
    return draw.narrow(head_dim, rank * heads, heads).contiguous()
