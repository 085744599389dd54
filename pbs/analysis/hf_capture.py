"""Capturing post-RoPE queries and keys from a transformers model (optional; needs ``transformers``).

Modern transformers attention modules project and rotate ``q``/``k`` and then hand them to the
function registered under ``config._attn_implementation`` in ``AttentionInterface``. We register
a recording function there and point the model's configs at it for one forward pass: it stores the
queries and keys exactly as the attention kernel would receive them (after RoPE, before any GQA
repeat) and then calls the implementation the model had, so the forward pass is unchanged. No
model-specific code is needed, for any architecture that dispatches through the interface.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from pbs.analysis.inputs import QKCapture

CAPTURE_IMPLEMENTATION = "pbs_qk_capture"

# id(attention module) -> where to record its q/k (None: a layer not asked for) and the dtype to store.
_RECORDERS: dict[int, tuple[dict[int, tuple[torch.Tensor, torch.Tensor]] | None, torch.dtype]] = {}
# id(config) -> the attention implementation the config had before the capture.
_ORIGINAL_IMPLEMENTATIONS: dict[int, str | None] = {}


def require_transformers() -> Any:
    """Imports transformers or raises an ImportError saying how to get it."""
    try:
        import transformers
    except ImportError as exc:
        raise ImportError("capturing q/k from a model needs the transformers package: pip install transformers") from exc
    return transformers


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's attention modules: those with a ``layer_idx``, a ``config`` and a class name
    ending in ``Attention`` (the transformers convention)."""
    return [
        m for m in model.modules()
        if hasattr(m, "layer_idx") and hasattr(m, "config") and type(m).__name__.endswith("Attention")
    ]


def capture_qk(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    layers: Sequence[int] | None = None,
    store_dtype: torch.dtype = torch.float32,
    source: str | None = None,
) -> QKCapture:
    """Runs one forward pass and returns the post-RoPE queries and keys of the chosen layers.

    Args:
        model: a transformers model whose attention dispatches through ``AttentionInterface``
            (Llama, Mistral, Qwen2/3, Gemma, ... in transformers >= 4.48).
        input_ids: ``(B, N)`` token ids on the model's device.
        layers: layer ids to keep (default all); others are not stored, which saves memory.
        store_dtype: dtype of the stored copies (they are moved to the CPU).
        source: description for the capture, default the model's class name.

    Returns:
        A `QKCapture` with ``q (B, Hq, N, D)`` and ``k (B, Hkv, N, D)`` per layer.
    """
    require_transformers()
    _register_capture_function()
    modules = attention_modules(model)
    if not modules:
        raise ValueError(
            f"model: found no attention modules in {type(model).__name__} (modules with a layer_idx, a config "
            "and a class name ending in 'Attention')"
        )
    wanted = None if layers is None else {int(i) for i in layers}
    available = sorted(int(m.layer_idx) for m in modules)
    if wanted is not None and not wanted <= set(available):
        raise ValueError(f"layers: {sorted(wanted - set(available))} not in the model's layers {available[0]}..{available[-1]}")
    recorded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    with _capturing(modules, recorded, wanted, store_dtype):
        with torch.no_grad():
            model(input_ids=input_ids, use_cache=False)
    expected = sorted(wanted) if wanted is not None else available
    missing = [i for i in expected if i not in recorded]
    if missing:
        raise RuntimeError(
            f"no q/k were recorded for layers {missing}: their attention does not dispatch through "
            "transformers' AttentionInterface, so it cannot be captured this way"
        )
    return QKCapture.from_tensors(
        [recorded[i][0] for i in expected],
        [recorded[i][1] for i in expected],
        layer_ids=expected,
        source=source or type(model).__name__,
    )


def capture_qk_from_pretrained(
    model_path: str | Path,
    *,
    prompt: str | None = None,
    input_ids: torch.Tensor | None = None,
    seq_len: int | None = None,
    layers: Sequence[int] | None = None,
    device: str = "cpu",
    torch_dtype: torch.dtype | None = None,
) -> QKCapture:
    """Loads a local causal LM (and its tokenizer, for ``prompt``) and captures its queries and keys.

    Args:
        model_path: a local model directory (``from_pretrained``; no download is attempted).
        prompt: text to tokenize; or give ``input_ids``.
        input_ids: ``(B, N)`` or ``(N,)`` token ids.
        seq_len: keep the first ``seq_len`` tokens (the prompt must have at least that many).
        layers: layer ids to keep (default all).
        device: where the model runs.
        torch_dtype: dtype to load the weights in (default the checkpoint's).
    """
    transformers = require_transformers()
    if (prompt is None) == (input_ids is None):
        raise ValueError("give exactly one of prompt and input_ids")
    path = Path(model_path)
    if not path.exists():
        raise FileNotFoundError(f"model_path: no such directory: {str(path)!r}")
    if input_ids is None:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        input_ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    ids = input_ids if input_ids.dim() == 2 else input_ids[None]
    if seq_len is not None:
        if ids.shape[1] < seq_len:
            raise ValueError(f"seq_len: the prompt has {ids.shape[1]} tokens, fewer than seq_len={seq_len}")
        ids = ids[:, :seq_len]
    kwargs: dict[str, Any] = {"local_files_only": True}
    if torch_dtype is not None:
        kwargs["dtype"] = torch_dtype
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), **kwargs).to(device).eval()
    return capture_qk(model, ids.to(device), layers=layers, source=f"{path.name} ({ids.shape[1]} tokens)")


@contextmanager
def _capturing(
    modules: list[torch.nn.Module],
    recorded: dict[int, tuple[torch.Tensor, torch.Tensor]],
    wanted: set[int] | None,
    store_dtype: torch.dtype,
):
    configs = {id(m.config): m.config for m in modules}
    saved = {key: cfg._attn_implementation for key, cfg in configs.items()}
    for m in modules:
        keep = wanted is None or int(m.layer_idx) in wanted
        _RECORDERS[id(m)] = (recorded if keep else None, store_dtype)
    _ORIGINAL_IMPLEMENTATIONS.update(saved)
    try:
        for cfg in configs.values():
            cfg._attn_implementation = CAPTURE_IMPLEMENTATION
        yield
    finally:
        for key, cfg in configs.items():
            cfg._attn_implementation = saved[key]
            _ORIGINAL_IMPLEMENTATIONS.pop(key, None)
        for m in modules:
            _RECORDERS.pop(id(m), None)


def _register_capture_function() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(CAPTURE_IMPLEMENTATION, _recording_attention)


def _recording_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    config_key = id(getattr(module, "config", None))
    if config_key not in _ORIGINAL_IMPLEMENTATIONS:
        raise RuntimeError(
            f"attention implementation {CAPTURE_IMPLEMENTATION!r} is only usable inside pbs.analysis.capture_qk"
        )
    original = _ORIGINAL_IMPLEMENTATIONS[config_key]
    # Modules that share the config but were not recognised as attention layers just pass through.
    recorded, store_dtype = _RECORDERS.get(id(module), (None, torch.float32))
    if recorded is not None:
        recorded[int(module.layer_idx)] = (query.detach().to("cpu", store_dtype), key.detach().to("cpu", store_dtype))
    return _original_function(module, original)(module, query, key, value, *args, **kwargs)


def _original_function(module: torch.nn.Module, implementation: str | None) -> Any:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    # "eager" is not in the interface: each model file defines its own eager_attention_forward.
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if implementation in (None, "eager") or implementation not in ALL_ATTENTION_FUNCTIONS:
        if eager is not None:
            return eager
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward
    return ALL_ATTENTION_FUNCTIONS[implementation]
