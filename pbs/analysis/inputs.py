"""Queries and keys to analyse: the `QKCapture` and where it comes from.

A capture holds the post-RoPE queries and keys of one or more attention layers. It comes from

* the built-in synthetic workload (`synthetic_capture`, `pbs.testing.make_qkv`);
* a file (`load_capture`): a ``.pt`` dict with ``"q"`` and ``"k"`` (tensors, or per-layer
  lists of tensors, optionally ``"layers"`` naming the layer ids), or a ``.safetensors`` file with
  tensors ``"q"``/``"k"`` or ``"q.<layer>"``/``"k.<layer>"``;
* a transformers model (`pbs.analysis.capture_qk`, in `pbs.analysis.hf_capture`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pbs.testing import make_qkv

SUPPORTED_SUFFIXES = (".pt", ".pth", ".safetensors")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True, eq=False)
class QKCapture:
    """Queries and keys of one or more attention layers.

    Attributes:
        queries: one ``(B, Hq, Nq, D)`` tensor per layer.
        keys: one ``(B, Hkv, Nk, D)`` tensor per layer (``Hq % Hkv == 0``, ``Nq <= Nk``).
        layer_ids: the model's index of each layer (``0, 1, ...`` when unknown).
        source: where the tensors came from, for titles and metadata.
    """

    queries: tuple[torch.Tensor, ...]
    keys: tuple[torch.Tensor, ...]
    layer_ids: tuple[int, ...]
    source: str = "tensors"

    def __post_init__(self) -> None:
        if not self.queries:
            raise ValueError("a capture needs at least one layer, got none")
        if not (len(self.queries) == len(self.keys) == len(self.layer_ids)):
            raise ValueError(
                f"queries, keys and layer_ids must have one entry per layer, got "
                f"{len(self.queries)}, {len(self.keys)} and {len(self.layer_ids)}"
            )
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise ValueError(f"layer_ids must be distinct, got {list(self.layer_ids)}")
        for i, (q, k) in enumerate(zip(self.queries, self.keys)):
            _check_pair(q, k, f"q[{i}]" if len(self.queries) > 1 else "q", f"k[{i}]" if len(self.keys) > 1 else "k")

    @classmethod
    def from_tensors(
        cls,
        q: torch.Tensor | Sequence[torch.Tensor],
        k: torch.Tensor | Sequence[torch.Tensor],
        layer_ids: Sequence[int] | None = None,
        source: str = "tensors",
    ) -> "QKCapture":
        """Builds a capture from one layer's ``q (B, Hq, Nq, D)`` and ``k (B, Hkv, Nk, D)``, or from
        per-layer sequences of them. Rank-3 tensors ``(H, N, D)`` get a batch axis of 1."""
        queries = _as_layer_list(q, "q")
        keys = _as_layer_list(k, "k")
        ids = tuple(range(len(queries))) if layer_ids is None else tuple(int(i) for i in layer_ids)
        return cls(queries=queries, keys=keys, layer_ids=ids, source=source)

    @property
    def num_layers(self) -> int:
        return len(self.queries)

    @property
    def heads_q(self) -> int:
        return self.queries[0].shape[1]

    @property
    def batch(self) -> int:
        return self.queries[0].shape[0]

    def layer_index(self, layer_id: int) -> int:
        """Position in `queries` of the layer the model calls ``layer_id``."""
        try:
            return self.layer_ids.index(layer_id)
        except ValueError:
            raise ValueError(f"layer {layer_id} is not in this capture; it holds layers {list(self.layer_ids)}") from None

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Yields ``(layer_id, q, k)`` per layer."""
        return iter(zip(self.layer_ids, self.queries, self.keys))

    def describe(self) -> str:
        """One line: source, layers and shapes."""
        q, k = self.queries[0], self.keys[0]
        b, hq, nq, d = q.shape
        return (
            f"{self.source}: {self.num_layers} layer(s), B={b} Hq={hq} Hkv={k.shape[1]} "
            f"Nq={nq} Nk={k.shape[2]} D={d}"
        )


def as_capture(qk: "QKCapture | tuple[torch.Tensor, torch.Tensor]") -> QKCapture:
    """Accepts a `QKCapture` or a ``(q, k)`` pair of one layer."""
    if isinstance(qk, QKCapture):
        return qk
    if isinstance(qk, (tuple, list)) and len(qk) == 2:
        return QKCapture.from_tensors(qk[0], qk[1])
    raise TypeError(f"qk must be a QKCapture or a (q, k) pair of tensors, got {type(qk).__name__}")


def synthetic_capture(
    seq_len: int = 4096,
    heads_q: int = 8,
    heads_kv: int = 4,
    head_dim: int = 64,
    *,
    batch: int = 1,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> QKCapture:
    """One layer of `pbs.testing.make_qkv`, the built-in structured workload.

    The default of 4 KV heads shows all four of its head kinds (heavy hitters, local window,
    slash lines, a mix).
    """
    q, k, _ = make_qkv(batch, heads_q, heads_kv, seq_len, head_dim, seed=seed, device=device)
    source = f"synthetic make_qkv(seq_len={seq_len}, heads_q={heads_q}, heads_kv={heads_kv}, head_dim={head_dim}, seed={seed})"
    return QKCapture.from_tensors(q, k, source=source)


def load_capture(path: str | Path) -> QKCapture:
    """Reads queries and keys from a ``.pt``/``.pth`` or ``.safetensors`` file.

    Args:
        path: ``.pt`` holding a dict with ``"q"`` and ``"k"`` (each a tensor ``(B, H, N, D)`` or
            ``(H, N, D)``, or a list of them per layer) and optionally ``"layers"`` (layer ids);
            or ``.safetensors`` with tensors ``"q"``/``"k"`` or ``"q.<layer>"``/``"k.<layer>"``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: an unknown suffix, missing keys, or tensors of the wrong rank or shape.
        ImportError: a ``.safetensors`` file without the ``safetensors`` package.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"path: no such file: {str(path)!r}")
    suffix = path.suffix.lower()
    if suffix in (".pt", ".pth"):
        return _load_torch(path)
    if suffix == ".safetensors":
        return _load_safetensors(path)
    raise ValueError(f"path: unsupported file type {suffix or '(none)'!r} for {str(path)!r}; expected one of {list(SUPPORTED_SUFFIXES)}")


def save_capture(capture: QKCapture, path: str | Path) -> Path:
    """Writes a capture so that `load_capture` reads it back (``.pt`` or ``.safetensors``)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in (".pt", ".pth"):
        single = capture.num_layers == 1
        payload: dict[str, Any] = {
            "q": capture.queries[0] if single else list(capture.queries),
            "k": capture.keys[0] if single else list(capture.keys),
            "layers": list(capture.layer_ids),
        }
        torch.save(payload, path)
        return path
    if suffix == ".safetensors":
        save_file = _require_safetensors().save_file
        tensors = {}
        for layer_id, q, k in capture:
            tensors[f"q.{layer_id}"] = q.detach().cpu().contiguous()
            tensors[f"k.{layer_id}"] = k.detach().cpu().contiguous()
        save_file(tensors, str(path), metadata={"source": capture.source})
        return path
    raise ValueError(f"path: unsupported file type {suffix or '(none)'!r}; expected one of {list(SUPPORTED_SUFFIXES)}")


def _load_torch(path: Path) -> QKCapture:
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(f"path: could not read {str(path)!r} as a torch file: {exc}") from exc
    if not isinstance(data, Mapping):
        raise ValueError(
            f"path: {str(path)!r} must hold a dict with keys 'q' and 'k', got a {type(data).__name__}"
        )
    missing = [key for key in ("q", "k") if key not in data]
    if missing:
        raise ValueError(
            f"path: {str(path)!r} must hold a dict with keys 'q' and 'k' (tensors or per-layer lists of "
            f"tensors); missing {missing}, found keys {sorted(map(str, data))}"
        )
    queries = _as_layer_list(data["q"], "q")
    keys = _as_layer_list(data["k"], "k")
    layers = data.get("layers")
    if layers is not None and (not isinstance(layers, Sequence) or len(layers) != len(queries)):
        raise ValueError(f"path: 'layers' must list one layer id per layer ({len(queries)}), got {layers!r}")
    return QKCapture.from_tensors(queries, keys, layer_ids=layers, source=str(path))


def _load_safetensors(path: Path) -> QKCapture:
    load_file = _require_safetensors().load_file
    try:
        tensors = load_file(str(path))
    except Exception as exc:
        raise ValueError(f"path: could not read {str(path)!r} as a safetensors file: {exc}") from exc
    if "q" in tensors and "k" in tensors:
        return QKCapture.from_tensors(tensors["q"], tensors["k"], source=str(path))
    layer_ids = sorted(int(name[2:]) for name in tensors if name.startswith("q.") and name[2:].isdigit())
    missing_keys = [f"k.{i}" for i in layer_ids if f"k.{i}" not in tensors]
    if not layer_ids or missing_keys:
        raise ValueError(
            f"path: {str(path)!r} must hold tensors 'q' and 'k', or 'q.<layer>' and 'k.<layer>' for each "
            f"layer; found {sorted(tensors)}"
        )
    return QKCapture.from_tensors(
        [tensors[f"q.{i}"] for i in layer_ids], [tensors[f"k.{i}"] for i in layer_ids], layer_ids=layer_ids, source=str(path)
    )


def _require_safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError as exc:
        raise ImportError(
            'reading or writing .safetensors files needs the safetensors package: pip install "pbs-attn[analysis]"'
        ) from exc
    return safetensors.torch


def _as_layer_list(value: Any, name: str) -> tuple[torch.Tensor, ...]:
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not items:
        raise ValueError(f"{name} must be a tensor or a non-empty list of tensors, got an empty list")
    out = []
    for i, x in enumerate(items):
        label = f"{name}[{i}]" if isinstance(value, (list, tuple)) else name
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{label} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() == 3:
            x = x.unsqueeze(0)
        if x.dim() != 4:
            raise ValueError(
                f"{label} must have rank 4 {'(B, Hq, Nq, D)' if name == 'q' else '(B, Hkv, Nk, D)'} or rank 3 "
                f"(H, N, D), got shape {tuple(x.shape)}"
            )
        out.append(x)
    return tuple(out)


def _check_pair(q: torch.Tensor, k: torch.Tensor, q_name: str, k_name: str) -> None:
    for name, x in ((q_name, q), (k_name, k)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must have rank 4 (B, H, N, D), got shape {tuple(x.shape)}")
        if x.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must have a floating dtype, got {x.dtype}")
        if 0 in x.shape:
            raise ValueError(f"{name} must not be empty, got shape {tuple(x.shape)}")
    b, hq, nq, d = q.shape
    if k.shape[0] != b:
        raise ValueError(f"{q_name} and {k_name} must share the batch size, got {b} and {k.shape[0]}")
    if k.shape[-1] != d:
        raise ValueError(f"{q_name} and {k_name} must share the head dim, got {d} and {k.shape[-1]}")
    if hq % k.shape[1]:
        raise ValueError(f"{q_name}'s heads ({hq}) must be a multiple of {k_name}'s heads ({k.shape[1]})")
    if nq > k.shape[2]:
        raise ValueError(f"{q_name} has more positions ({nq}) than {k_name} ({k.shape[2]}); queries are the last Nq of the Nk positions")
    if q.device != k.device:
        raise ValueError(f"{q_name} and {k_name} must be on one device, got {q.device} and {k.device}")
