"""Context-parallel prefill of a transformers causal LM: one prompt split over the ranks of a group.

Every rank holds the whole model (replicated weights) and its zigzag shard of the prompt
(`pbs.distributed.shard_sequence`: chunks ``r`` and ``2P - 1 - r`` of ``2P``, cut on segment
boundaries), fed with the tokens' original ``position_ids`` so that RoPE is right. Each attention
layer runs `pbs.distributed.context_parallel_attention` on its q/k/v shard; everything else in a
Llama-like decoder (embeddings, norms, MLP, LM head) works token by token, so the rank's logits
are its shard of the one-process logits.

    import pbs.integrations.context_parallel as pbs_cp

    pbs_cp.register_context_parallel(group=None)      # the default PBSConfig, the default group
    out = pbs_cp.context_parallel_prefill(model, input_ids)   # on every rank, the same (B, N) prompt
    out.last_logits                                   # (B, V): the last position, on every rank

`register_context_parallel` adds the attention implementation `CONTEXT_PARALLEL_NAME`
(``"pbs_context_parallel"``) to transformers' ``AttentionInterface``. It registers no mask
function: transformers then builds no mask for the name (the causal mask of a local shard is wrong
for a zigzag shard, and context parallelism applies the causal rule over original positions
itself). `context_parallel_prefill` shards the prompt, switches the model to the name for one
forward (``use_cache=False``) and back, and returns this rank's logits.

What it refuses (`pbs_context_parallel_forward` raises): a cached prefix (queries fewer than keys),
an attention mask, sliding windows, softcapping, non-causal layers and dropout. A model must do
its token mixing in attention layers that go through ``AttentionInterface`` (Llama, Qwen2,
Mistral without a sliding window); `context_parallel_prefill` raises if no layer called it.

Dense layers (``skip_first_layers``, a ``layer_overrides`` entry of ``None``, or a prompt shorter
than the layer's ``dense_fallback.min_seq_len``, which holds here on every device, as in
``attn_implementation="pbs"``) run the context-parallel dense path: the same K/V all-gather, each
chunk attending densely to its prefix.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Literal

import torch

from pbs.dense import DensePolicy
from pbs.distributed import context_parallel_attend, shard_sequence
from pbs.distributed.agreement import agree
from pbs.integrations.dispatch import PBSIntegrationConfig
from pbs.integrations.transformers import _coerce_config, _import_transformers, switch_attention

__all__ = [
    "CONTEXT_PARALLEL_NAME",
    "ContextParallelPrefill",
    "LayerCall",
    "context_parallel_prefill",
    "pbs_context_parallel_forward",
    "register_context_parallel",
    "registered_context_parallel",
]

CONTEXT_PARALLEL_NAME = "pbs_context_parallel"


@dataclasses.dataclass(frozen=True)
class _Setup:
    config: PBSIntegrationConfig
    group: Any
    segment_size: int  # of every layer's config: the prompt is sharded on its boundaries


_setup: _Setup | None = None
_active_calls: list[list["LayerCall"]] = []


@dataclasses.dataclass(frozen=True)
class LayerCall:
    """One attention call on this rank.

    Attributes:
        layer_idx: ``module.layer_idx`` of the calling layer (``None`` if it has none).
        local_len: ``N_local``, this rank's tokens.
        seq_len: ``N``, tokens of the whole sequence.
        path: ``"pbs"`` (planned, sparse or not) or ``"dense"``.
        reason: for ``"dense"``, why: ``"skipped_layer"`` (configured dense), ``"short_sequence"``
            (``N`` below the layer's ``dense_fallback.min_seq_len``) or the reason
            `pbs.distributed.context_parallel_attend` gave (the density probe, the planned density).
        density: for ``"pbs"``, the share of this rank's causally allowed blocks that were selected.
    """

    layer_idx: int | None
    local_len: int
    seq_len: int
    path: Literal["pbs", "dense"]
    reason: str | None = None
    density: float | None = None


@dataclasses.dataclass(frozen=True)
class ContextParallelPrefill:
    """What `context_parallel_prefill` returns on a rank.

    Attributes:
        last_logits: ``(B, V)``, the logits of the sequence's last position (computed by group rank
            0, which holds the last chunk, and broadcast): the same on every rank.
        logits: with ``keep="all"``, ``(B, N_local, V)``: this rank's logits, in the order of its
            shard (`pbs.distributed.unshard_sequence` with ``dim=1`` joins the ranks'); else None.
        positions: ``(N_local,)`` int64, the original positions of this rank's tokens.
        seq_len: ``N``.
        layers: this rank's attention calls, in call order (one per layer).
    """

    last_logits: torch.Tensor
    logits: torch.Tensor | None
    positions: torch.Tensor
    seq_len: int
    layers: tuple[LayerCall, ...]


def register_context_parallel(config: Any = None, /, *, group: Any = None, **fields: Any) -> PBSIntegrationConfig:
    """Registers ``attn_implementation="pbs_context_parallel"`` with transformers.

    Registering again replaces the config and group (the latest wins).

    Args:
        config: as for `pbs.integrations.transformers.register`: a `PBSIntegrationConfig`, a
            `PBSConfig` (every layer), a dict or JSON string of either, a preset name, or ``None``
            for the defaults. Every layer's config must be one `pbs.distributed` can plan
            (`pbs.distributed.check_supported`) and all must share one ``segment_size``: the
            prompt is sharded once, on its boundaries.
        group: the process group the sequence is split over (``None``: the default group).
        **fields: `PBSIntegrationConfig` fields, e.g. ``min_seq_len=4096``, ``skip_first_layers=2``.

    Returns:
        The integration config now in effect.

    Raises:
        ImportError: transformers is missing or too old.
        ValueError: a config context parallelism cannot plan, or layers with different
            ``segment_size``.
    """
    global _setup
    from pbs.distributed import check_supported

    integration = _coerce_config(config, fields)
    configs = [integration.pbs, *(c for c in integration.layer_overrides.values() if c is not None)]
    for layer_config in configs:
        check_supported(layer_config)
    segments = sorted({c.segment_size for c in configs})
    if len(segments) > 1:
        raise ValueError(
            f"every layer's config must have the same segment_size under context parallelism (the prompt is "
            f"sharded once, on segment boundaries); got {segments}"
        )
    transformers = _import_transformers()
    transformers.AttentionInterface.register(CONTEXT_PARALLEL_NAME, pbs_context_parallel_forward)
    _setup = _Setup(integration, group, segments[0])
    return integration


def registered_context_parallel() -> tuple[PBSIntegrationConfig, Any] | None:
    """``(config, group)`` of the last `register_context_parallel` call, or ``None`` before it."""
    return None if _setup is None else (_setup.config, _setup.group)


def _refuse_unserved(setup: _Setup | None, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float, kwargs: dict[str, Any]) -> None:
    """Raises for a call context parallelism does not serve (see the module docstring)."""
    if setup is None:
        raise RuntimeError(f"{CONTEXT_PARALLEL_NAME}: call pbs.integrations.context_parallel.register_context_parallel() first")
    where = f"{CONTEXT_PARALLEL_NAME} (layer {getattr(module, 'layer_idx', None)})"
    if query.shape[2] != key.shape[2]:
        raise NotImplementedError(
            f"{where}: {query.shape[2]} queries against {key.shape[2]} keys; context parallelism runs a prefill "
            "without a cached prefix (use_cache=False)"
        )
    if attention_mask is not None:
        raise ValueError(f"{where}: got an attention mask; context parallelism serves unpadded causal prompts "
                         "and applies causality over the original positions itself")
    if dropout:
        raise ValueError(f"{where}: attention dropout {dropout} (training mode); run the model in eval mode")
    for name in ("sliding_window", "softcap"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"{where}: {name}={kwargs[name]} is not supported under context parallelism")
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if not is_causal:
        raise NotImplementedError(f"{where}: non-causal attention (the zigzag split serves causal prefill)")


def pbs_context_parallel_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: `pbs.distributed.context_parallel_attention` on this rank's shard.

    Args:
        module: the attention layer (its ``layer_idx`` selects the layer's config).
        query: ``(B, Hq, N_local, D)``, this rank's zigzag shard, RoPE applied at original positions.
        key, value: ``(B, Hkv, N_local, D)``, the same tokens (no cached prefix), not repeated for GQA.
        attention_mask: must be ``None`` (transformers builds none for this name).
        scaling: softmax scale (``None``: ``D ** -0.5``).
        dropout: must be 0.
        **kwargs: what the model passes besides; ``sliding_window``, ``softcap`` must be ``None``
            and ``is_causal`` true.

    Returns:
        ``(attn_output (B, N_local, Hq, Dv), None)``, as transformers' SDPA function returns it.

    Raises:
        RuntimeError: `register_context_parallel` has not run.
        NotImplementedError / ValueError: a call context parallelism does not serve (see the
            module docstring).
    """
    setup = _setup
    layer_idx = getattr(module, "layer_idx", None)
    layer_config = failure = None
    try:
        _refuse_unserved(setup, module, query, key, attention_mask, dropout, kwargs)
        assert setup is not None
        layer_config = setup.config.config_for_layer(layer_idx)
    except Exception as error:  # noqa: BLE001 - recorded, then raised on every rank by agree()
        failure = error
    # The ranks agree on the layer's config (so on its dense decision) before any collective.
    local_len = query.shape[2]
    table = agree(f"{CONTEXT_PARALLEL_NAME} layer", group=None if setup is None else setup.group, like=query,
                  config=layer_config, same={"layer": layer_idx}, own={"tokens": local_len}, failure=failure)
    assert setup is not None
    seq_len = sum(row["tokens"] for row in table)
    reason = None
    if layer_config is None:
        reason = "skipped_layer"
    elif DensePolicy(layer_config).too_short(seq_len):
        reason = "short_sequence"
    run_config = layer_config if reason is None else DensePolicy.always_dense(layer_config or setup.config.pbs,
                                                                               query.device)
    result = context_parallel_attend(query, key, value, run_config, group=setup.group, scale=scaling)
    if _active_calls:
        density = None
        if reason is None and result.reason is None:
            plans = [p for p in result.plans if p is not None]
            allowed = sum(p.layout.batch * p.layout.heads_q * p.layout.total_allowed_blocks for p in plans)
            density = sum(p.density * p.layout.batch * p.layout.heads_q * p.layout.total_allowed_blocks
                          for p in plans) / allowed if allowed else None
        call = LayerCall(layer_idx, local_len, seq_len, "pbs" if reason is None and result.reason is None else "dense",
                         reason or result.reason, density)
        for calls in _active_calls:
            calls.append(call)
    return result.out.transpose(1, 2).contiguous(), None


def context_parallel_prefill(
    model: torch.nn.Module, input_ids: torch.Tensor, *, keep: Literal["last", "all"] = "last"
) -> ContextParallelPrefill:
    """One prefill of ``input_ids`` split over the registered group: call it on every rank.

    Each rank runs the whole model on its zigzag shard of the prompt with the tokens' original
    ``position_ids`` and ``use_cache=False``, the attention layers through
    `pbs_context_parallel_forward` (the model is switched to `CONTEXT_PARALLEL_NAME` for the call
    and back after it).

    Args:
        model: a causal LM of transformers whose attention goes through ``AttentionInterface``
            and whose other layers work token by token (Llama, Qwen2, Mistral without a sliding
            window), the same weights on every rank.
        input_ids: ``(B, N)``, the whole prompt, the same on every rank, on the model's device.
            ``N`` must hold at least ``2P`` segments (2,048 tokens on 4 ranks with segments of 256).
        keep: ``"last"``: only the last local position's logits are computed (``logits_to_keep=1``:
            no ``(N_local, V)`` tensor); ``"all"``: every local position's, returned as ``logits``.

    Returns:
        `ContextParallelPrefill`: ``last_logits`` ``(B, V)`` on every rank; with ``keep="all"``
        ``logits`` ``(B, N_local, V)``; ``positions``; ``seq_len``; ``layers``.

    Raises:
        RuntimeError: torch.distributed is not initialised, or no attention layer of the model
            called the context-parallel function.
        ValueError: on every rank alike (the ranks first agree, `pbs.distributed.agreement`):
            a rank has not registered, its ``input_ids`` are not 2-D or too short for the group,
            or the ranks' prompts, registered configs or ``keep`` differ.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("context_parallel_prefill needs an initialised torch.distributed process group")
    setup = _setup
    group = None if setup is None else setup.group
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    failure = checksum = None
    try:
        if setup is None:
            raise RuntimeError("call pbs.integrations.context_parallel.register_context_parallel() first")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (B, N), got shape {tuple(input_ids.shape)}")
        if keep not in ("last", "all"):
            raise ValueError(f"keep must be 'last' or 'all', got {keep!r}")
        batch, seq_len = input_ids.shape
        positions = shard_sequence(torch.arange(seq_len, device=input_ids.device), rank, world, dim=0,
                                   segment_size=setup.segment_size)
        local_ids = shard_sequence(input_ids, rank, world, dim=1, segment_size=setup.segment_size)
        # Position-weighted, so that the same tokens in another order differ too (int64 wraps
        # alike on every rank).
        checksum = int((input_ids.long() * torch.arange(1, seq_len + 1, device=input_ids.device)).sum())
    except Exception as error:  # noqa: BLE001 - recorded, then raised on every rank by agree()
        failure = error
    # The ranks agree on the prompt and the registration before the model runs: a rank that raised
    # here, or holds another prompt, would otherwise meet the others' first layer out of step.
    agree(f"{CONTEXT_PARALLEL_NAME} prefill", group=group, like=input_ids,
          config=None if setup is None else setup.config, failure=failure,
          same={"input_ids shape": list(getattr(input_ids, "shape", ())), "input_ids checksum": checksum,
                "keep": keep})
    assert setup is not None
    kwargs: dict[str, Any] = {"use_cache": False}
    takes_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
    if keep == "last" and takes_keep:
        kwargs["logits_to_keep"] = 1

    previous = getattr(model.config, "_attn_implementation", None)
    calls: list[LayerCall] = []
    _active_calls.append(calls)
    try:
        switch_attention(model, CONTEXT_PARALLEL_NAME)
        with torch.inference_mode():
            logits = model(input_ids=local_ids, position_ids=positions[None].expand(batch, -1), **kwargs).logits
    finally:
        _active_calls.remove(calls)
        if previous is not None and previous != CONTEXT_PARALLEL_NAME:
            switch_attention(model, previous)
    if not calls:
        raise RuntimeError(
            f"no attention layer of {type(model).__name__} called {CONTEXT_PARALLEL_NAME!r}: its attention does not go "
            "through transformers' AttentionInterface, so its logits are not those of the whole sequence"
        )
    last = logits[:, -1].clone()  # rank 0's shard ends with the sequence's last chunk
    src = rank_zero = 0
    if group is not None:
        src = dist.get_global_rank(group, rank_zero)
    dist.broadcast(last, src=src, group=group)
    return ContextParallelPrefill(
        last_logits=last,
        logits=logits if keep == "all" else None,
        positions=positions,
        seq_len=seq_len,
        layers=tuple(calls),
    )
