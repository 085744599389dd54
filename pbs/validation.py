"""Input checks with errors that name the argument and the accepted values."""

from __future__ import annotations

import dataclasses
import numbers

import torch

from pbs.layout import Layout
from pbs.types import BlockMask

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FLOAT_DTYPE_SET = frozenset(FLOAT_DTYPES)


def check_qkv(q: object, k: object, v: object, check_finite: bool = True) -> None:
    """Validates ``q (B, Hq, Nq, D)``, ``k (B, Hkv, Nk, D)``, ``v (B, Hkv, Nk, Dv)``.

    Raises:
        TypeError: a non-tensor, a sparse or nested tensor (not strided), or a non-floating dtype.
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

    It runs before every call, also before the dense fallback on short prompts, where host time
    is much of the call, so the step-by-step checks that name each problem run only for a call
    that fails here (`_raise_first_problem`, which says why); tests/test_validation.py checks
    that the two agree.
    """
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        return False
    strided = torch.strided
    if not (q.layout is strided and k.layout is strided and v.layout is strided) or (
        q.is_nested or k.is_nested or v.is_nested
    ):
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
        if x.is_nested:
            raise TypeError(
                f"{name} must be a strided (dense) tensor, got a nested tensor; PBS attention takes "
                f"(B, H, N, D) strided tensors. Sequences of different lengths go to pbs.varlen_attention "
                f"packed (a jagged nested tensor x of (N_i, H, D) sequences: x.values(), with cu_seq = "
                f"x.offsets().int()), or padded on the right with torch.nested.to_padded_tensor"
            )
        if x.layout is not torch.strided:
            raise TypeError(
                f"{name} must be a strided (dense) tensor, got layout {x.layout}; PBS attention takes "
                f"strided (dense) tensors only (convert with {name}.to_dense())"
            )
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
    check_attention_shapes(q, k, v)
    raise AssertionError("unreachable: _passes_all_checks refused inputs that every named check accepts")


def check_attention_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raises ``ValueError`` naming the first shape rule that 4-D ``q``, ``k``, ``v`` break.

    The rules of `check_qkv` that concern sizes only (any dtype and device), shared with
    `pbs.reference.dense_attention`: positive sizes, one batch, ``k`` and ``v`` agreeing in
    ``(B, Hkv, Nk)``, one head dim for ``q`` and ``k``, ``Hq % Hkv == 0`` and ``Nq <= Nk``.
    """
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
            f"q has more positions (Nq = {nq}) than k (Nk = {nk}); queries are the last Nq of the "
            "Nk positions, so Nq must be <= Nk"
        )


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


# scale * q.k is formed in fp32: 1e4 is far above any softmax scale in use (D**-0.5 <= 0.25, 1 to
# ~30 with QK-norm) yet keeps it finite for every fp16 product (|q.k| <= 65504**2 * D); 1e300 zeroed every row.
MAX_SCALE = 1e4


def check_scale(scale: object, head_dim: int) -> float:
    """The softmax scale to use: ``head_dim ** -0.5`` for None, else ``scale`` as a float.

    Raises:
        ValueError: a bool or a non-number, NaN, inf, ``scale <= 0`` or ``scale > MAX_SCALE``.
    """
    if scale is None:
        return head_dim**-0.5
    # bool is a numbers.Real; `0 < scale <= MAX_SCALE` is False for NaN as well.
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not 0 < scale <= MAX_SCALE:
        raise ValueError(
            f"scale must be a positive finite number in (0, {MAX_SCALE:g}] or None (the default "
            f"head_dim ** -0.5 = {head_dim**-0.5:.4g}), got {scale!r}"
        )
    return float(scale)


def check_selector_result(result: object, layout: Layout, device: torch.device, name: str) -> None:
    """Checks what a selector's ``select`` returned before planning uses it.

    ``result`` must be a ``(B, Hq, Tq, Tk)`` bool tensor or a `BlockMask` built for ``layout``
    (equal in every field), on ``device``, with int32 ``counts`` in ``0..Tk``, int16/int32
    ``indices`` that list each query block's key blocks in ascending order, in ``0..Tk-1``, then
    ``-1``, and ``0 <= full_counts <= counts`` where given. Shapes, dtypes, devices and the layout
    are read on the host; the values are checked by one device-side assert on CUDA (no host
    sync: a bad mask stops the process with a CUDA assertion naming the rule) and raise
    ``ValueError`` elsewhere.

    Args:
        result: what ``select`` returned.
        layout: the geometry of the call.
        device: the device of the queries.
        name: the selector's name, for the messages.

    Raises:
        TypeError: ``result`` is neither a tensor nor a `BlockMask`.
        ValueError: any other rule broken (off CUDA, also a bad value).
    """
    device = torch.device(device)
    expected = (layout.batch, layout.heads_q, layout.num_query_blocks, layout.num_key_blocks)
    if isinstance(result, torch.Tensor):
        if result.dtype != torch.bool or tuple(result.shape) != expected:
            raise ValueError(
                f"selector {name!r}: a selector must return a bool tensor of shape (B, Hq, Tq, Tk) = "
                f"{expected}, got {result.dtype} {tuple(result.shape)}"
            )
        _check_on_device(result, device, f"selector {name!r} returned its mask")
        return
    if not isinstance(result, BlockMask):
        raise TypeError(
            f"selector {name!r} returned {type(result).__name__}; select() must return a "
            "(B, Hq, Tq, Tk) bool tensor or a pbs.BlockMask"
        )
    what = f"selector {name!r} returned a BlockMask"
    if result.layout != layout:
        if not isinstance(result.layout, Layout):
            raise ValueError(f"{what} whose layout is a {type(result.layout).__name__}, not a pbs.layout.Layout")
        differ = ", ".join(
            f"{f.name}={getattr(result.layout, f.name)!r} (expected {getattr(layout, f.name)!r})"
            for f in dataclasses.fields(Layout)
            if getattr(result.layout, f.name) != getattr(layout, f.name)
        )
        raise ValueError(f"{what} built for another layout: {differ}; build it with inputs.layout")
    tk = layout.num_key_blocks
    full = result.__dict__.get("_full_counts")  # None: derived later from the lists, nothing to check
    parts = {"counts": (result.counts, expected[:3], (torch.int32,)),
             "indices": (result.indices, expected, (torch.int16, torch.int32) if tk < 2**15 else (torch.int32,))}
    if full is not None:
        parts["full_counts"] = (full, expected[:3], (torch.int32,))
    for part, (x, shape, dtypes) in parts.items():
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{what} whose {part} is a {type(x).__name__}, not a torch.Tensor")
        if tuple(x.shape) != shape or x.dtype not in dtypes:
            accepted = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise ValueError(
                f"{what} whose {part} is {x.dtype} {tuple(x.shape)}; expected {accepted} of shape {shape}"
            )
        _check_on_device(x, device, f"{what} whose {part} lies")
    counts, indices = result.counts, result.indices  # int16 indices compare with tk < 2**15 as they are
    listed = torch.arange(tk, device=device, dtype=torch.int32) < counts[..., None]
    # Inside each list: 0..Tk-1 and ascending; past it: -1 (one rule per slot, then one reduction).
    rising = torch.cat([indices[..., :1] >= 0, indices[..., 1:] > indices[..., :-1]], dim=-1)
    ok = torch.where(listed, rising & (indices < tk), indices == -1).all()
    ok &= ((counts >= 0) & (counts <= tk)).all()
    if full is not None:
        ok &= ((full >= 0) & (full <= counts)).all()
    message = (
        f"{what} with invalid values: counts must lie in 0..{tk} (Tk), each list "
        f"indices[b, h, i, :counts[b, h, i]] must hold key blocks in 0..{tk - 1} in ascending order "
        "followed by -1, and 0 <= full_counts <= counts"
    )
    if device.type == "cuda":
        torch._assert_async(ok, message)
    elif not bool(ok):
        raise ValueError(message)


def _check_on_device(x: torch.Tensor, device: torch.device, what: str) -> None:
    if x.device.type != device.type or (device.index is not None and x.device.index != device.index):
        raise ValueError(f"{what} on {x.device}; it must be on {device}, the device of q")


def _layout_hint(name: str) -> str:
    return "(B, Hq, Nq, D)" if name == "q" else "(B, Hkv, Nk, D)"
