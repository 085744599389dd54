"""The rows of a ``pbs quality`` report: a `Method` is a label, a curve (family) and a threshold
around an integration config.

* `make_method`: a method from a config (`coerce_integration`), with its label and family built from
  the components that differ from their defaults (``"last_block + mean_pool (per_head) @ 0.9"``);
* `quick_methods`: dense, the library's defaults and the paper's method (``pbs quality`` with no
  options); `default_methods`: dense, the library's defaults and the default families at every
  threshold (``pbs quality --full``); `load_methods`: methods from a JSON file;
* `selector_threshold`: which selector field a sweep varies (the selector's `knob`);
* `with_backend`: a method's config with every layer on one backend.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pbs.components import permuter_registry, selector_registry
from pbs.config import DEFAULT_PRESET, PRESETS, PBSConfig
from pbs.integrations.dispatch import PBSIntegrationConfig

DEFAULT_THRESHOLDS = (0.8, 0.9, 0.95)
# Selector fields that act as the threshold a method is swept over, in order of preference.
@dataclass(frozen=True)
class Method:
    """One row of the report.

    Attributes:
        label: unique row name, e.g. ``"last_block + mean_pool (per_head) @ 0.9"``.
        family: the curve the row belongs to in the loss-density picture (the label without the
            threshold); ``"dense"`` for the reference.
        threshold: the selector's threshold / coverage / density, the x of the sweep (None: none).
        config: how every layer runs; ``None`` for dense SDPA.
        chunk_size: the sequence is prefilled in chunks of this many tokens against a growing KV
            cache (chunked prefill: each chunk's queries attend to the cached prefix and to
            themselves, ``Nq < Nk``); ``None``: in one pass. See `chunked`.
    """

    label: str
    family: str
    threshold: float | None
    config: PBSIntegrationConfig | None
    chunk_size: int | None = None

    @property
    def is_dense(self) -> bool:
        return self.config is None

    @property
    def is_reference(self) -> bool:
        """Dense SDPA in one pass: the row every other row is compared with."""
        return self.config is None and self.chunk_size is None

    @property
    def is_oracle(self) -> bool:
        return self.config is not None and self.config.pbs.selector.name == "oracle"

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "family": self.family,
            "threshold": self.threshold,
            "config": None if self.config is None else self.config.model_dump(mode="json"),
            "chunk_size": self.chunk_size,
        }


DENSE = Method(label="dense", family="dense", threshold=None, config=None)


def chunked_label(label: str, size: int) -> str:
    """The label of ``label``'s chunked-prefill twin (`chunked`)."""
    return f"{label}, chunks of {size}"


def chunked(method: Method, size: int) -> Method:
    """``method`` prefilled in chunks of ``size`` tokens against the growing KV cache: its label and
    family gain ``", chunks of <size>"`` (dense's twin stays the reference's family, so the pictures
    draw it as a method)."""
    if size < 1:
        raise ValueError(f"chunk size must be at least 1, got {size}")
    if method.chunk_size is not None:
        raise ValueError(f"{method.label!r} is already chunked")
    return Method(label=chunked_label(method.label, size), family=chunked_label(method.family, size),
                  threshold=method.threshold, config=method.config, chunk_size=size)


def one_shot_label(method: Method) -> str | None:
    """For a chunked method, the label of its one-shot twin; ``None`` for a one-shot method."""
    if method.chunk_size is None:
        return None
    return method.label.removesuffix(f", chunks of {method.chunk_size}")


def _component_label(config: Any, registry: Any, skip: Sequence[str] = ()) -> str:
    defaults = type(registry.parse(config.name))()
    changed = {
        k: v for k, v in config.model_dump().items()
        if k != "name" and k not in skip and getattr(defaults, k) != v
    }
    if not changed:
        return config.name
    return f"{config.name}(" + ", ".join(f"{k}={v}" for k, v in sorted(changed.items())) + ")"


def selector_threshold(config: PBSConfig) -> tuple[str | None, float | None]:
    """The selector field a sweep varies (its `pbs.SelectorConfig.knob`) and its value, or
    ``(None, None)`` for a selector without one (a ``union``)."""
    return config.selector.knob, config.selector.knob_value()


def coerce_integration(config: Any) -> PBSIntegrationConfig:
    """A `PBSIntegrationConfig` from itself, a `PBSConfig`, or a dict / JSON of either.

    A plain PBS config runs in every layer at every length (``min_seq_len=1``): the harness asks what
    PBS does, so nothing may quietly stay dense.
    """
    if isinstance(config, str):
        config = json.loads(config)
    if isinstance(config, PBSIntegrationConfig):
        return config
    if isinstance(config, dict) and config and set(config) <= set(PBSIntegrationConfig.model_fields):
        return PBSIntegrationConfig.model_validate(config)
    return PBSIntegrationConfig(pbs=PBSConfig.coerce(config), min_seq_len=1)


def make_method(config: Any, label: str | None = None, family: str | None = None, *,
                named: bool = False) -> Method:
    """A `Method` from a config (see `coerce_integration`), ``"dense"`` or ``None``.

    ``named``: a config a user gave (``--method``, a ``--methods`` item) is labelled by the name it is
    known by, where it has one (`known_label`: the defaults or a preset, in any precision), rather
    than by its components; its family stays the components'."""
    if config is None or config == "dense":
        return DENSE if label is None else Method(label, family or "dense", None, None)
    integration = coerce_integration(config)
    pbs_config = integration.pbs
    field_name, threshold = selector_threshold(pbs_config)
    name = (
        f"{_component_label(pbs_config.permuter, permuter_registry)} + "
        f"{_component_label(pbs_config.selector, selector_registry, skip=(field_name,) if field_name else ())}"
    )
    extras = [pbs_config.gqa]
    if pbs_config.precision != "native":  # the same selection in another arithmetic is another row
        extras.append(pbs_config.precision)
    if (pbs_config.block_size, pbs_config.segment_size) != (128, 256):
        extras.append(f"B={pbs_config.block_size} S={pbs_config.segment_size}")
    if integration.skip_first_layers:
        extras.append(f"skip {integration.skip_first_layers}")
    if integration.layer_overrides:
        extras.append(f"{len(integration.layer_overrides)} overrides")
    auto_family = f"{name} ({', '.join(extras)})"
    family = family or auto_family
    if label is None and named:
        label = known_label(integration)
    if label is None:
        label = family if threshold is None else f"{family} @ {threshold:g}"
    return Method(label=label, family=family, threshold=threshold, config=integration)


def known_label(integration: PBSIntegrationConfig) -> str | None:
    """The name a plain config (no integration field set) is known by: ``DEFAULTS_LABEL``, a preset's
    name, or either with the precision it computes in (``"defaults, precision int8_qk"``,
    ``"fp8 (precision fp8)"``); None for any other config."""
    if integration != coerce_integration(integration.pbs):
        return None
    precision = integration.pbs.precision
    native = coerce_integration(integration.pbs.model_copy(update={"precision": "native"}))
    named = [("defaults", PBSConfig()), *((name, PBSConfig.from_preset(name)) for name in PRESETS
                                         if name != DEFAULT_PRESET)]
    for name, config in named:
        if integration == coerce_integration(config):
            if name == "defaults":
                return DEFAULTS_LABEL
            return name if precision == "native" else f"{name} (precision {precision})"
    for name, config in named:
        if native == coerce_integration(config):
            return f"{name}, precision {precision}"
    return None


# (permuter, selector, gqa) of the default report; the threshold field comes from the selector.
DEFAULT_FAMILIES: tuple[tuple[str, str, str], ...] = (
    ("identity", "oracle", "per_head"),
    ("last_block", "oracle", "per_head"),
    ("none", "mean_pool", "per_head"),
    ("identity", "mean_pool", "per_head"),
    ("last_block", "mean_pool", "per_head"),
    ("last_block", "mean_pool", "shared"),
    ("none", "antidiagonal", "per_head"),
    ("last_block", "antidiagonal", "per_head"),
)


DEFAULTS_LABEL = f"defaults ({DEFAULT_PRESET})"
"""Label (and family) of the default report's row for the library's default `PBSConfig`."""


def default_methods(thresholds: Sequence[float] = DEFAULT_THRESHOLDS) -> tuple[list[Method], list[str]]:
    """Dense, the library's default config (one row: its selector has no single threshold), then
    every default family at every threshold, for the components registered now.

    Returns:
        ``(methods, skipped)``: ``skipped`` names the families left out because a component is not
        registered (e.g. the ``none`` permuter in a version that lacks it).
    """
    permuters, selectors = set(permuter_registry.names()), set(selector_registry.names())
    methods, skipped = [DENSE, make_method(PBSConfig(), DEFAULTS_LABEL, DEFAULTS_LABEL)], []
    for permuter, selector, gqa in DEFAULT_FAMILIES:
        if permuter not in permuters or selector not in selectors:
            missing = [n for n, known in ((permuter, permuters), (selector, selectors)) if n not in known]
            skipped.append(f"{permuter} + {selector} ({gqa}): {', '.join(missing)} not registered")
            continue
        field_name = "coverage" if selector == "oracle" else "threshold"
        for threshold in thresholds:
            config = {"permuter": permuter, "selector": {"name": selector, field_name: threshold}, "gqa": gqa}
            methods.append(make_method(config))
    return methods, skipped


PAPER_PRESET = "pbs_paper"
PAPER_LABEL = f"paper ({PAPER_PRESET})"
"""Label (and family) of the quick report's row for the paper's method, preset ``pbs_paper``
(``last_block`` + ``mean_pool`` 0.9, GQA ``per_head``)."""


def quick_methods() -> list[Method]:
    """The methods of ``pbs quality`` with no options: dense, the library's defaults (`PBSConfig()`)
    and the paper's method (preset ``pbs_paper``)."""
    return [DENSE, make_method(PBSConfig(), DEFAULTS_LABEL, DEFAULTS_LABEL),
            make_method(PBSConfig.from_preset(PAPER_PRESET), PAPER_LABEL, PAPER_LABEL)]


def load_methods(path: str | Path) -> list[Method]:
    """Methods from a JSON file: a list whose items are ``"dense"``, a config (PBS or integration), or
    ``{"config": ..., "label": ..., "family": ...}`` with optional label and family."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of methods, got {type(data).__name__}")
    methods = []
    for item in data:
        if isinstance(item, dict) and "config" in item:
            methods.append(make_method(item["config"], item.get("label"), item.get("family"), named=True))
        else:
            methods.append(make_method(item, named=True))
    return methods


def check_unique_labels(methods: Sequence[Method]) -> None:
    seen: set[str] = set()
    for method in methods:
        if method.label in seen:
            raise ValueError(f"two methods share the label {method.label!r}; give them explicit labels")
        seen.add(method.label)


def config_with_backend(config: PBSConfig | None, backend: str) -> PBSConfig | None:
    """One layer's `PBSConfig` with its backend set to ``backend`` (``None``, a dense layer, stays
    ``None``); ``"auto"`` also turns `DenseFallback` off."""
    if config is None:
        return None
    data = config.model_dump()
    data["backend"] = backend
    if backend == "auto":  # the GPU comparison must run PBS, not its dense fallback
        data["dense_fallback"] = {"min_seq_len": 0, "max_density": None}
    return PBSConfig.model_validate(data)


def with_backend(integration: PBSIntegrationConfig, backend: str) -> PBSIntegrationConfig:
    """``integration`` with every layer's backend set to ``backend`` (``"auto"`` also turns
    `DenseFallback` off, so that the GPU run is PBS everywhere)."""
    return integration.model_copy(update={
        "pbs": config_with_backend(integration.pbs, backend),
        "layer_overrides": {i: config_with_backend(c, backend) for i, c in integration.layer_overrides.items()},
    })
