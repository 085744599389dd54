"""The forward passes of ``pbs quality``: dense, through PBS, and dense with the per-layer probe.

* `dense_forward`: the reference, the model's own SDPA attention;
* `pbs_forward`: ``attn_implementation="pbs"`` under one integration config; a PBS layer that ran
  dense attention is a `DenseFallbackError`;
* `probing` / `dense_with_layer_probe`: a dense pass that hands each layer's ``q``/``k``/``v`` to
  every method (`pbs.analysis.quality_metrics.layer_metrics`);
* `attention_layers` / `full_attention_layers`: which layers count (sliding-window ones do not).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from pbs.analysis.progress import ProgressBar
from pbs.analysis.quality_methods import Method, config_with_backend
from pbs.analysis.quality_metrics import ForwardResult, layer_metrics, token_losses
from pbs.analysis.quality_results import QualityReport
from pbs.analysis.quality_texts import Sample
from pbs.integrations.dispatch import PBSIntegrationConfig

PROBE_IMPLEMENTATION = "pbs_quality_probe"


class DenseFallbackError(RuntimeError):
    """A PBS method ran dense attention in a layer it was configured to run PBS in."""


def attention_layers(model: torch.nn.Module) -> list[int]:
    """Layer ids of the model's attention modules."""
    from pbs.analysis.hf_capture import attention_modules

    return sorted(int(m.layer_idx) for m in attention_modules(model))


def full_attention_layers(model: torch.nn.Module) -> list[int]:
    """Layer ids of the attention modules that attend to the whole prefix: the layers PBS can run in.

    Sliding-window layers (Gemma 2/3, Mistral-style local layers; a module with a ``sliding_window``
    or a ``config.layer_types`` entry ``"sliding_attention"``) are local by design: the integration
    runs them dense once the sequence is longer than the window, so the harness neither counts them
    in the density nor treats their dense calls as a method falling back.
    """
    from pbs.analysis.hf_capture import attention_modules

    layer_types = getattr(getattr(model, "config", None), "layer_types", None) or []
    full = []
    for module in attention_modules(model):
        idx = int(module.layer_idx)
        declared = layer_types[idx] if idx < len(layer_types) else None
        if getattr(module, "sliding_window", None) is None and declared != "sliding_attention":
            full.append(idx)
    return sorted(full)


_probe_callbacks: list[Callable[..., None]] = []


def _probe_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> Any:
    """Dense SDPA that also hands each layer's ``q``/``k``/``v`` to the active probe."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    out = ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, *args, **kwargs)
    for callback in _probe_callbacks:
        callback(int(module.layer_idx), query, key, value, kwargs.get("scaling"), attention_mask)
    return out


@contextmanager
def _attention_implementation(model: torch.nn.Module, name: str) -> Iterator[None]:
    from pbs.integrations.transformers import switch_attention

    previous = model.config._attn_implementation
    switch_attention(model, name)
    try:
        yield
    finally:
        switch_attention(model, previous)


@contextmanager
def probing(model: torch.nn.Module, callback: Callable[..., None]) -> Iterator[None]:
    """Within the block the model runs dense SDPA and calls
    ``callback(layer_idx, q, k, v, scale, attention_mask)`` after every attention call."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PROBE_IMPLEMENTATION, _probe_attention)
    AttentionMaskInterface.register(PROBE_IMPLEMENTATION, sdpa_mask)
    _probe_callbacks.append(callback)
    try:
        with _attention_implementation(model, PROBE_IMPLEMENTATION):
            yield
    finally:
        _probe_callbacks.remove(callback)


def dense_forward(model: torch.nn.Module, sample: Sample, *, prefill_chunk: int | None = None) -> ForwardResult:
    """The reference: the model's own SDPA attention (``prefill_chunk``: in chunks of that many
    tokens against a growing KV cache, see `token_losses`)."""
    start = time.perf_counter()
    with _attention_implementation(model, "sdpa"):
        losses = token_losses(model, sample.input_ids, prefill_chunk=prefill_chunk)
    return ForwardResult(losses, {i: 1.0 for i in full_attention_layers(model)}, time.perf_counter() - start)


def _allowed_blocks(q_len: int, kv_len: int, block_size: int) -> int:
    """Causally allowed blocks of one call (its queries the last ``q_len`` of ``kv_len`` positions)."""
    from pbs.layout import Layout

    return Layout(1, 1, 1, q_len, kv_len, block_size, block_size, segmented=False).total_allowed_blocks


def pbs_forward(
    model: torch.nn.Module, sample: Sample, integration: PBSIntegrationConfig, label: str = "", *,
    prefill_chunk: int | None = None,
) -> ForwardResult:
    """One forward pass with ``attn_implementation="pbs"`` under ``integration``.

    With ``prefill_chunk`` the sequence is read in chunks of that many tokens against a growing KV
    cache (`token_losses`): a layer then makes one call per chunk, and its density is that of all
    its calls together (each call's density weighted by its causally allowed blocks).

    Raises:
        DenseFallbackError: a layer that ``integration`` runs with PBS ran dense attention, or the
            model made no attention call through the ``pbs`` implementation at all.
    """
    import pbs.integrations.transformers as pbs_hf

    previous = pbs_hf.registered_config()
    pbs_hf.register(integration)
    start = time.perf_counter()
    try:
        with _attention_implementation(model, pbs_hf.ATTENTION_NAME), pbs_hf.trace_dispatch() as records:
            losses = token_losses(model, sample.input_ids, prefill_chunk=prefill_chunk)
    finally:  # leave the integration as it was: a user's own registration, or none
        if previous is not None:
            pbs_hf.register(previous)
        else:
            pbs_hf._registered = None
    seconds = time.perf_counter() - start
    layers = attention_layers(model)
    seen = {r.layer_idx for r in records}
    if not records or not set(layers) <= seen:
        raise DenseFallbackError(
            f"{label or 'method'} on {sample.name!r}: layers {sorted(set(layers) - seen)} made no call through "
            "the 'pbs' attention implementation (does this model dispatch through AttentionInterface?)"
        )
    full = set(full_attention_layers(model))
    fell_back = [
        (r.layer_idx, r.reason) for r in records
        if r.path != "pbs" and r.layer_idx in full and integration.config_for_layer(r.layer_idx) is not None
    ]
    if fell_back:
        raise DenseFallbackError(
            f"{label or 'method'} on {sample.name!r} ({sample.length} tokens) ran dense attention in PBS layers "
            f"{fell_back[:6]}{' ...' if len(fell_back) > 6 else ''}: the numbers would be dense numbers. Lower "
            "min_seq_len / the dense-fallback limits of the config, or make those layers dense on purpose "
            "(skip_first_layers / layer_overrides)."
        )
    selected: dict[int, float] = {}
    allowed: dict[int, int] = {}
    for r in records:
        if r.layer_idx not in full:
            continue
        layer = int(r.layer_idx)
        config = integration.config_for_layer(layer)
        weight = _allowed_blocks(r.q_len, r.kv_len, config.block_size if config is not None else 128)
        selected[layer] = selected.get(layer, 0.0) + weight * (float(r.density) if r.path == "pbs" else 1.0)
        allowed[layer] = allowed.get(layer, 0) + weight
    density = {layer: selected[layer] / allowed[layer] for layer in selected}
    return ForwardResult(losses, density, seconds)


def dense_with_layer_probe(
    model: torch.nn.Module, sample: Sample, methods: Sequence[Method], report: QualityReport, probe: Sequence[int],
    progress: bool,
) -> ForwardResult:
    """`dense_forward` that also measures every method in the ``probe`` layers (`layer_metrics` on the
    dense run's ``q``/``k``/``v``), appending one row per (method, layer) to ``report.layers``."""
    if not probe:
        return dense_forward(model, sample)
    layers = full_attention_layers(model)
    wanted = set(probe)
    bar = ProgressBar(len(wanted), f"layer probe {sample.name}", enabled=progress)

    def callback(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
                 attention_mask: torch.Tensor | None) -> None:
        if layer_idx not in wanted:
            return
        if attention_mask is not None:
            raise RuntimeError(f"layer probe: layer {layer_idx} got an attention mask (padding?); probes need plain causal inputs")
        configs = {  # chunked methods are not probed: the probe's q/k/v are the one-shot pass's
            m.label: None if m.is_dense else config_with_backend(m.config.config_for_layer(layer_idx), "reference")
            for m in methods if m.chunk_size is None
        }
        start = time.perf_counter()
        metrics = layer_metrics(q.detach(), k.detach(), v.detach(), configs, scale=scale)
        for label, metric in metrics.items():
            report.layers.append({
                "method": label, "sample": sample.name, "set": sample.text_set, "layer": layer_idx,
                "rel_error": metric.rel_error, "coverage": metric.coverage, "density": metric.density,
            })
        bar.advance(f"layer {layer_idx} ({time.perf_counter() - start:.1f}s)")

    start = time.perf_counter()
    try:
        with probing(model, callback):
            losses = token_losses(model, sample.input_ids)
    finally:
        bar.close()
    return ForwardResult(losses, {i: 1.0 for i in layers}, time.perf_counter() - start)
