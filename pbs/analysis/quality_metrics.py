"""What ``pbs quality`` measures: next-token losses, a sample's loss / copy loss / density row, and
one layer's attention error, coverage and density against dense attention.

* `token_losses`: per-token losses of one sequence; `sample_result`: the row of one method on one
  sample (document loss, copy and first-passage loss of a copy probe, density);
* `ForwardResult`: one forward pass's losses and per-layer density (a dense layer counting 1);
* `layer_metrics`: every method on one layer's ``q``/``k``/``v``, against dense attention.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pbs.analysis.quality_methods import Method
from pbs.analysis.quality_texts import Sample, span_loss
from pbs.config import PBSConfig
from pbs.dense import dense_attention_sdpa
from pbs.reference.block_mass import attention_coverage, block_attention_mass


_BAND_CHUNK = 1024


def _banded_sliding_window_sdpa(sdpa: Any) -> Any:
    """transformers' SDPA function, except that a sliding-window layer's prefill (one sequence, no
    cache, longer than its window) is computed in query chunks over the keys of their windows only.

    SDPA with the model's sliding-window mask computes every (query, key) pair and masks most of them
    away: at 32K tokens Gemma 3's fifteen 512-token local layers cost fifteen full causal attentions
    on a CPU. The chunks compute the same softmax over the same keys (``j > i - window``, transformers'
    `sliding_window_overlay`), so only the float32 summation order differs.
    """
    def forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                **kwargs: Any) -> Any:
        window = kwargs.get("sliding_window")
        n = query.shape[2]
        if (not window or query.shape[0] != 1 or key.shape[2] != n or n <= window + _BAND_CHUNK or dropout
                or kwargs.get("softcap") is not None or not kwargs.get("is_causal", getattr(module, "is_causal", True))):
            return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        out = torch.empty_like(query)
        positions = torch.arange(n, device=query.device)
        for start in range(0, n, _BAND_CHUNK):
            end = min(n, start + _BAND_CHUNK)
            first = max(0, start - window + 1)
            q_pos, k_pos = positions[start:end, None], positions[None, first:end]
            allowed = (k_pos <= q_pos) & (k_pos > q_pos - window)
            out[:, :, start:end] = F.scaled_dot_product_attention(
                query[:, :, start:end], key[:, :, first:end], value[:, :, first:end], attn_mask=allowed,
                scale=scaling, enable_gqa=query.shape[1] != key.shape[1],
            )
        return out.transpose(1, 2).contiguous(), None

    forward.banded_sliding_window = True  # type: ignore[attr-defined]
    return forward


@contextmanager
def banded_sliding_windows() -> Iterator[None]:
    """Within the block, transformers' ``"sdpa"`` attention function (which the model's own SDPA and
    the ``pbs`` integration's dense fallback both call) computes a sliding-window layer's prefill over
    the windows only (`_banded_sliding_window_sdpa`); other calls are unchanged."""
    from transformers import AttentionInterface

    mapping = AttentionInterface._global_mapping
    previous = mapping["sdpa"]
    if getattr(previous, "banded_sliding_window", False):
        yield
        return
    mapping["sdpa"] = _banded_sliding_window_sdpa(previous)
    try:
        yield
    finally:
        mapping["sdpa"] = previous


def token_losses(
    model: torch.nn.Module, input_ids: torch.Tensor, chunk: int = 1024, *, prefill_chunk: int | None = None
) -> torch.Tensor:
    """Next-token losses ``(N - 1,)`` float32 of one sequence; ``[j]`` is the loss of token ``j + 1``.

    The logits are computed ``chunk`` positions at a time from the decoder's last hidden state, so an
    8K-token sequence never holds the full ``(N, vocab)`` logits (nor a 32K one Gemma 3's 262K-token
    vocabulary: 34 GB in float32). Sliding-window layers attend over their windows only
    (`banded_sliding_windows`).

    Args:
        prefill_chunk: read the sequence in chunks of this many tokens against a growing KV cache
            (chunked prefill: every chunk after the first attends with ``Nq < Nk``), instead of in
            one pass; ``None``: one pass.
    """
    ids = input_ids.reshape(1, -1).to(next(model.parameters()).device)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    head = model.get_output_embeddings()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    with torch.no_grad(), banded_sliding_windows():
        if prefill_chunk is None:
            hidden = decoder(input_ids=ids, use_cache=False).last_hidden_state[0, :-1]
        else:
            hidden = _chunked_hidden(model, decoder, ids, prefill_chunk)[:-1]
        targets = ids[0, 1:]
        out = torch.empty(targets.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, targets.shape[0], chunk):
            logits = head(hidden[start : start + chunk]).float()
            if softcap:
                logits = torch.tanh(logits / softcap) * softcap
            out[start : start + chunk] = F.cross_entropy(logits, targets[start : start + chunk], reduction="none")
    return out.cpu()


def _chunked_hidden(model: torch.nn.Module, decoder: torch.nn.Module, ids: torch.Tensor, size: int) -> torch.Tensor:
    """The decoder's last hidden state ``(N, hidden)`` of ``ids`` ``(1, N)``, read ``size`` tokens at a
    time into a `transformers.DynamicCache` (the model's own per-layer cache: sliding-window layers
    keep their window)."""
    import inspect

    from transformers import DynamicCache

    if size < 1:
        raise ValueError(f"prefill_chunk must be at least 1, got {size}")
    # transformers 5.24 names the forward's cache argument `cache`; earlier versions `past_key_values`.
    name = "cache" if "cache" in inspect.signature(type(decoder).forward).parameters else "past_key_values"
    cache = DynamicCache(config=model.config)
    parts = []
    for start in range(0, ids.shape[1], size):
        out = decoder(input_ids=ids[:, start : start + size], use_cache=True, **{name: cache})
        parts.append(out.last_hidden_state[0])
    return torch.cat(parts)


@dataclass
class ForwardResult:
    """Per-token losses of one forward pass and the density of every attention layer."""

    losses: torch.Tensor
    layer_density: dict[int, float]
    seconds: float

    @property
    def density(self) -> float:
        return sum(self.layer_density.values()) / max(1, len(self.layer_density))


def sample_result(method: Method, sample: Sample, forward: ForwardResult, backend: str) -> dict[str, Any]:
    """The report row of ``method`` on ``sample``: loss over the whole sequence, density (mean and per
    layer), seconds; for a copy probe also ``filler``, ``copy_loss`` and ``first_loss``."""
    row: dict[str, Any] = {
        "method": method.label,
        "sample": sample.name,
        "set": sample.text_set,
        "kind": sample.kind,
        "tokens": sample.length,
        "backend": backend,
        "loss": span_loss(forward.losses, (1, sample.length)),
        "density": forward.density,
        "layer_density": [forward.layer_density[i] for i in sorted(forward.layer_density)],
        "seconds": round(forward.seconds, 3),
    }
    if method.chunk_size is not None:
        row["chunk_size"] = method.chunk_size
    if sample.kind == "copy":
        row["filler"] = sample.filler
        row["copy_loss"] = span_loss(forward.losses, sample.copy_span)
        row["first_loss"] = span_loss(forward.losses, sample.first_span)
    return row


@dataclass(frozen=True)
class LayerMetric:
    """One method in one layer: ``||out - dense|| / ||dense||``, the share of the exact attention
    mass inside the selected blocks, and the density (head means)."""

    rel_error: float
    coverage: float
    density: float


class _MassCache:
    """Exact block mass of one layer's q/k, once per distinct permutation."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, scale: float):
        self.q, self.k, self.scale = q, k, scale
        self._entries: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def mass(self, plan: Any) -> torch.Tensor:
        qi, ki = plan.query_permutation.indices, plan.key_permutation.indices
        for q_idx, k_idx, mass in self._entries:
            if q_idx.shape == qi.shape and k_idx.shape == ki.shape and torch.equal(q_idx, qi) and torch.equal(k_idx, ki):
                return mass
        q_perm = plan.query_permutation.apply(self.q)
        k_perm = plan.key_permutation.apply(self.k)
        mass = block_attention_mass(q_perm, k_perm, plan.query_positions(), plan.key_positions(), plan.layout, self.scale)
        self._entries.append((qi, ki, mass))
        return mass


def layer_metrics(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    configs: dict[str, PBSConfig | None],
    *,
    scale: float | None = None,
) -> dict[str, LayerMetric]:
    """Every config on one layer's inputs, against dense attention on the same inputs.

    Args:
        q: ``(B, Hq, N, D)``; k, v: ``(B, Hkv, N, D)`` (computed in float32).
        configs: label -> PBS config, or ``None`` for dense attention (error 0, coverage 1, density 1).
        scale: softmax scale, default ``D ** -0.5``.
    """
    import pbs

    q, k, v = q.float(), k.float(), v.float()
    s = q.shape[-1] ** -0.5 if scale is None else float(scale)
    dense = dense_attention_sdpa(q, k, v, scale=s, causal=True).float()
    dense_norm = dense.norm()
    masses = _MassCache(q, k, s)
    out: dict[str, LayerMetric] = {}
    for label, config in configs.items():
        if config is None:
            out[label] = LayerMetric(0.0, 1.0, 1.0)
            continue
        plan = pbs.plan(q, k, config, scale=s)
        result = pbs.run(plan, q, k, v, scale=s).float()
        coverage = attention_coverage(masses.mass(plan), plan.mask.to_dense(), plan.layout)
        out[label] = LayerMetric(
            rel_error=float((result - dense).norm() / dense_norm),
            coverage=float(coverage.double().mean()),
            density=float(plan.density),
        )
    return out
