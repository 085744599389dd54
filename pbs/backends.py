"""Attention backends: each declares what it supports and runs a plan on permuted tensors.

``auto`` picks the first backend with no reasons against it; when an explicitly requested backend
cannot run, the error lists that backend's reasons (and, for ``auto``, every backend's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pbs.reference.block_sparse import block_sparse_attention_reference
from pbs.types import Plan


@dataclass(frozen=True)
class AttentionCall:
    """Permuted tensors and the plan for one attention call."""

    q: torch.Tensor  # (B, Hq, Nq, D), permuted queries
    k: torch.Tensor  # (B, Hk, Nk, D), permuted keys
    v: torch.Tensor  # (B, Hk, Nk, Dv), permuted values
    plan: Plan
    scale: float


@dataclass(frozen=True)
class AttentionBackend:
    """A way to run block-sparse attention.

    Attributes:
        name: the ``PBSConfig.backend`` value that selects it.
        not_supported_reasons: why it cannot run a call (empty list: it can).
        run: returns ``(B, Hq, Nq, Dv)`` in permuted query order, in any float dtype.
        not_chosen_by_auto_reasons: further reasons for ``auto`` to pass it over although it can
            run a call when asked by name (e.g. the Triton interpreter on CPU: right but slow).
    """

    name: str
    not_supported_reasons: Callable[[AttentionCall], list[str]]
    run: Callable[[AttentionCall], torch.Tensor]
    not_chosen_by_auto_reasons: Callable[[AttentionCall], list[str]] | None = None


_BACKENDS: dict[str, AttentionBackend] = {}


def register_backend(backend: AttentionBackend) -> AttentionBackend:
    """Adds (or replaces) an attention backend."""
    _BACKENDS[backend.name] = backend
    return backend


def list_backends() -> list[str]:
    """Names of the registered attention backends (``auto`` tries `_AUTO_ORDER`'s, in order)."""
    return list(_BACKENDS)


def _reference_reasons(call: AttentionCall) -> list[str]:
    return []


def _run_reference(call: AttentionCall) -> torch.Tensor:
    return block_sparse_attention_reference(
        call.q,
        call.k,
        call.v,
        call.plan.mask,
        call.plan.query_positions(),
        call.plan.key_positions(),
        scale=call.scale,
        causal=call.plan.layout.causal,
    )


REFERENCE = AttentionBackend("reference", _reference_reasons, _run_reference)

# Order matters for ``auto``: the fastest backend that supports a call wins. Faster backends are
# registered in front of the reference by their own modules (see pbs.kernels).
_AUTO_ORDER: list[str] = []


def register_auto_candidate(name: str, position: int = 0) -> None:
    """Makes ``auto`` consider backend ``name`` (at ``position`` in its preference order)."""
    if name in _AUTO_ORDER:
        _AUTO_ORDER.remove(name)
    _AUTO_ORDER.insert(position, name)


register_backend(REFERENCE)
register_auto_candidate("reference", position=0)


def choose_backend(requested: str, call: AttentionCall) -> AttentionBackend:
    """Resolves ``requested`` (a backend name or ``auto``) to a backend that supports ``call``."""
    if requested != "auto":
        backend = _BACKENDS.get(requested)
        if backend is None:
            raise ValueError(f"unknown backend {requested!r}; available: auto, {', '.join(_BACKENDS)}")
        reasons = backend.not_supported_reasons(call)
        if reasons:
            raise ValueError(f"backend {requested!r} cannot run this call: " + "; ".join(reasons))
        return backend
    all_reasons = []
    for name in _AUTO_ORDER:
        backend = _BACKENDS[name]
        reasons = backend.not_supported_reasons(call)
        if not reasons and backend.not_chosen_by_auto_reasons is not None:
            reasons = backend.not_chosen_by_auto_reasons(call)
        if not reasons:
            return backend
        all_reasons.append(f"{name}: {'; '.join(reasons)}")
    raise ValueError("no backend can run this call: " + " | ".join(all_reasons))
