"""Input checks with errors that name the argument and the accepted values."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FLOAT_DTYPE_SET = frozenset(FLOAT_DTYPES)


def check_qkv(q: object, k: object, v: object, check_finite: bool = True) -> None:
    """Validates ``q (B, Hq, Nq, D)``, ``k (B, Hkv, Nk, D)``, ``v (B, Hkv, Nk, Dv)``.

    Raises:
        TypeError: a non-tensor or a non-floating dtype.
        ValueError: wrong rank, mismatched batch/heads/lengths/head dims/devices/dtypes, empty
            batch, heads or sequences, ``Nq > Nk``, meta tensors, inputs that require grad while
            grad mode is on (PBS is forward-only), or NaN/inf values (when ``check_finite``).
    """
    if not _passes_all_checks(q, k, v):
        _raise_first_problem(q, k, v)
    if check_finite:
        check_all_finite({"q": q, "k": k, "v": v})  # type: ignore[dict-item]


def _passes_all_checks(q: object, k: object, v: object) -> bool:
    """The checks of `check_qkv` as one predicate, in as few Python steps as possible.

    It runs before every call, also before the dense fallback at 2K tokens, where cuDNN itself
    needs ~35 us of host time and the step-by-step checks that name each problem took another
    ~8 us on an H100 host. A call that fails here goes on to `_raise_first_problem`, which says
    why; tests/test_validation.py checks that the two agree.
    """
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        return False
    dtype = q.dtype
    if dtype not in _FLOAT_DTYPE_SET or k.dtype is not dtype or v.dtype is not dtype:
        return False
    q_shape, k_shape, v_shape = q.shape, k.shape, v.shape
    if len(q_shape) != 4 or len(k_shape) != 4 or len(v_shape) != 4:
        return False
    b, hq, nq, d = q_shape
    kb, hkv, nk, kd = k_shape
    vb, v_heads, v_len, dv = v_shape
    if not (b > 0 and hq > 0 and hkv > 0 and nq > 0 and d > 0 and dv > 0 and kb == b and vb == b
            and v_heads == hkv and v_len == nk and kd == d and nq <= nk and hq % hkv == 0):
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    return q.device == k.device == v.device and not q.is_meta


def _raise_first_problem(q: object, k: object, v: object) -> None:
    """The checks of `check_qkv` one by one, raising an error that names the first one failed."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must have dtype float16, bfloat16 or float32, got {x.dtype}")
        if x.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dimensions {_layout_hint(name)}, got shape {tuple(x.shape)}"
            )
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise ValueError(
            "PBS attention is forward-only (prefill inference) and has no backward: q, k or v "
            "requires grad. Call it under torch.no_grad() or torch.inference_mode(), or detach the "
            "inputs; for training use dense attention"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got q: {q.device}, k: {k.device}, v: {v.device}")
    if q.is_meta or k.is_meta or v.is_meta:
        raise ValueError(
            "meta tensors are not supported: planning reads the values of q and k; "
            "use real tensors on 'cpu' or 'cuda'"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must share a dtype, got q: {q.dtype}, k: {k.dtype}, v: {v.dtype}")
    b, hq, nq, d = q.shape
    if b == 0:
        raise ValueError(f"the batch size must be positive, got q of shape {tuple(q.shape)}")
    if hq == 0:
        raise ValueError(f"q must have at least one head (q.shape[1] = Hq >= 1), got shape {tuple(q.shape)}")
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"batch sizes differ: q has {b}, k has {k.shape[0]}, v has {v.shape[0]}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"k and v must agree in (B, Hkv, Nk), got k: {tuple(k.shape[:3])}, v: {tuple(v.shape[:3])}"
        )
    if k.shape[-1] != d:
        raise ValueError(f"q and k must share the head dim D, got q: {d}, k: {k.shape[-1]}")
    if d == 0 or v.shape[-1] == 0:
        raise ValueError("head dims must be positive")
    hkv = k.shape[1]
    if hkv == 0 or hq % hkv:
        raise ValueError(
            f"the number of query heads (q.shape[1] = {hq}) must be a multiple of the number of "
            f"key/value heads (k.shape[1] = {hkv})"
        )
    nk = k.shape[2]
    if nq == 0 or nk == 0:
        raise ValueError(f"sequence lengths must be positive, got Nq = {nq}, Nk = {nk}")
    if nq > nk:
        raise ValueError(
            f"q has more positions (Nq = {nq}) than k (Nk = {nk}); queries are the last Nq of the Nk positions"
        )
    raise AssertionError("unreachable: _passes_all_checks refused inputs that every named check accepts")


def check_all_finite(tensors: dict[str, torch.Tensor]) -> None:
    """Raises ``ValueError`` naming the first tensor that holds NaN or inf.

    One min/max reduction per tensor (NaN propagates through both, inf shows in one of them), so
    nothing of the inputs' size is allocated, and a single host sync for all of them.
    """
    first = next(iter(tensors.values()))
    if first.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "check_finite=True reads a flag on the host, which a CUDA graph capture cannot do; "
            "pass a config with check_finite=False to capture pbs.attention in a graph"
        )
    extremes = torch.stack([torch.stack(torch.aminmax(x)).float() for x in tensors.values()])
    finite = torch.isfinite(extremes).all(-1).tolist()
    for name, ok in zip(tensors, finite):
        if not ok:
            raise ValueError(f"{name} contains NaN or inf values")


def _layout_hint(name: str) -> str:
    return "(B, Hq, Nq, D)" if name == "q" else "(B, Hkv, Nk, D)"
