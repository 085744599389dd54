"""PBS-Attn as a Hugging Face transformers attention implementation: ``attn_implementation="pbs"``.

    import pbs.integrations.transformers as pbs_hf

    pbs_hf.register(skip_first_layers=2)   # the default PBSConfig, or e.g. PBSConfig.from_preset("pbs_paper")
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="pbs")
    model.set_attn_implementation("pbs")            # or switch a model that is already loaded

    # continuous batching (model.generate_batch, ContinuousBatchingManager): long prefills through
    # pbs.varlen_attention, decode steps dense
    pbs_hf.switch_attention(model, pbs_hf.CONTINUOUS_BATCHING_NAME)
    outputs = model.generate_batch(prompts, generation_config=generation_config)

`register` adds two things to transformers, under the name ``"pbs"``:

* an **attention function** (``AttentionInterface``) that runs `pbs.attention` on prefill
  and on chunks after a cached prefix, and falls back to transformers' SDPA function (with
  ``enable_gqa`` or repeated K/V, as for ``attn_implementation="sdpa"``) everywhere else;
* a **mask function** (``AttentionMaskInterface``). Without one, transformers builds no mask at all
  for an unknown implementation, so padding would be silently ignored. Ours returns ``None`` exactly
  when the call is plain causal attention over unpadded keys with the queries at the end (the case
  PBS runs), and otherwise the boolean mask SDPA would get, fully materialised.

and the same two under `CONTINUOUS_BATCHING_NAME` (``"pbs_flash_varlen"``), the name for continuous
batching: its attention function, `pbs_continuous_batching_forward`, runs a continuous-batching
step's packed requests through `pbs.varlen_attention` where the same rules give them PBS, and
every other call as ``"pbs"`` does (`pbs.integrations.continuous_batching` says why the name
contains "flash"). transformers' own ``set_attn_implementation`` and ``from_pretrained`` refuse that
name (they try to import a FlashAttention kernel for any name containing "flash"), so switch to it
with `switch_attention`.

Why a call fell back is logged once per reason and per model (logger
``pbs.integrations.transformers``; WARNING, except for decode and layers configured dense, which
are INFO), and `trace_dispatch` records every decision. transformers is imported only when `register`
(or a fallback) needs it, so this module imports without it.
"""

from __future__ import annotations

import functools
import json
import logging
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch

from pbs.config import PRESETS, PBSConfig
from pbs.integrations.continuous_batching import CONTINUOUS_BATCHING_NAME, PackedBatch, attend_packed, unpack_call
from pbs.integrations.dispatch import FALLBACK_REASONS, PBSIntegrationConfig, choose_attention
from pbs.integrations.tensor_parallel import (
    UNCHECKED_FALLBACKS,
    HeadShard,
    attention_on_shard,
    check_ranks_agree,
    head_shard_of,
    local_heads,
)

__all__ = [
    "ATTENTION_NAME",
    "CONTINUOUS_BATCHING_NAME",
    "Dispatch",
    "PBSIntegrationConfig",
    "continuous_batching_implementation",
    "pbs_attention_forward",
    "pbs_continuous_batching_forward",
    "pbs_mask",
    "register",
    "registered_config",
    "switch_attention",
    "trace_dispatch",
]

ATTENTION_NAME = "pbs"
MIN_TRANSFORMERS = "4.53"

logger = logging.getLogger(__name__)

_registered: PBSIntegrationConfig | None = None
# Fallback reasons already logged, per model: id(model config) -> (a weak reference to that config,
# so a recycled id is not mistaken for it; the reasons logged). Layers without a config share key 0.
_logged_reasons: dict[int, tuple[Any, set[str]]] = {}
# Reasons that are the design or the user's own choice: logged at INFO, the others at WARNING.
INFO_REASONS: frozenset[str] = frozenset({"decode", "skipped_layer"})
_active_traces: list[list["Dispatch"]] = []


@dataclass(frozen=True)
class Dispatch:
    """One attention call as `trace_dispatch` records it.

    Attributes:
        layer_idx: ``module.layer_idx`` of the calling layer (``None`` if it has none).
        q_len: queries ``Nq`` of the call.
        kv_len: keys ``Nk`` of the call (``Nq < Nk`` after a cached prefix).
        path: ``"pbs"`` or ``"sdpa"`` (the dense fallback; eager when softcapping).
        reason: for ``"sdpa"``, a key of `FALLBACK_REASONS`.
        density: for ``"pbs"``, the share of causally allowed blocks that were computed.
        detail: for ``"sdpa"``, the numbers behind the reason where there are some, e.g.
            ``"90 < min_seq_len=32768"`` or the ``dense_fallback`` rule that fired.
        tp_rank: under tensor parallelism, this rank's index among the ranks that split the
            layer's heads (``None`` when the call holds every head). ``density`` is then that of
            this rank's heads; each rank records its own calls.
        tp_size: how many ranks split the heads (``None`` without tensor parallelism).
        request: for a continuous-batching step (`pbs_continuous_batching_forward`), the request's
            index among the step's packed requests; the call then has one record per request, with
            that request's ``q_len`` and ``kv_len``. ``None`` for other calls.
    """

    layer_idx: int | None
    q_len: int
    kv_len: int
    path: Literal["pbs", "sdpa"]
    reason: str | None = None
    density: float | None = None
    detail: str | None = None
    tp_rank: int | None = None
    tp_size: int | None = None
    request: int | None = None


@contextmanager
def trace_dispatch() -> Iterator[list[Dispatch]]:
    """Records every call of the ``pbs`` attention functions made inside the ``with`` block.

    Yields:
        A list that fills with one `Dispatch` per layer call (one per request and layer for a
        continuous-batching step), in call order, also from continuous batching's generation thread.
        PBS calls also measure their density, which costs a host sync per layer (and on the
        continuous-batching route a second solo call per PBS request): trace to inspect, not to time.
    """
    records: list[Dispatch] = []
    _active_traces.append(records)
    try:
        yield records
    finally:
        _active_traces.remove(records)


def _coerce_config(config: Any, fields: dict[str, Any]) -> PBSIntegrationConfig:
    if isinstance(config, str) and config in PRESETS:
        config = PBSConfig.from_preset(config)
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"config is a string but neither a preset name {sorted(PRESETS)} nor valid JSON: {exc}"
            ) from exc
    if config is None:
        base = PBSIntegrationConfig()
    elif isinstance(config, PBSIntegrationConfig):
        base = config
    elif isinstance(config, PBSConfig):
        base = PBSIntegrationConfig(pbs=config)
    elif isinstance(config, dict):
        integration_keys = set(PBSIntegrationConfig.model_fields)
        if set(config) <= integration_keys:
            base = PBSIntegrationConfig.model_validate(config)
        elif set(config) & integration_keys:
            raise ValueError(
                f"config mixes PBSIntegrationConfig fields {sorted(set(config) & integration_keys)} with "
                f"PBSConfig fields {sorted(set(config) - integration_keys)}; nest the PBSConfig under 'pbs' "
                "or pass the integration fields as keyword arguments of register()"
            )
        else:
            base = PBSIntegrationConfig(pbs=PBSConfig.coerce(config))
    else:
        raise TypeError(
            "config must be a PBSIntegrationConfig, a PBSConfig, a dict or JSON string of either, a preset name, "
            "or None; "
            f"got {type(config).__name__}"
        )
    if fields:
        unknown = sorted(set(fields) - set(PBSIntegrationConfig.model_fields))
        if unknown:
            raise TypeError(
                f"register() got unknown keyword arguments {unknown}; "
                f"accepted: {sorted(PBSIntegrationConfig.model_fields)}"
            )
        base = PBSIntegrationConfig.model_validate({**dict(base), **fields})
    return base


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            f"pbs.integrations.transformers needs transformers>={MIN_TRANSFORMERS}: "
            "python3 -m pip install 'pbs-attn[hf]'"
        ) from exc
    from packaging.version import Version

    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        raise ImportError(
            f"pbs.integrations.transformers needs transformers>={MIN_TRANSFORMERS}, found {transformers.__version__}"
        )
    return transformers


def register(config: Any = None, /, **fields: Any) -> PBSIntegrationConfig:
    """Registers ``attn_implementation="pbs"`` (attention and mask function) with transformers.

    Registering again replaces the config (the latest wins) and re-arms the once-per-reason
    fallback log; models already loaded with ``"pbs"`` use the new config from their next call.

    Args:
        config: a `PBSIntegrationConfig`, a `PBSConfig` (used for every layer), a
            dict or JSON string of either, or ``None`` for the defaults.
        **fields: `PBSIntegrationConfig` fields that override ``config``'s, e.g.
            ``skip_first_layers=2, min_seq_len=4096`` (``min_seq_len`` sets
            ``dense_fallback.min_seq_len`` of every layer's `PBSConfig`).

    Both names are registered: ``"pbs"`` and `CONTINUOUS_BATCHING_NAME` (for
    ``model.generate_batch`` and the ``ContinuousBatchingManager``; switch to it with
    `switch_attention`), which share the config.

    Returns:
        The integration config now in effect.

    Raises:
        ImportError: transformers is missing or older than 4.53.
        TypeError / pydantic.ValidationError: an invalid config or keyword.
    """
    global _registered
    integration = _coerce_config(config, fields)
    transformers = _import_transformers()
    from transformers.masking_utils import AttentionMaskInterface

    transformers.AttentionInterface.register(ATTENTION_NAME, pbs_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, pbs_mask)
    # The continuous-batching name: its mask function serves it outside continuous batching (a padded
    # generate()); inside, transformers builds no mask for a paged cache or a "paged|" name.
    transformers.AttentionInterface.register(CONTINUOUS_BATCHING_NAME, pbs_continuous_batching_forward)
    AttentionMaskInterface.register(CONTINUOUS_BATCHING_NAME, pbs_mask)
    if _batches_through_paged_names(transformers):
        transformers.AttentionInterface.register(f"paged|{CONTINUOUS_BATCHING_NAME}", pbs_continuous_batching_forward)
    _registered = integration
    _logged_reasons.clear()
    return integration


def switch_attention(model: torch.nn.Module, name: str = ATTENTION_NAME) -> None:
    """Switches a loaded model to attention implementation ``name`` (``"pbs"``, ``"sdpa"``, ...).

    ``model.set_attn_implementation(name)`` where transformers has it (4.55 and later); before
    that, the layers read the shared config at call time, so setting it there is enough.

    `CONTINUOUS_BATCHING_NAME` is written into the model's configs directly, spelled as
    `continuous_batching_implementation` says: transformers' ``set_attn_implementation`` tries
    to load a FlashAttention kernel for every name containing "flash" and fails on this one.

    Raises:
        ValueError: ``name`` is `CONTINUOUS_BATCHING_NAME` and `register` has not run.
    """
    if name in (CONTINUOUS_BATCHING_NAME, f"paged|{CONTINUOUS_BATCHING_NAME}"):
        implementation = continuous_batching_implementation()
        configs = {id(model.config): model.config}
        for module in model.modules():  # sub-models may hold configs of their own
            config = getattr(module, "config", None)
            if config is not None and hasattr(config, "_attn_implementation"):
                configs.setdefault(id(config), config)
        for config in configs.values():
            config._attn_implementation = implementation
        return
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name


def registered_config() -> PBSIntegrationConfig | None:
    """The config of the last `register` call, or ``None`` before the first."""
    return _registered


def continuous_batching_implementation() -> str:
    """How a model's config must name the continuous-batching route for the installed transformers.

    ``"pbs_flash_varlen"`` where continuous batching takes bare names (5.24), and
    ``"paged|pbs_flash_varlen"`` where it runs ``"paged|<name>"`` implementations (5.17, which
    registers ``"paged|sdpa"``): there continuous batching would switch a bare name to its paged
    form through ``set_attn_implementation``, which refuses it.

    Raises:
        ValueError: `register` has not run.
    """
    transformers = _import_transformers()
    implementation = (
        f"paged|{CONTINUOUS_BATCHING_NAME}" if _batches_through_paged_names(transformers) else CONTINUOUS_BATCHING_NAME
    )
    if transformers.AttentionInterface().get(implementation) is not pbs_continuous_batching_forward:
        raise ValueError(
            f"attention implementation {implementation!r} is not registered: call "
            "pbs.integrations.transformers.register() first"
        )
    return implementation


def _batches_through_paged_names(transformers: Any) -> bool:
    """Whether continuous batching runs ``"paged|<name>"`` implementations (transformers 5.17
    registers ``"paged|sdpa"``; 5.24 serves ``"sdpa"`` itself and keeps only ``"paged|eager"``)."""
    return "paged|sdpa" in transformers.AttentionInterface()


# --------------------------------------------------------------------------------------------
# The attention function


def pbs_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: PBS where it applies, SDPA otherwise.

    Args:
        module: the attention layer (its ``layer_idx`` selects per-layer config).
        query: ``(B, Hq, Nq, D)``, the last ``Nq`` positions.
        key, value: ``(B, Hkv, Nk, D)``, not repeated for GQA.
        attention_mask: from `pbs_mask`: ``None`` for unpadded causal attention, else a
            ``(B, 1, Nq, Nk)`` mask (bool, or float additive).
        scaling: softmax scale (``None``: ``D ** -0.5``).
        dropout: attention dropout probability.
        **kwargs: what the model passes besides (``sliding_window``, ``softcap``, ``is_causal``,
            position ids, the cache, ...).

    Under tensor parallelism (``tp_plan="auto"``) ``query``, ``key`` and ``value`` hold this rank's
    heads only, and PBS runs on them as one process would on all heads
    (`pbs.integrations.tensor_parallel`); DTensors sharded on the head axis run on their local
    shard (other DTensor layouts are gathered first).

    Returns:
        ``(attn_output (B, Nq, Hq, Dv), None)``; no attention weights are materialised.
    """
    config = _registered if _registered is not None else PBSIntegrationConfig()
    layer_idx = getattr(module, "layer_idx", None)
    q_len, kv_len = query.shape[2], key.shape[2]
    query, key, value, shard, wrap = local_heads(query, key, value)  # DTensors: this rank's heads
    if shard is None:
        shard = head_shard_of(module, query.shape[1])
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    pbs_config, reason = choose_attention(
        config,
        layer_idx=layer_idx,
        q_len=q_len,
        kv_len=kv_len,
        has_mask=attention_mask is not None,
        is_causal=bool(is_causal),
        dropout=float(dropout or 0.0),
        softcap=kwargs.get("softcap"),
        sliding_window=kwargs.get("sliding_window"),
        paged_cache=kwargs.get("cache") is not None,
        compiling=torch.compiler.is_compiling(),
        needs_grad=torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)),
    )
    tp = (shard.rank, shard.size) if shard is not None else (None, None)
    if pbs_config is None:
        assert reason is not None
        if shard is not None and reason not in UNCHECKED_FALLBACKS:  # ranks agree, as attention_on_shard's do
            check_ranks_agree(shard, config.config_for_layer(layer_idx), query, key, value, scale=scaling, dispatch=reason)
        # The detail text is built only where it is read (the first log of a reason, a trace): this
        # branch runs in every layer of every short prompt.
        _log_fallback_once(module, reason, lambda: _fallback_detail(reason, layer_idx, q_len, kv_len, config),
                           layer_idx, q_len, kv_len, shard)
        if _active_traces:
            detail = _fallback_detail(reason, layer_idx, q_len, kv_len, config)
            _record(Dispatch(layer_idx, q_len, kv_len, "sdpa", reason=reason, detail=detail, tp_rank=tp[0], tp_size=tp[1]))
        out, weights = _dense_attention(module, query, key, value, attention_mask, scaling, dropout, kwargs)
        return wrap(out), weights
    # pbs.attention, or its tensor-parallel twin, may itself run dense SDPA (PBSConfig.dense_fallback):
    # then `detail` says why (too short to plan, the density probe, or the planned density).
    out, plan, detail = attention_on_shard(query, key, value, pbs_config, scale=scaling, shard=shard)
    if detail is not None:
        _log_fallback_once(module, "dense_fallback", detail, layer_idx, q_len, kv_len, shard)
        _record(
            Dispatch(layer_idx, q_len, kv_len, "sdpa", reason="dense_fallback", detail=detail, tp_rank=tp[0], tp_size=tp[1])
        )
    elif _active_traces:
        _record(Dispatch(layer_idx, q_len, kv_len, "pbs", density=plan.density, tp_rank=tp[0], tp_size=tp[1]))
    return wrap(out.transpose(1, 2).contiguous()), None


def pbs_continuous_batching_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function of `CONTINUOUS_BATCHING_NAME`: a continuous-batching step's
    long prefills through `pbs.varlen_attention`, the rest dense.

    A call that carries ``cu_seq_lens_q``/``cu_seq_lens_k`` is a continuous-batching step
    (`pbs.integrations.continuous_batching` describes its layout). Each of its requests is decided
    on its own by the rules of ``"pbs"`` (`pbs.integrations.dispatch.choose_attention` with the
    request's ``q_len`` and ``kv_len``, and the layer's config: ``skip_first_layers``,
    ``layer_overrides``, ``min_seq_len``, ``min_query_len``): the requests that get PBS run through
    `pbs.varlen_attention` (where ``PBSConfig.dense_fallback`` may still run one dense), decode tokens
    and the other requests run dense SDPA. Every other call (a plain forward, ``generate()``) runs as
    `pbs_attention_forward` runs it.

    Args:
        module: the attention layer (its ``layer_idx`` selects per-layer config).
        query: ``(1, Hq, Tq, D)``: the step's new tokens, packed (or ``(B, Hq, Nq, D)`` outside
            continuous batching).
        key, value: ``(1, Hkv, Tk, D)``: each request's cached prefix and new tokens, packed
            (transformers 5.17: the new tokens only, with the paged cache in ``kwargs``).
        attention_mask: ``None`` in continuous batching (transformers builds none for "flash" names).
        scaling: softmax scale (``None``: ``D ** -0.5``).
        dropout: attention dropout probability (continuous batching runs in eval mode: 0).
        **kwargs: ``cu_seq_lens_q``, ``cu_seq_lens_k``, ``is_causal``, ``sliding_window``,
            ``softcap``, the cache indices, ...

    Returns:
        ``(attn_output (1, Tq, Hq, Dv), None)``, as transformers' flash attention returns it.

    Raises:
        NotImplementedError: a continuous-batching step with an attention mask, a block table
            (the flash_attn_with_kvcache decode path) or attention sinks.
        RuntimeError: a continuous-batching step inside a CUDA graph capture (pass
            ``ContinuousBatchingConfig(use_cuda_graph=False)`` on CUDA).
    """
    batch = unpack_call(module, key, value, kwargs)  # under 5.17 this also updates the paged cache
    if batch is None:
        return pbs_attention_forward(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    if attention_mask is not None:
        raise NotImplementedError(
            f"{CONTINUOUS_BATCHING_NAME}: a continuous-batching step came with an attention mask; the packed "
            "route serves causal requests without one (transformers passes none for 'flash' names)"
        )
    return _attend_continuous_batch(module, query, batch, scaling, dropout, kwargs)


def _attend_continuous_batch(
    module: torch.nn.Module,
    query: torch.Tensor,
    batch: PackedBatch,
    scaling: float | None,
    dropout: float,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    """Decides every request of a continuous-batching step, runs the step (`attend_packed`), and
    logs and traces the decisions; returns ``(out (1, Tq, Hq, Dv), None)``."""
    config = _registered if _registered is not None else PBSIntegrationConfig()
    layer_idx = getattr(module, "layer_idx", None)
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    sliding_window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, batch.key, batch.value))
    # A compiled step (ContinuousBatchingConfig(varlen_compile_config=...)) runs dense, as "pbs" does.
    compiling = torch.compiler.is_compiling()
    lengths = batch.lengths()
    configs: list[PBSConfig | None] = []
    reasons: list[str | None] = []
    for q_len, kv_len in lengths:
        if q_len <= 1:  # a decode token (choose_attention's first rule, without the call), or nothing
            layer_config, reason = None, "decode" if q_len == 1 else None
        else:
            layer_config, reason = choose_attention(
                config, layer_idx=layer_idx, q_len=q_len, kv_len=kv_len, has_mask=False, is_causal=bool(is_causal),
                dropout=float(dropout or 0.0), softcap=softcap, sliding_window=sliding_window,
                compiling=compiling, needs_grad=needs_grad,
            )
        configs.append(layer_config)
        reasons.append(reason)
    out, measured = attend_packed(
        query, batch, configs, scale=scaling, causal=bool(is_causal), sliding_window=sliding_window, softcap=softcap,
        measure=bool(_active_traces),
    )
    for reason in dict.fromkeys(r for r in reasons if r is not None):  # each reason once, at its first request
        q_len, kv_len = lengths[reasons.index(reason)]
        detail = functools.partial(_fallback_detail, reason, layer_idx, q_len, kv_len, config)
        _log_fallback_once(module, reason, detail, layer_idx, q_len, kv_len)
    for i, measure in measured.items():
        if measure.dense_reason is not None:
            _log_fallback_once(module, "dense_fallback", measure.dense_reason, layer_idx, *lengths[i])
    if _active_traces:
        for i, ((q_len, kv_len), reason) in enumerate(zip(lengths, reasons)):
            if q_len == 0:
                continue
            measure = measured.get(i)  # missing only for a trace opened during this call
            if reason is not None:
                detail = _fallback_detail(reason, layer_idx, q_len, kv_len, config)
                _record(Dispatch(layer_idx, q_len, kv_len, "sdpa", reason=reason, detail=detail, request=i))
            elif measure is not None and measure.dense_reason is not None:
                _record(Dispatch(layer_idx, q_len, kv_len, "sdpa", reason="dense_fallback",
                                 detail=measure.dense_reason, request=i))
            else:
                density = None if measure is None else measure.density
                _record(Dispatch(layer_idx, q_len, kv_len, "pbs", density=density, request=i))
    return out, None


def _record(dispatch: Dispatch) -> None:
    for records in _active_traces:
        records.append(dispatch)


def _fallback_detail(
    reason: str, layer_idx: int | None, q_len: int, kv_len: int, config: PBSIntegrationConfig
) -> str | None:
    return {
        "short_sequence": f"{kv_len} < min_seq_len={_min_seq_len(config, layer_idx)}",
        "short_chunk": f"{q_len} < min_query_len={config.min_query_len}",
        "skipped_layer": f"layer {layer_idx}",
    }.get(reason)


def _min_seq_len(config: PBSIntegrationConfig, layer_idx: int | None) -> int | None:
    layer_config = config.config_for_layer(layer_idx)
    return None if layer_config is None else layer_config.dense_fallback.min_seq_len


def _log_fallback_once(
    module: torch.nn.Module,
    reason: str,
    detail: str | Callable[[], str | None] | None,
    layer_idx: int | None,
    q_len: int,
    kv_len: int,
    shard: HeadShard | None = None,
) -> None:
    """Logs why a call ran dense, the first time ``reason`` happens in ``module``'s model.

    Under tensor parallelism every rank is its own process and logs once, naming its rank.
    """
    if torch.compiler.is_compiling():
        return
    model_config = getattr(module, "config", None)
    key = 0 if model_config is None else id(model_config)
    entry = _logged_reasons.get(key)
    if entry is None or (model_config is not None and entry[0]() is not model_config):
        try:
            ref = weakref.ref(model_config) if model_config is not None else (lambda: None)
        except TypeError:  # not weak-referenceable: identify it by id alone
            ref = (lambda config=model_config: config) if model_config is not None else (lambda: None)
        entry = _logged_reasons[key] = (ref, set())
    if reason in entry[1]:
        return
    entry[1].add(reason)
    if callable(detail):
        detail = detail()
    name = getattr(model_config, "name_or_path", None) or getattr(model_config, "model_type", None)
    for_model = f" in {name}" if name else ""
    on_rank = f" (tensor-parallel rank {shard.rank} of {shard.size})" if shard is not None else ""
    logger.log(
        logging.INFO if reason in INFO_REASONS else logging.WARNING,
        "pbs%s: dense attention instead of PBS%s: %s%s (reason %r, first at layer %s, q_len %d, kv_len %d; "
        "logged once per reason and model)",
        on_rank,
        for_model,
        FALLBACK_REASONS[reason],
        f" ({detail})" if detail else "",
        reason,
        layer_idx,
        q_len,
        kv_len,
    )


def _bottom_right_causal_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """``(1, 1, Nq, Nk)`` bool: query ``i`` sits at position ``Nk - Nq + i`` and sees keys up to it."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)
    return (torch.arange(kv_len, device=device)[None, :] <= q_pos[:, None])[None, None]


def _dense_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    dropout: float,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    """The fallback: transformers' own SDPA function, so results match ``attn_implementation="sdpa"``."""
    q_len, kv_len = query.shape[2], key.shape[2]
    is_causal = kwargs.get("is_causal", getattr(module, "is_causal", True))
    # pbs_mask returns None also for a causal chunk after a cached prefix, where SDPA's mask would be
    # materialised: SDPA's is_causal is top-left aligned, so such a call needs its mask spelled out.
    if attention_mask is None and is_causal and 1 < q_len < kv_len:
        attention_mask = _bottom_right_causal_mask(q_len, kv_len, query.device)
    if kwargs.get("softcap") is not None:
        if attention_mask is None and is_causal and q_len > 1:  # eager has no is_causal flag
            attention_mask = _bottom_right_causal_mask(q_len, kv_len, query.device)
        return _softcapped_attention(module, query, key, value, attention_mask, scaling, dropout, kwargs["softcap"])
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _softcapped_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    dropout: float,
    softcap: float,
) -> tuple[torch.Tensor, None]:
    """Eager attention with ``softcap * tanh(scores / softcap)``, which SDPA cannot express."""
    group = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(group, dim=1)
    value = value.repeat_interleave(group, dim=1)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(2, 3)).float() * scale
    scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        else:
            scores = scores + attention_mask.float()
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), None


# --------------------------------------------------------------------------------------------
# The mask function


def pbs_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """transformers mask function for ``"pbs"``: ``None`` for the calls PBS runs, else SDPA's mask.

    Called by ``transformers.masking_utils.create_causal_mask`` (and its sliding-window and
    bidirectional siblings) with keyword arguments: ``batch_size``, ``q_length`` / ``q_offset``
    (``cache_position`` before transformers 5), ``kv_length``, ``kv_offset``, ``mask_function``,
    ``attention_mask`` (the 2D padding mask), ``local_size``, ``allow_is_causal_skip``, ...

    Returns:
        ``None`` when the pattern is plain causal, no key is padding and the queries are the last
        ``q_length`` of the keys (prefill, or a chunk after a cached prefix); otherwise the mask of
        transformers' ``sdpa_mask`` (``(B, 1, Nq, Nk)`` bool, or ``None`` only where SDPA's own
        reading of ``None`` is also bottom-right causal: one query, or ``Nq == Nk``).
    """
    from transformers import masking_utils

    sizes = None if args else _mask_sizes(kwargs)
    aligned = sizes is not None and sizes[0] + sizes[1] == sizes[2] + sizes[3]  # queries end where keys end
    allow_skip = bool(kwargs.get("allow_is_causal_skip", True))
    plain_causal = kwargs.get("mask_function", masking_utils.causal_mask_function) is masking_utils.causal_mask_function
    if (
        aligned
        and allow_skip
        and plain_causal
        and kwargs.get("local_size") is None
        and _no_padding(kwargs.get("attention_mask"), kv_length=sizes[2], kv_offset=sizes[3])
    ):
        return None
    # SDPA may also return None for a static cache's first prefill (queries at the *start* of the
    # keys); we keep None meaning "queries at the end", so only aligned calls may skip.
    kwargs["allow_is_causal_skip"] = allow_skip and aligned
    kwargs["allow_is_bidirectional_skip"] = False
    return masking_utils.sdpa_mask(*args, **kwargs)


def _as_int(value: Any) -> int | None:
    if isinstance(value, torch.Tensor):
        if torch.compiler.is_compiling() or torch.jit.is_tracing() or value.numel() != 1:
            return None
        return int(value.item())
    return None if value is None else int(value)


def _mask_sizes(kwargs: dict[str, Any]) -> tuple[int, int, int, int] | None:
    """``(q_length, q_offset, kv_length, kv_offset)``, or ``None`` if they cannot be read cheaply."""
    if "q_length" in kwargs:
        q_length, q_offset = _as_int(kwargs["q_length"]), _as_int(kwargs.get("q_offset", 0))
    elif kwargs.get("cache_position") is not None:  # transformers 4.x
        positions = kwargs["cache_position"]
        q_length, q_offset = positions.shape[0], _as_int(positions[0]) if positions.numel() else None
    else:
        return None
    kv_length, kv_offset = _as_int(kwargs.get("kv_length")), _as_int(kwargs.get("kv_offset", 0))
    sizes = (q_length, q_offset, kv_length, kv_offset)
    return None if any(s is None for s in sizes) else sizes  # type: ignore[return-value]


def _no_padding(padding_mask: torch.Tensor | None, *, kv_length: int, kv_offset: int) -> bool:
    """Whether the 2D padding mask keeps every one of the ``kv_length`` keys from ``kv_offset`` on."""
    if padding_mask is None:
        return True
    if padding_mask.dim() != 2 or padding_mask.shape[-1] < kv_offset + kv_length:
        return False  # transformers pads a short mask with False, i.e. padding
    return bool(padding_mask[:, kv_offset : kv_offset + kv_length].bool().all())
