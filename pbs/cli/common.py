"""What the ``pbs`` subcommands share: dtype names and the argparse value checks."""

from __future__ import annotations

import argparse

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def unit_interval(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def default_device() -> str:
    """``"cuda"`` when torch sees a CUDA device, else ``"cpu"``: the default of every ``--device``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(text: str) -> str:
    """``--device`` value check (an argparse ``type``): a device torch can name and this machine has.

    Returns the device as torch writes it (``"cpu"``, ``"cuda"``, ``"cuda:1"``). Raises
    ``argparse.ArgumentTypeError`` with one line that says what is wrong and what to use instead:
    an unknown name (``gpu``), CUDA on a torch built without it or on a machine without a GPU, a
    CUDA index past the last device, or a device type that is not available here.
    """
    try:
        device = torch.device(text.strip())
    except (RuntimeError, ValueError):
        hint = " (for the GPU, use cuda)" if text.strip().lower() in ("gpu", "nvidia", "cuda0") else ""
        raise argparse.ArgumentTypeError(f"unknown device {text!r}{hint}; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            raise argparse.ArgumentTypeError(
                f"{text!r}: this torch ({torch.__version__}) is a CPU-only build; install a CUDA build of "
                "torch to run on the GPU, or use --device cpu"
            )
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise argparse.ArgumentTypeError(f"{text!r}: torch sees no CUDA device on this machine; use --device cpu")
        if device.index is not None and device.index >= count:
            raise argparse.ArgumentTypeError(
                f"{text!r}: there is no CUDA device {device.index}; this machine has {count} (cuda:0 to cuda:{count - 1})"
            )
    elif device.type != "cpu":
        backend = getattr(torch, device.type, None)
        available = getattr(backend, "is_available", None)
        if not (callable(available) and available()):
            raise argparse.ArgumentTypeError(f"device {text!r} is not available here; use cpu or cuda")
    return str(device)


def config_error_message(exc: BaseException) -> str:
    """One line for an invalid config: pydantic's errors as ``field: message; ...``, without its
    ``[type=...]`` details and documentation URL; other exceptions as their text."""
    from pydantic import ValidationError

    if not isinstance(exc, ValidationError):
        return str(exc)
    parts = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {message}" if where and str(error["loc"][-1]) not in message else message)
    return "; ".join(parts)
