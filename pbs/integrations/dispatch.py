"""Which attention one model call gets: PBS or the dense fallback, and why.

This module knows nothing about transformers: it holds the per-model configuration
(`PBSIntegrationConfig`) and the pure decision rule (`choose_attention`), so both can
be imported, validated and tested without transformers installed.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pbs.config import DenseFallback, PBSConfig
from pbs.dense import DensePolicy

# Why a call fell back to dense attention. The keys are stable (tests and logs use them); the
# explanations are written once per key to the log.
FALLBACK_REASONS: dict[str, str] = {
    "decode": "a single query token (decode): attention over the cache is memory-bound and cheap",
    "not_causal": "non-causal attention (PBS is for causal decoders)",
    "compiling": "torch.compile is tracing (PBS planning is data-dependent and not traceable)",
    "paged_cache": "a paged (continuous-batching) cache",
    "needs_grad": (
        "gradients are required, and the PBS kernels are forward-only (run inference under "
        "torch.no_grad() or torch.inference_mode(), as generate() does)"
    ),
    "dropout": "attention dropout > 0 (training mode)",
    "softcap": "attention logit softcapping (runs eager attention with the softcap)",
    "sliding_window": "a sliding-window layer whose window is shorter than the sequence",
    "attention_mask": (
        "the model passed an attention mask: padding tokens in the batch, a static cache, or a custom "
        "mask pattern (PBS runs unpadded causal attention only)"
    ),
    "skipped_layer": "the layer is configured dense (skip_first_layers, or a layer_overrides entry of None)",
    "short_sequence": "the sequence is shorter than min_seq_len",
    "short_chunk": "the query chunk after a cached prefix is shorter than min_query_len",
    "dense_fallback": (
        "PBSConfig.dense_fallback chose dense attention (backend='auto' on its devices, CUDA by default: "
        "the density probe before planning was above dense_fallback.max_density, or the planned density "
        "above dense_fallback.max_planned_density)"
    ),
}


class PBSIntegrationConfig(BaseModel):
    """How a whole model uses PBS: one `PBSConfig` plus when to stay dense.

    Attributes:
        pbs: the PBS config of every layer without an override.
        skip_first_layers: the first layers run dense attention (early layers attend broadly, so
            sparsity costs them more accuracy than it saves time).
        min_seq_len: a shorthand for ``dense_fallback.min_seq_len`` of ``pbs`` and of every
            ``layer_overrides`` config, the one knob for length: calls whose key length (prompt
            plus cached prefix) is below a layer's ``dense_fallback.min_seq_len`` run dense, as
            short sequences are faster dense than planned. ``None`` (default) keeps each config's
            own value (`DenseFallback`'s default, 32768). A config that sets
            ``dense_fallback.min_seq_len`` itself to another value is an error. In the
            integration the length rule holds on every device and backend (the fallback is
            transformers' SDPA), not only where ``dense_fallback.devices`` lets `pbs.attention`
            fall back.
        min_query_len: chunks of fewer queries after a cached prefix run dense (e.g. speculative
            decoding drafts); planning a whole cache for a handful of queries does not pay.
        layer_overrides: ``{layer_idx: PBSConfig or None}``; ``None`` makes that layer dense. An
            override wins over ``skip_first_layers``.

    Example:
        ```python
        from pbs.integrations.dispatch import PBSIntegrationConfig

        cfg = PBSIntegrationConfig(skip_first_layers=2, layer_overrides={5: None}, min_seq_len=4096)
        assert [cfg.config_for_layer(i) is None for i in (0, 1, 2, 5)] == [True, True, False, True]
        assert cfg.config_for_layer(2).dense_fallback.min_seq_len == 4096
        ```
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    pbs: PBSConfig = Field(default_factory=PBSConfig)
    skip_first_layers: int = Field(0, ge=0)
    min_seq_len: int | None = Field(None, ge=0)
    min_query_len: int = Field(16, ge=2)
    layer_overrides: dict[int, PBSConfig | None] = Field(default_factory=dict)

    @field_validator("pbs", mode="before")
    @classmethod
    def _coerce_pbs(cls, value: Any) -> PBSConfig:
        return PBSConfig.coerce(value)

    @field_validator("layer_overrides")
    @classmethod
    def _non_negative_layers(cls, value: dict[int, PBSConfig | None]) -> dict[int, PBSConfig | None]:
        negative = sorted(i for i in value if i < 0)
        if negative:
            raise ValueError(f"layer_overrides keys must be layer indices >= 0, got {negative}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _one_length_knob(cls, data: Any) -> Any:
        """Writes ``min_seq_len`` into ``dense_fallback.min_seq_len`` of every config given."""
        n = data.get("min_seq_len") if isinstance(data, dict) else None
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            return data  # None, or a value the field itself rejects (or coerces: see _length_knob_agrees)
        data = dict(data)
        data["pbs"] = _with_min_seq_len(data.get("pbs"), n, "pbs")
        overrides = data.get("layer_overrides")
        if isinstance(overrides, dict):
            data["layer_overrides"] = {
                i: None if c is None else _with_min_seq_len(c, n, f"layer_overrides[{i}]") for i, c in overrides.items()
            }
        return data

    @model_validator(mode="after")
    def _length_knob_agrees(self) -> "PBSIntegrationConfig":
        if self.min_seq_len is not None:
            configs = {"pbs": self.pbs, **{f"layer_overrides[{i}]": c for i, c in self.layer_overrides.items()}}
            for where, config in configs.items():
                if config is not None and config.dense_fallback.min_seq_len != self.min_seq_len:
                    raise ValueError(
                        f"min_seq_len={self.min_seq_len} disagrees with {where}.dense_fallback.min_seq_len="
                        f"{config.dense_fallback.min_seq_len}; give min_seq_len as a whole number"
                    )
        return self

    @model_validator(mode="after")
    def _causal_only(self) -> "PBSIntegrationConfig":
        configs = {"pbs": self.pbs, **{f"layer_overrides[{i}]": c for i, c in self.layer_overrides.items()}}
        for where, config in configs.items():
            if config is not None and not config.causal:
                raise ValueError(f"{where}.causal must be True: the transformers integration serves causal decoders")
        return self

    @classmethod
    def by_depth(
        cls,
        num_layers: int,
        *,
        deep: PBSConfig | dict[str, Any] | str | None = "vertical_slash_pooled_deep",
        leading: PBSConfig | dict[str, Any] | str | None = None,
        leading_share: float = 1 / 6,
        **fields: Any,
    ) -> "PBSIntegrationConfig":
        """One selection for a model's first layers and another for the rest.

        The first ``ceil(leading_share * num_layers)`` layers get ``leading`` (default: the
        defaults, `PBSConfig()`), every later layer ``deep`` (default: the preset
        ``vertical_slash_pooled_deep``, the defaults' lines cut at 0.6 instead of 0.75). On
        SmolLM2-135M the first layers are where sparse lines lose the long-range copy, and the later
        ones took the lower threshold within the quality bars; on Gemma 3 270M the lower threshold
        lost +0.035 nats at 15K tokens. Measure it on your model (``pbs quality``) before relying
        on it; see docs/quality.md ("Lines per layer", "A second model").

        Args:
            num_layers: the model's decoder layers (``model.config.num_hidden_layers``).
            deep: the config of the layers after the leading ones: a `PBSConfig`, a dict, a JSON
                string or a name in `pbs.config.PRESETS`.
            leading: the config of the leading layers; ``None`` means `PBSConfig()`.
            leading_share: the share of the layers that are leading, in ``[0, 1]``.
            **fields: the other fields (``min_seq_len``, ``min_query_len``, ``skip_first_layers``);
                layers skipped by ``skip_first_layers`` stay dense, and ``layer_overrides`` given
                here win over the leading layers' entries.

        Example:
            ```python
            import pbs
            from pbs.integrations.dispatch import PBSIntegrationConfig

            cfg = PBSIntegrationConfig.by_depth(30)
            assert cfg.config_for_layer(4).selector == pbs.PBSConfig().selector
            assert cfg.config_for_layer(5) == pbs.PBSConfig.from_preset("vertical_slash_pooled_deep")
            ```

        Raises:
            ValueError: ``num_layers`` < 1, ``leading_share`` outside ``[0, 1]``, or a field the
                config rejects.
        """
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be an int >= 1 (model.config.num_hidden_layers), got {num_layers!r}")
        if isinstance(leading_share, bool) or not isinstance(leading_share, (int, float)) or not 0 <= leading_share <= 1:
            raise ValueError(f"leading_share must be a number in [0, 1], got {leading_share!r}")
        if "pbs" in fields:
            raise ValueError("by_depth: give the layers' configs as deep= and leading=, not pbs=")
        leading_config = PBSConfig.coerce(leading)
        count = math.ceil(round(leading_share * num_layers, 9))  # 1/6 * 30 is 5.000000000000001
        skipped = fields.get("skip_first_layers", 0)  # overrides win over skipping: skipped layers get none
        overrides = {i: leading_config for i in range(skipped if isinstance(skipped, int) else 0, count)}
        overrides.update(fields.pop("layer_overrides", None) or {})
        return cls(pbs=PBSConfig.coerce(deep), layer_overrides=overrides, **fields)

    def config_for_layer(self, layer_idx: int | None) -> PBSConfig | None:
        """The PBS config of layer ``layer_idx`` (``None`` for an unknown layer), or ``None`` if dense."""
        if layer_idx is None:
            return self.pbs
        if layer_idx in self.layer_overrides:
            return self.layer_overrides[layer_idx]
        if layer_idx < self.skip_first_layers:
            return None
        return self.pbs


def _with_min_seq_len(config: Any, min_seq_len: int, where: str) -> Any:
    """``config`` (anything `PBSConfig.coerce` takes) with ``dense_fallback.min_seq_len =
    min_seq_len``; an error if ``config`` set it itself to another value. The value written is not
    marked as set by the user, so a later ``min_seq_len`` (``register(config, min_seq_len=...)``)
    may replace it. An invalid ``config`` is returned as it is, for the field to report."""
    try:
        config = PBSConfig.coerce(config)
    except Exception:  # noqa: BLE001 - the field validator reports it, with its location
        return config
    policy = config.dense_fallback
    if "min_seq_len" in policy.model_fields_set and policy.min_seq_len != min_seq_len:
        raise ValueError(
            f"min_seq_len={min_seq_len} disagrees with {where}.dense_fallback.min_seq_len={policy.min_seq_len}: "
            "they are one knob (the integration's min_seq_len sets dense_fallback.min_seq_len of every "
            "layer's config); give one of them"
        )
    if policy.min_seq_len == min_seq_len:
        return config
    fields_set = set(policy.model_fields_set) - {"min_seq_len"}
    updated = DenseFallback.model_construct(_fields_set=fields_set, **{**dict(policy), "min_seq_len": min_seq_len})
    return config.model_copy(update={"dense_fallback": updated})


def choose_attention(
    config: PBSIntegrationConfig,
    *,
    layer_idx: int | None,
    q_len: int,
    kv_len: int,
    has_mask: bool,
    is_causal: bool = True,
    dropout: float = 0.0,
    softcap: float | None = None,
    sliding_window: int | None = None,
    paged_cache: bool = False,
    compiling: bool = False,
    needs_grad: bool = False,
) -> tuple[PBSConfig | None, str | None]:
    """Decides whether one attention call runs PBS.

    Args:
        config: the model's integration config.
        layer_idx: the calling layer (``module.layer_idx``), or ``None`` if unknown.
        q_len: queries ``Nq`` of this call; they are the last ``Nq`` of the ``kv_len`` positions.
        kv_len: keys ``Nk`` (cached prefix plus this call's tokens).
        has_mask: the model passed an explicit attention mask. The ``pbs`` mask function returns
            ``None`` exactly for unpadded causal calls, so a mask means padding or a pattern.
        is_causal, dropout, softcap, sliding_window, paged_cache, compiling, needs_grad: what the
            model asks of this call.

    Returns:
        ``(pbs_config, None)`` to run PBS, or ``(None, reason)`` with a key of
        `FALLBACK_REASONS` to run dense attention.
    """
    if q_len == 1:
        return None, "decode"
    if not is_causal:
        return None, "not_causal"
    if compiling:
        return None, "compiling"
    if paged_cache:
        return None, "paged_cache"
    if needs_grad:
        return None, "needs_grad"
    if dropout > 0.0:
        return None, "dropout"
    if softcap is not None:
        return None, "softcap"
    if sliding_window is not None and kv_len > sliding_window:
        return None, "sliding_window"
    if has_mask:
        return None, "attention_mask"
    pbs_config = config.config_for_layer(layer_idx)
    if pbs_config is None:
        return None, "skipped_layer"
    # The length rule on every device and backend: `pbs.attention` would apply it only where
    # dense_fallback.devices says, and the integration always has SDPA.
    if DensePolicy(pbs_config).too_short(kv_len):
        return None, "short_sequence"
    if q_len < kv_len and q_len < config.min_query_len:
        return None, "short_chunk"
    return pbs_config, None
