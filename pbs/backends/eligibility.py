"""Which kernel can run a call: one reasons function per kernel, used by every caller.

Each function returns why its kernel cannot run calls of a `CallSpec` (an empty list: it can).
Planning asks them once per call through `pbs.backends.resolve_backend`; the dense policy asks
`dense_kernel_reasons`, `gated_dense_reasons` and `probe_kernel_reasons`. They are cached per
spec (they run in every layer of every call), and whether Triton and Gluon import is asked once,
here only.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util

import torch

from pbs.backends.registry import AttentionBackend, CallSpec, family_has_planners
from pbs.kernels._common import interpreting
from pbs.types import PRECISION_FORMATS

MAX_HEAD_DIM = 256
"""The largest head dim the Triton kernels take."""


@functools.lru_cache(maxsize=None)
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=None)
def _gluon_kernel_module():
    """`pbs.kernels.hopper_attn`, or the reason it cannot be imported (a Triton without Gluon, or
    with another Gluon API)."""
    if not _triton_installed():
        return "triton is not installed"
    try:
        return importlib.import_module("pbs.kernels.hopper_attn")
    except ImportError as exc:
        return f"this Triton has no usable Gluon ({exc})"


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _head_dim_reasons(spec: CallSpec) -> list[str]:
    reasons = []
    # TMA needs rows of a multiple of 16 bytes.
    multiple = 16 // spec.dtype.itemsize
    for name, dim in (("head dim", spec.head_dim), ("value head dim", spec.head_dim_v)):
        if dim > MAX_HEAD_DIM:
            reasons.append(f"{name} {dim} is larger than {MAX_HEAD_DIM}")
        elif dim % multiple:
            reasons.append(f"{name} {dim} is not a multiple of {multiple} (16 bytes of {spec.dtype})")
    return reasons


def contiguous_only_reasons(spec: CallSpec, kernel: str) -> list[str]:
    """The reason a kernel that reads contiguous K/V only gives for a paged call (none for others)."""
    if spec.page_size is None:
        return []
    return [f"{kernel} reads contiguous keys and values, not pages of a paged cache (block_table, "
            f"page_size {spec.page_size}); the triton, hopper and reference backends read pages"]


def triton_kernel_reasons(spec: CallSpec) -> list[str]:
    """Why the Triton kernel (`pbs.kernels.block_sparse_attn`) cannot run ``spec``: it runs on
    CUDA GPUs of compute capability 8.0 or newer, and on CPU tensors in Triton's interpreter
    (``TRITON_INTERPRET=1``), where bfloat16 dot products are wrong. It reads paged caches of any
    power-of-two page size in place."""
    return list(_triton_kernel_reasons(spec, interpreting()))


@functools.lru_cache(maxsize=256)
def _triton_kernel_reasons(spec: CallSpec, interpret: bool) -> tuple[str, ...]:
    reasons = []
    if not _triton_installed():
        reasons.append("triton is not installed")
    if spec.device.type != "cuda":
        if not interpret:
            reasons.append(f"inputs are on {spec.device.type}, not CUDA (set TRITON_INTERPRET=1 to run the kernel "
                           "in the interpreter)")
        elif spec.dtype == torch.bfloat16:
            reasons.append("the Triton interpreter computes bfloat16 dot products wrongly; use float16 or float32")
    elif _capability(spec.device) < (8, 0):
        reasons.append("the Triton kernel needs a GPU of compute capability 8.0 or newer")
    if spec.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        reasons.append(f"dtype {spec.dtype} is not float16, bfloat16 or float32")
    if spec.page_size is not None and spec.page_size & (spec.page_size - 1):
        reasons.append(f"page_size {spec.page_size} is not a power of two")
    return tuple(reasons + _fp8_reasons(spec) + _head_dim_reasons(spec))


def _fp8_reasons(spec: CallSpec) -> list[str]:
    """Why a quantizing kernel (Triton's or the Gluon kernel's) cannot run
    ``spec.precision`` (none for ``"native"``)."""
    if spec.precision == "native":
        return []
    reasons = []
    qk_format, pv_fp8 = PRECISION_FORMATS.get(spec.precision, (None, False))
    uses_e4m3 = qk_format == "e4m3" or pv_fp8
    if uses_e4m3 and spec.device.type == "cuda" and _capability(spec.device) < (8, 9):
        reasons.append(f"precision {spec.precision!r} needs e4m3 tensor cores (compute capability 8.9 or newer)")
    if spec.dtype not in (torch.float16, torch.bfloat16):
        reasons.append(f"precision {spec.precision!r} quantizes float16 or bfloat16 inputs, not {spec.dtype}")
    if spec.page_size is not None:
        reasons.append(f"precision {spec.precision!r} reads contiguous keys and values (K's mean over the tokens, "
                       f"V's per-channel scales), not a paged cache (page_size {spec.page_size})")
    if spec.capturable:
        reasons.append(f"precision {spec.precision!r} is not built for the capturable path (capturable=True)")
    return reasons


def triton_auto_reasons(spec: CallSpec) -> list[str]:
    """Why ``auto`` passes over the Triton kernel although it could run ``spec``: the interpreter
    is right but slow, so only a named ``backend="triton"`` runs it."""
    if spec.device.type != "cuda":
        return ["auto uses the Triton kernel on CUDA only (name backend='triton' to run the interpreter)"]
    return []


def reference_auto_reasons(spec: CallSpec) -> list[str]:
    """Why ``auto`` passes over the reference on a GPU although it could run ``spec``: it is the
    fallback of native eager calls only. A quantized or capturable call that no kernel takes
    raises with every kernel's reason instead of running the oracle (dense ``(N, Hq, T, T)``
    masks, and FP8 fake-quantized in float32) where a kernel's speed was asked for."""
    if spec.device.type != "cuda":
        return []
    reasons = []
    if spec.precision != "native":
        reasons.append(f"auto does not run precision {spec.precision!r} on the reference on a GPU")
    if spec.capturable:
        reasons.append("auto does not capture the reference in a CUDA graph")
    if reasons:
        reasons.append("name backend='reference' to run it")
    return reasons


def gluon_kernel_reasons(spec: CallSpec) -> list[str]:
    """Why the warp-specialized Gluon kernel (`pbs.kernels.hopper_attn`) cannot run ``spec``: it
    runs on Hopper GPUs, fp16/bf16, head dims 64 or 128 (the same for values), mask block 128, and
    reads paged caches whose page size is a multiple of 128 or a power of two from 16 to 64."""
    return list(_gluon_kernel_reasons(spec))


@functools.lru_cache(maxsize=256)
def _gluon_kernel_reasons(spec: CallSpec) -> tuple[str, ...]:
    reasons = []
    if spec.device.type != "cuda":
        reasons.append(f"inputs are on {spec.device.type}, not CUDA (the Gluon kernel has no interpreter)")
    kernel = _gluon_kernel_module()
    if isinstance(kernel, str):
        return (*reasons, kernel)
    if spec.device.type == "cuda" and _capability(spec.device)[0] != kernel.COMPUTE_CAPABILITY_MAJOR:
        reasons.append(f"needs a Hopper GPU (compute capability {kernel.COMPUTE_CAPABILITY_MAJOR}.x)")
    if spec.dtype not in kernel.SUPPORTED_DTYPES:
        reasons.append(f"dtype {spec.dtype} is not float16 or bfloat16")
    dims = kernel.SUPPORTED_HEAD_DIMS
    if spec.head_dim not in dims or spec.head_dim_v != spec.head_dim:
        reasons.append(f"head dims ({spec.head_dim}, {spec.head_dim_v}) are not both one of {dims}")
    if spec.block_size != kernel.BLOCK_SIZE:
        reasons.append(f"mask block {spec.block_size} is not {kernel.BLOCK_SIZE}")
    if spec.page_size is not None and not kernel.gluon_page_size_ok(spec.page_size):
        reasons.append(f"page_size {spec.page_size} of the paged cache is neither a multiple of {kernel.BLOCK_SIZE} "
                       f"nor a power of two from {kernel.MIN_PAGE_SIZE} to {kernel.BLOCK_SIZE // 2} (the Gluon kernel "
                       "loads a key block from one page or from whole pages; the triton backend reads any page size)")
    if spec.precision in kernel.QUANTIZED_PRECISIONS:
        reasons += _fp8_reasons(spec)
    return tuple(reasons)


def flex_reasons(spec: CallSpec) -> list[str]:
    """Why the FlexAttention lowering (`pbs.kernels.flex`) cannot run ``spec``."""
    reasons = contiguous_only_reasons(spec, "the FlexAttention lowering")
    if spec.device.type != "cuda":
        reasons.append(f"inputs are on {spec.device.type}, not CUDA (FlexAttention runs compiled on CUDA only)")
    if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
        reasons.append(f"torch {torch.__version__} has no torch.nn.attention.flex_attention")
    if spec.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        reasons.append(f"dtype {spec.dtype} is not float16, bfloat16 or float32")
    return reasons


def probe_kernel_reasons(device: torch.device, head_dim: int) -> list[str]:
    """Why the density probe's Triton kernel (`pbs.kernels.density_probe`) cannot run on CUDA
    ``device`` (then its eager twin runs)."""
    return list(_probe_kernel_reasons(device, head_dim))


@functools.lru_cache(maxsize=256)
def _probe_kernel_reasons(device: torch.device, head_dim: int) -> tuple[str, ...]:
    if device.type != "cuda":
        return (f"inputs are on {device.type}, not CUDA",)
    if not _triton_installed():
        return ("triton is not installed",)
    reasons = []
    if _capability(device) < (8, 0):
        reasons.append("compute capability below 8.0")
    if head_dim > MAX_HEAD_DIM:
        reasons.append(f"head dim above {MAX_HEAD_DIM}")
    return tuple(reasons)


def _gluon_unusable() -> str | None:
    """Why no Gluon kernel can run in this process at all, or None."""
    if interpreting():
        return "the Triton interpreter cannot run Gluon"
    kernel = _gluon_kernel_module()
    return kernel if isinstance(kernel, str) else None


def dense_kernel_reasons(spec: CallSpec) -> list[str]:
    """Why the Gluon kernel cannot run ``spec`` in dense mode, every visible key without a plan
    (`pbs.dense.dense_attention`); its ``block_size`` is not read: dense mode walks the kernel's
    own blocks."""
    unusable = _gluon_unusable()
    if unusable is not None:
        return [unusable]
    kernel = _gluon_kernel_module()
    dense_spec = CallSpec(spec.device, spec.dtype, spec.head_dim, spec.head_dim_v, kernel.BLOCK_SIZE)
    return gluon_kernel_reasons(dense_spec) + contiguous_only_reasons(spec, "the dense-mode kernel")


def gated_dense_reasons(spec: CallSpec) -> list[str]:
    """Why the dense policy cannot queue the Gluon kernel in dense mode behind the density probe,
    gated on the probe's counters (`pbs.dense.DensePolicy`), for ``spec``."""
    if _gluon_unusable() is not None:
        return dense_kernel_reasons(spec)
    return dense_kernel_reasons(spec) + probe_kernel_reasons(spec.device, spec.head_dim)


def triton_installed() -> bool:
    """Whether Triton can be imported (asked once; a GPU launcher that needs it asks here)."""
    return _triton_installed()


def planning_family(backend: AttentionBackend, device: torch.device) -> str:
    """The planner family for ``backend`` on ``device``: ``"reference"`` off CUDA or without
    Triton, else the backend's ``plans_with``. A family that no planner is registered for is an
    error (a misspelt ``plans_with`` would otherwise never run)."""
    if device.type != "cuda" or not _triton_installed():
        return "reference"
    family = backend.plans_with
    if family != "reference" and not family_has_planners(family):
        raise ValueError(f"backend {backend.name!r} plans with {family!r}, but no planner is registered for it")
    return family
