"""Launching a compiled Triton kernel again without Triton's per-call argument binding.

``fn[grid](*args)`` binds and specializes every argument in Python before it launches: about
30 us of host time per launch in a loop on the H100 machines, and about 200 us right after a host
sync, when the host runs 5-10x slower. For a kernel that sits between a call and a host read (the
density probe, which every flat long call runs before dense attention) that host time is most of
what the call adds to cuDNN's latency.

`Relauncher` launches through Triton once per specialization and keeps the `CompiledKernel` that
Triton returns; later calls with the same specialization go straight to that kernel's own launcher
(``compiled[grid](*args)``, the call Triton itself makes after binding). The key holds everything
Triton specializes on: argument dtypes, 16-byte alignment of pointers, ints divisible by 16 or
equal to 1, the integer width, the constexprs, the launch options and the device. Under
``TRITON_INTERPRET=1`` and wherever the compiled kernel has no launcher of its own, every call goes
through Triton.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from pbs.kernels._common import interpreting

_INT32_RANGE = (-(2**31), 2**31)


def _argument_key(value: Any) -> tuple:
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, value.data_ptr() % 16 == 0)
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int):
        return ("int", _INT32_RANGE[0] <= value < _INT32_RANGE[1], value % 16 == 0, value == 1)
    if isinstance(value, float):
        return ("float",)
    if value is None:
        return ("none",)
    raise TypeError(f"Relauncher: no specialization rule for an argument of type {type(value).__name__}")


def specialization_key(args: tuple, constexprs: dict[str, Any], options: dict[str, Any], device: int) -> tuple:
    """What decides which compiled kernel Triton would launch for these arguments."""
    return (device, tuple(_argument_key(a) for a in args), tuple(constexprs.items()), tuple(options.items()))


class Relauncher:
    """Calls ``fn[grid](*args, **constexprs, **options)``, through Triton's binder only on the first
    call of each specialization.

    Args:
        fn: a ``@triton.jit`` function whose runtime arguments come first, positionally, and whose
            constexprs are passed by name (they follow the runtime arguments in its signature).
        max_entries: compiled kernels kept; beyond it, calls go through Triton.
    """

    def __init__(self, fn: Any, max_entries: int = 64) -> None:
        self.fn = fn
        self.max_entries = max_entries
        self._compiled: dict[tuple, Any] = {}
        self._lock = threading.Lock()
        self.direct_launches = 0  # read by tests: how many calls skipped Triton's binder

    def __call__(self, grid: tuple[int, ...], *args: Any, options: dict[str, Any] | None = None, **constexprs: Any) -> None:
        options = options or {}
        if interpreting():
            self.fn[grid](*args, **constexprs, **options)
            return
        # Triton loads a compiled kernel on the current device, and launches it there.
        key = specialization_key(args, constexprs, options, torch.cuda.current_device())
        compiled = self._compiled.get(key)
        if compiled is not None:
            # The launcher takes a 3-D grid and the arguments in signature order, constexprs
            # included (it skips them).
            compiled[(*grid, 1, 1)[:3]](*args, *constexprs.values())
            self.direct_launches += 1
            return
        compiled = self.fn[grid](*args, **constexprs, **options)
        if callable(getattr(compiled, "__getitem__", None)) and self._in_signature_order(len(args), constexprs):
            with self._lock:
                if len(self._compiled) < self.max_entries:
                    self._compiled[key] = compiled

    def _in_signature_order(self, num_args: int, constexprs: dict[str, Any]) -> bool:
        names = list(getattr(self.fn, "arg_names", []))
        return len(names) == num_args + len(constexprs) and names[num_args:] == list(constexprs)
