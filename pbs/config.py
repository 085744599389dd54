"""``PBSConfig``: the one object that says how PBS-Attn runs."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, field_validator, model_validator

if TYPE_CHECKING:
    import torch

from pbs.components import PermuterConfig, SelectorConfig, name_valid_fields, permuter_registry, selector_registry

CONFIG_VERSION = 1

GQAMode = Literal["per_head", "shared"]


class DenseFallback(BaseModel):
    """When ``backend="auto"`` runs dense attention instead of PBS: where sparse cannot win.

    `pbs.dense.DensePolicy` applies the rules in this order. The defaults come from crossovers
    measured on H100 and H200 GPUs (docs/benchmarks.md, "Planning on the GPU and the dense fallback").

    Attributes:
        min_seq_len: run dense when ``Nk`` is below this (shapes only: no planning, no sync); 0
            turns the rule off. The transformers integration applies the same field on every
            device and backend.
        max_density: run dense, before planning, when the density probe estimates more than
            this (one read on the host, skipped inside a CUDA graph capture; on Hopper the dense
            kernel is queued behind the probe so the GPU does not wait for that read). None turns
            both density rules and ``planning_cost_pairs`` off.
        planning_cost_pairs: planning a call costs about as much as dense attention over this
            many query-key pairs (most of it does not shrink with the call's queries: the line
            scores of a few query rows against every key, and the launches the host queues), so
            a call of ``Nq`` queries and ``Nk`` keys runs dense from its shapes alone when
            ``Nq * Nk`` is at most this, and when the probe estimates more than
            ``1 - planning_cost_pairs / (Nq * Nk)`` where that is below ``max_density``: chunks
            of few queries after a long prefix. 0 turns it off.
        max_planned_density: run dense when the planned density is above this (planning is paid
            by then, so dense wins only near full density). None turns this rule off.
        probe_blocks: query blocks the density probe samples (evenly spaced, the last included;
            `pbs.reference.density_probe.probe_density`). It covers the selector's mass share
            (`pbs.SelectorConfig.mass_share`) and does not run for a selector without one
            (``budget``). 0 turns the probe off.
        devices: device types the policy applies to (the crossovers were measured on CUDA).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    min_seq_len: int = Field(32768, ge=0)
    max_density: float | None = Field(0.8, gt=0.0, le=1.0)
    max_planned_density: float | None = Field(0.95, gt=0.0, le=1.0)
    planning_cost_pairs: int = Field(1 << 27, ge=0)
    probe_blocks: int = Field(16, ge=0)
    devices: tuple[str, ...] = ("cuda",)

    @model_validator(mode="wrap")
    @classmethod
    def _name_valid_fields(cls, data: Any, handler: Any) -> Any:
        return name_valid_fields(cls, data, handler)

    @field_validator("devices")
    @classmethod
    def _device_types(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        # The policy compares an input's device.type with these: "cuda:0" would never match.
        import torch

        for entry in value:
            try:
                device = torch.device(entry)
            except (RuntimeError, TypeError):
                device = None
            if device is None or device.type != entry or device.index is not None:
                raise ValueError(
                    f"dense_fallback.devices holds device types, got {entry!r}; give a device type "
                    'such as "cuda" or "cpu", without an index (the policy applies to every device '
                    "of that type)"
                )
        return value


DEFAULT_PRESET = "vertical_slash_pooled"
"""The preset whose components are `PBSConfig`'s defaults (one definition in `PRESETS`, so the two
cannot drift apart)."""


def _default_permuter() -> PermuterConfig:
    return permuter_registry.parse(PRESETS[DEFAULT_PRESET]["permuter"])


def _default_selector() -> SelectorConfig:
    return selector_registry.parse(PRESETS[DEFAULT_PRESET]["selector"])


class PBSConfig(BaseModel):
    """How PBS-Attn permutes, selects and runs; frozen and JSON round-trippable.

    The default components are those of the preset ``vertical_slash_pooled``: no permutation, and
    the union of ``vertical_slash`` (threshold 0.75) and ``mean_pool`` (threshold 0.9). It is the
    default for quality: on a real model it keeps dense loss and long-range copying where the
    paper's ``last_block`` + ``mean_pool`` loses the copy at about the same density
    (docs/quality.md gives the figures). The paper's method is ``PBSConfig.from_preset("pbs_paper")``.

    Components are given by name (``"last_block"``), by dict (``{"name": "mean_pool",
    "threshold": 0.95}``) or as config instances; ``list_permuters()`` / ``list_selectors()`` name
    the choices.

    Attributes:
        version: config schema version, written to JSON so old files stay readable.
        block_size: tokens per block ``B`` (a power of two, >= 16; the Triton kernel takes 64 or 128).
        segment_size: tokens per permutation segment ``S``; a multiple of ``block_size``.
        permuter: how tokens are reordered inside each segment.
        selector: which key blocks each query block computes.
        gqa: ``"shared"`` computes one key order per KV head (queries of the group averaged) and
            never copies K/V; ``"per_head"`` gives each query head its own order (the paper's
            default), which materialises ``Hq`` permuted copies of K and V. It only matters for
            a permuter that reorders keys: with ``permuter="none"`` (the default) keys stay in
            place and are never copied, and selection is per query head in both modes.
        causal: causal (decoder) attention.
        backend: ``"auto"`` (the first registered backend that can run the call: the Gluon
            kernel on Hopper, the Triton kernel on other CUDA GPUs, the reference elsewhere) or
            the name of a registered backend (`pbs.list_backends`: ``"hopper"``, ``"triton"``,
            ``"reference"``, ``"flex"``, and any a plugin registers). The name is checked when a
            call is planned (`pbs.backends.resolve_backend`, which records the backend in the
            plan), so a backend a plugin registers later is accepted.
        force_sink_block: always compute the key block that holds position 0 (the attention sink).
        check_finite: reject NaN/inf inputs with a ``ValueError``. ``None`` (default): checked off
            CUDA (the reference path, where it costs little), not checked on CUDA, where it would
            cost a full read of q, k and v plus a host sync; there, as with
            ``torch.nn.functional.scaled_dot_product_attention``, NaN/inf inputs give NaN/inf
            outputs (in the rows whose selected blocks hold them) instead of an error. ``True``
            checks everywhere (not inside CUDA graph capture); ``False`` never checks.
        dense_fallback: when ``backend="auto"`` runs dense SDPA instead (`DenseFallback`).
        precision: the arithmetic of the selected blocks. ``"native"`` (default): the inputs'
            dtype (bf16/fp16 tensor cores, fp32 accumulation). ``"fp8_qk"``: Q and K in e4m3 with
            per-block scales (K smoothed by its mean over the tokens first), P.V in the inputs'
            dtype. ``"fp8"``: P and V in e4m3 too (P with the fixed scale 1/448, V with
            per-channel scales). ``"int8_qk"`` / ``"int8_qk_fp8_pv"``: Q and smoothed K in int8
            with per-block scales (``amax / 127``: about a third of e4m3's output error on
            Gaussian inputs; the int32-to-fp32 conversion of the scores makes the kernel a few
            percent slower than e4m3), P.V in the inputs' dtype / in e4m3 as ``"fp8"``. `pbs.reference.fp8` defines the scales; the backends that run
            each precision declare it (`pbs.backends.AttentionBackend.precisions`), and a dense
            decision of the dense policy runs SDPA in the native precision (`Plan.precision`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: Literal[1] = CONFIG_VERSION
    block_size: int = Field(128, ge=16, le=1024)
    segment_size: int = Field(256, ge=16)
    permuter: SerializeAsAny[PermuterConfig] = Field(default_factory=_default_permuter)
    selector: SerializeAsAny[SelectorConfig] = Field(default_factory=_default_selector)
    gqa: GQAMode = "shared"
    causal: bool = True
    backend: str = "auto"
    force_sink_block: bool = True
    check_finite: bool | None = None
    dense_fallback: DenseFallback = Field(default_factory=DenseFallback)
    precision: Literal["native", "fp8_qk", "fp8", "int8_qk", "int8_qk_fp8_pv"] = "native"

    @model_validator(mode="wrap")
    @classmethod
    def _name_valid_fields(cls, data: Any, handler: Any) -> Any:
        return name_valid_fields(cls, data, handler)

    @field_validator("permuter", mode="before")
    @classmethod
    def _parse_permuter(cls, value: Any) -> PermuterConfig:
        return permuter_registry.parse(value)

    @field_validator("selector", mode="before")
    @classmethod
    def _parse_selector(cls, value: Any) -> SelectorConfig:
        return selector_registry.parse(value)

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"block_size must be a power of two between 16 and 1024, got {value}")
        return value

    @model_validator(mode="after")
    def _check_sizes(self) -> "PBSConfig":
        if self.segment_size % self.block_size:
            raise ValueError(
                f"segment_size ({self.segment_size}) must be a multiple of block_size ({self.block_size})"
            )
        self.permuter.check_compatible(self)
        self.selector.check_compatible(self)
        return self

    def checks_finite(self, device: "torch.device | str") -> bool:
        """Whether inputs on ``device`` are scanned for NaN/inf (see ``check_finite``)."""
        if self.check_finite is not None:
            return self.check_finite
        return getattr(device, "type", device) != "cuda"

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "PBSConfig":
        """A named configuration from `PRESETS`, with fields overridden by keyword.

        Example:
            ```python
            import pbs

            baseline = pbs.PBSConfig.from_preset("mean_pooling", backend="reference")
            assert baseline.permuter.name == "none"
            ```
        """
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls.model_validate({**PRESETS[name], **overrides})

    @classmethod
    def coerce(cls, config: "PBSConfig | dict[str, Any] | str | None") -> "PBSConfig":
        """Accepts a config, a dict, a JSON string, a preset name (`PRESETS`) or None (defaults)."""
        if config is None:
            return _default_config(cls)
        if isinstance(config, cls):
            return config
        if isinstance(config, dict):
            return cls.model_validate(config)
        if isinstance(config, str):
            if config in PRESETS:
                return cls.from_preset(config)
            if not config.lstrip().startswith("{"):
                raise ValueError(f"config: a string must be a JSON object or a preset name {sorted(PRESETS)}, got {config!r}")
            return cls.model_validate_json(config)
        raise TypeError(
            f"config must be a PBSConfig, dict, JSON string, preset name or None, got {type(config).__name__}"
        )


@functools.lru_cache(maxsize=None)
def _default_config(cls: type) -> Any:
    # Configs are frozen, so one default instance serves every call (validation costs ~10 us).
    return cls()


PRESETS: dict[str, dict[str, Any]] = {
    # The paper's method as published: last-block key order, MeanPooling selection with the segment
    # rule, one permutation per query head. `last_block` + `mean_pool` with GQA `shared` were the
    # defaults before `vertical_slash_pooled`.
    "pbs_paper": {"permuter": "last_block", "selector": "mean_pool", "gqa": "per_head"},
    # The paper's unpermuted MeanPooling baseline (Algorithm 2 with a plain causal block mask).
    "mean_pooling": {"permuter": "none", "selector": "mean_pool"},
    # XAttention's antidiagonal estimator, unpermuted (stride 8).
    "xattention": {"permuter": "none", "selector": "antidiagonal"},
    # PBS-Attn with XAttention's estimator (the paper's "existing block selection" appendix).
    "pbs_xattention": {"permuter": "last_block", "selector": "antidiagonal", "gqa": "per_head"},
    # Unpermuted vertical and slash lines of the last queries: keeps long-range copying on a real
    # model (docs/quality.md; threshold chosen on the tuning texts, held-out copy within +0.03).
    "vertical_slash": {"permuter": "none", "selector": {"name": "vertical_slash", "threshold": 0.75}},
    # Lines plus pooled blocks: held-out loss within +0.013 and copy within +0.05 of dense at the
    # density of `last_block` + `mean_pool` (docs/quality.md); the lines keep the copy, mean
    # pooling the text. The defaults (DEFAULT_PRESET): PBSConfig() equals this preset.
    "vertical_slash_pooled": {"permuter": "none", "selector": {"name": "union", "selectors": [
        {"name": "vertical_slash", "threshold": 0.75}, {"name": "mean_pool", "threshold": 0.9}]}},
    # The same union with the lines cut at 0.6: for the layers after the first sixth of a model
    # (`PBSIntegrationConfig.by_depth`). In every layer of SmolLM2 it loses the copy; after its first
    # sixth it kept both quality bars on held-out texts, but on Gemma 3 270M it costs +0.035 nats at
    # 15K tokens (docs/quality.md, "Lines per layer" and "A second model").
    "vertical_slash_pooled_deep": {"permuter": "none", "selector": {"name": "union", "selectors": [
        {"name": "vertical_slash", "threshold": 0.6}, {"name": "mean_pool", "threshold": 0.9}]}},
    # The defaults with Q.K^T in int8 and P.V in e4m3 (`PBSConfig.precision`): on SmolLM2 within
    # +0.002 nats of native precision at the same mask (docs/fp8.md).
    "quantized": {"permuter": "none", "selector": {"name": "union", "selectors": [
        {"name": "vertical_slash", "threshold": 0.75}, {"name": "mean_pool", "threshold": 0.9}]},
        "precision": "int8_qk_fp8_pv"},
    # The defaults with Q.K^T and P.V in e4m3: the fastest, at +0.013 nats on SmolLM2 (docs/fp8.md).
    "fp8": {"permuter": "none", "selector": {"name": "union", "selectors": [
        {"name": "vertical_slash", "threshold": 0.75}, {"name": "mean_pool", "threshold": 0.9}]}, "precision": "fp8"},
}
"""Named configurations: ``PBSConfig.from_preset(name)``. Fields not named keep their defaults."""
