"""An address check for Triton kernels run in the interpreter (``TRITON_INTERPRET=1``).

On the GPU a load or store whose address lies outside every allocation faults ("CUDA error: an
illegal memory access"), asynchronously, at whatever call synchronizes next, and poisons the
CUDA context for every later test. In the interpreter the same access reads or writes whatever
host memory is there, silently. `checked_addresses` makes the interpreter strict: while it is
active, every launch records the storages of the tensors passed to it (``[data_ptr, data_ptr +
nbytes)`` of each argument's ``untyped_storage()``, tensor descriptors' bases included), and
every element that a load, store or atomic really touches, that is every lane whose mask is true
(every lane of an unmasked ``tl.load``), must lie wholly inside one of them. Otherwise the launch
fails with `OutOfBoundsAccess`, which names the kernel, the program, the operation and the first
offending address as an element offset from the nearest argument.

Masked-off lanes are not checked: on the GPU they form addresses but never touch memory. Two
kinds of access are checked through what the interpreter runs in their place:

* inline-PTX loads (``tl.inline_asm_elementwise("ld.global.nc ...")``), which read every lane,
  mask or not: the interpreter cannot run them, so the kernels take a plain unmasked ``tl.load``
  of the same addresses under ``INTERPRET`` (`pbs.kernels.block_sparse_attn._load_block_index`),
  and every lane is checked;
* tensor-descriptor loads and stores (TMA): the interpreter masks the elements outside the
  descriptor's shape (TMA fills them with zeros), and the elements inside must lie in a tensor,
  so a descriptor whose shape runs past its tensor's storage is caught on its first load.

The GPU compiler also adds accesses of its own that the interpreter never makes: a
software-pipelined loop (``num_stages > 1``) runs the address part of its next iterations ahead,
``num_stages - 1`` steps past its last iteration (and from its first one when it runs none). Its
loads and TMA copies are predicated off there, but an inline-PTX load declared pure is not: it
reads whatever address the out-of-range loop counter makes. `pipelined_loops` replays that in the
interpreter: the ``range`` loops of a module's kernels run ``stages - 1`` speculative iterations
after their real ones, in which masked and descriptor loads return their fill value without
touching memory and stores are dropped (predicated, as on the GPU) while plain unmasked loads
(the inline-PTX stand-ins) still read, under `checked_addresses`. The speculative iterations
update the loop's values, so a kernel's output under `pipelined_loops` is meaningless: use it to
check addresses only.

Usage, as a context manager or through the fixture of the same name in ``tests/conftest.py``::

    with checked_addresses():
        pbs.varlen_attention(...)  # raises if a kernel leaves its tensors

    with checked_addresses(), pipelined_loops(pbs.kernels.block_sparse_attn, stages=3):
        block_sparse_attention(...)  # also the reads the GPU's pipelined loops make ahead

The check costs a binary search per load (no measurable time in the kernel tests, which run
under it: ``pytestmark = pytest.mark.usefixtures("checked_addresses")``). Outside the
interpreter (a GPU run) it does nothing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


class OutOfBoundsAccess(AssertionError):
    """A kernel touched an address outside the storages of its launch's tensors."""


@dataclass(frozen=True)
class _Region:
    name: str
    start: int  # first byte of the storage
    end: int  # one past its last byte
    view_start: int  # the argument's own first element (data_ptr), for offsets in messages
    itemsize: int


class _State(threading.local):
    speculating: int = 0  # > 0 inside a speculative iteration of `pipelined_loops`
    plain_load: bool = False  # the load being made is an unmasked tl.load (an inline-PTX stand-in)
    kernel: str | None = None
    regions: list[_Region] | None = None
    starts: np.ndarray | None = None
    ends: np.ndarray | None = None


_state = _State()


def _regions_of(name: str, arg: object, out: list[_Region]) -> None:
    import torch
    from triton.runtime.jit import TensorWrapper
    from triton.tools.tensor_descriptor import TensorDescriptor

    if isinstance(arg, TensorWrapper):
        arg = arg.base
    if isinstance(arg, TensorDescriptor):
        _regions_of(f"{name}.base", arg.base, out)
    elif isinstance(arg, torch.Tensor):
        storage = arg.untyped_storage()
        out.append(_Region(name, storage.data_ptr(), storage.data_ptr() + storage.nbytes(), arg.data_ptr(),
                           arg.element_size()))
    elif isinstance(arg, tuple):
        for i, item in enumerate(arg):
            _regions_of(f"{name}[{i}]", item, out)


def _set_regions(regions: list[_Region]) -> None:
    order = sorted(range(len(regions)), key=lambda i: regions[i].start)
    _state.regions = [regions[i] for i in order]
    _state.starts = np.array([r.start for r in _state.regions], dtype=np.uint64)
    _state.ends = np.array([r.end for r in _state.regions], dtype=np.uint64)


def _check(op: str, ptrs, mask) -> None:
    if _state.regions is None:
        return
    addresses = np.asarray(ptrs.data, dtype=np.uint64)
    if mask is not None:
        addresses = addresses[np.broadcast_to(np.asarray(mask.data, dtype=bool), addresses.shape)]
    addresses = addresses.reshape(-1)
    if addresses.size == 0:
        return
    element = ptrs.get_element_ty()
    itemsize = max(1, getattr(element, "primitive_bitwidth", 8) // 8)
    # The last region starting at or before each address must hold all of its bytes. Storages do
    # not overlap unless they are one storage, which then appears with the same bounds.
    at = np.searchsorted(_state.starts, addresses, side="right") - 1
    inside = at >= 0
    safe_at = np.where(inside, at, 0)
    # Overlapping regions (two views of one storage, a descriptor of an argument): the widest end
    # among those starting at or before the address.
    widest = np.maximum.accumulate(_state.ends)
    inside &= addresses + np.uint64(itemsize) <= widest[safe_at]
    if inside.all():
        return
    bad = addresses[~inside]
    first = int(bad[0])
    nearest = min(_state.regions, key=lambda r: min(abs(first - r.start), abs(first - r.end)))
    offset = (first - nearest.view_start) / nearest.itemsize
    where = "before" if first < nearest.start else "past the end of" if first >= nearest.end else "across the end of"
    raise OutOfBoundsAccess(
        f"{_state.kernel}: {op} of {bad.size} element(s) outside every tensor of the launch (program "
        f"{_grid_idx()}); the first at 0x{first:x}, {where} the storage of '{nearest.name}' "
        f"(element offset {offset:+g} from its data_ptr; its storage spans "
        f"{(nearest.start - nearest.view_start) // nearest.itemsize:+d} .. "
        f"{(nearest.end - nearest.view_start) // nearest.itemsize:+d})"
    )


def _grid_idx():
    from triton.runtime.interpreter import interpreter_builder

    return getattr(interpreter_builder, "grid_idx", None)


@contextlib.contextmanager
def checked_addresses() -> Iterator[None]:
    """Within the block, every interpreted Triton launch fails with `OutOfBoundsAccess` on a load,
    store or atomic that touches memory outside its tensors (see the module docstring)."""
    from pbs.kernels._common import interpreting

    if not interpreting():
        yield
        return
    from triton.runtime import interpreter

    executor = interpreter.GridExecutor
    builder = interpreter.interpreter_builder
    real_init, real_call = executor._init_args_hst, executor.__call__
    real_ops = {name: getattr(builder, name) for name in
                ("create_load", "create_masked_load", "create_masked_store", "create_atomic_rmw", "create_atomic_cas")}
    patched_before = {name: builder.__dict__[name] for name in real_ops if name in builder.__dict__}  # nested use

    def init_args(self, args_dev, kwargs):
        args_hst, kwargs_hst = real_init(self, args_dev, kwargs)
        regions: list[_Region] = []
        for name, arg in zip(self.arg_names, args_hst):
            _regions_of(name, arg, regions)
        for name, arg in kwargs_hst.items():
            _regions_of(name, arg, regions)
        _set_regions(regions)
        return args_hst, kwargs_hst

    def call(self, *args, **kwargs):
        outer = (_state.kernel, _state.regions, _state.starts, _state.ends, _state.speculating)
        _state.kernel = getattr(self.fn, "__name__", str(self.fn))
        try:
            return real_call(self, *args, **kwargs)
        finally:
            _state.kernel, _state.regions, _state.starts, _state.ends, _state.speculating = outer

    def plain_load(ptr, cache_policy, is_volatile):
        _state.plain_load = True
        try:
            return real_ops["create_load"](ptr, cache_policy, is_volatile)
        finally:
            _state.plain_load = False

    def masked_load(ptrs, mask, other, cache_policy, is_volatile):
        if _state.speculating and not _state.plain_load:
            # Predicated off, as the pipeliner does: the fill value, no memory touched.
            return _fill(ptrs, other)
        _check("load" if not _state.speculating else "speculative unmasked load (pipelined loop)", ptrs, mask)
        return real_ops["create_masked_load"](ptrs, mask, other, cache_policy, is_volatile)

    def masked_store(ptrs, value, mask, cache_policy):
        if _state.speculating:
            return None
        _check("store", ptrs, mask)
        return real_ops["create_masked_store"](ptrs, value, mask, cache_policy)

    def atomic_rmw(rmw_op, ptr, val, mask, sem, scope):
        _check("atomic", ptr, mask)
        return real_ops["create_atomic_rmw"](rmw_op, ptr, val, mask, sem, scope)

    def atomic_cas(ptr, cmp, val, sem, scope):
        _check("atomic_cas", ptr, None)
        return real_ops["create_atomic_cas"](ptr, cmp, val, sem, scope)

    executor._init_args_hst, executor.__call__ = init_args, call
    builder.create_load = plain_load
    builder.create_masked_load, builder.create_masked_store = masked_load, masked_store
    builder.create_atomic_rmw, builder.create_atomic_cas = atomic_rmw, atomic_cas
    try:
        yield
    finally:
        executor._init_args_hst, executor.__call__ = real_init, real_call
        for name in real_ops:
            if name in patched_before:
                setattr(builder, name, patched_before[name])
            else:
                delattr(builder, name)  # back to the class's methods


def _fill(ptrs, other):
    from triton.runtime.interpreter import TensorHandle, _get_np_dtype

    element = ptrs.get_element_ty()
    dtype = _get_np_dtype(element)
    data = np.zeros(np.shape(ptrs.data), dtype=dtype)
    if other is not None:
        data = np.broadcast_to(np.asarray(other.data, dtype=dtype), data.shape).copy()
    return TensorHandle(data, element)


class _SpeculativeRange:
    """``range`` for `pipelined_loops`: the real iterations, then ``stages - 1`` speculative ones
    (from the end, or from the start of a loop that runs none), flagged in `_state`."""

    def __init__(self, stages: int, *args):
        bounds = [int(a) for a in args]
        self.real = range(*bounds)
        self.extra = stages - 1

    def __iter__(self):
        yield from self.real
        step = self.real.step
        first = self.real.start if len(self.real) == 0 else self.real[-1] + step
        _state.speculating += 1
        try:
            for i in range(self.extra):
                yield first + i * step
        finally:
            _state.speculating -= 1


@contextlib.contextmanager
def pipelined_loops(module, stages: int = 3) -> Iterator[None]:
    """Within the block, the ``range`` loops of the Triton kernels defined in ``module`` run
    ``stages - 1`` speculative iterations after their real ones, as a software-pipelined loop does
    on the GPU (see the module docstring). Use it inside `checked_addresses`, to check addresses:
    the kernels' outputs are meaningless under it."""
    import builtins

    if stages < 1:
        raise ValueError(f"stages must be at least 1, got {stages}")
    namespace = module.__dict__
    had, previous = "range" in namespace, namespace.get("range")
    namespace["range"] = lambda *args: _SpeculativeRange(stages, *args) if _state.kernel else builtins.range(*args)
    try:
        yield
    finally:
        if had:
            namespace["range"] = previous
        else:
            del namespace["range"]
