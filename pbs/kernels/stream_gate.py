"""A gate that holds a CUDA stream while the host reads a result and decides what to launch next.

The density probe ends in a host read: the host waits for two counters, then launches dense
attention or planning. Read the ordinary way, the stream runs empty while the host waits, and the
next launch lands on an idle GPU. On the H100 machines measured, the host then took 90-177 us to
launch cuDNN's attention (about 20 us when the GPU still had work queued), and all that time the
GPU did nothing (docs/notes.md, "The density probe at flat 32K").

`StreamGate` keeps the stream busy instead. After the probe, the counters are copied into pinned
memory and an event is recorded; then one tiny kernel (``_hold_until``, a single program) is
queued that polls a pinned host word until the host writes a ticket there. The host waits on the
*event*, not the stream, reads the counters, launches what comes next behind the gate, and then
writes the ticket: the launch meets a busy queue, and the gate opens as soon as it is queued.

The gate only delays; it never changes a result. It gives up on its own after ``max_polls``
reads of the host word, so a host that never opens it (a killed thread) costs that much GPU time
once, and a host that takes longer (the first call of a shape, where cuDNN builds its graph) finds
the gate already open, as if there were none.
"""

from __future__ import annotations

import threading

import torch
import triton
import triton.language as tl

MAX_POLLS = 1 << 17
"""Reads of the host word before the gate opens by itself: each is a PCIe round trip of about a
microsecond, so about 0.1-0.3 s."""


@triton.jit
def _hold_until(word_ptr, ticket, max_polls):
    # word_ptr[0]: the ticket the host has released up to; word_ptr[1]: this gate's poll count (for tests).
    seen = tl.load(word_ptr, volatile=True)
    polls = 0
    while (seen < ticket) & (polls < max_polls):
        seen = tl.load(word_ptr, volatile=True)
        polls += 1
    tl.store(word_ptr + 1, polls)


class StreamGate:
    """Holds the current CUDA stream of one device between `read` and `release`.

    One per (thread, device): `stream_gate` hands it out. Tickets only grow, so a gate that reads
    the word late still sees every later release. Use as a context manager so that the gate is
    released whatever happens::

        with stream_gate(q.device) as gate:
            kept, visible = gate.read(counters)   # the stream is held from here
            if kept / visible > limit:
                out = dense(q, k, v)              # queued behind the gate
        # released on exit: the GPU goes straight on to what was queued
    """

    def __init__(self, device: torch.device, max_polls: int = MAX_POLLS):
        self.device = device
        self.max_polls = max_polls
        pinned = torch.cuda.is_available()  # False only under the Triton interpreter's CPU tests
        self._word = torch.zeros(2, dtype=torch.int64, pin_memory=pinned)
        self._word_view = self._word.numpy()  # host writes without a torch op
        self._values = torch.zeros(8, dtype=torch.int32, pin_memory=pinned)
        self._copied: torch.cuda.Event | None = None
        self._ticket = 0
        self._held = False

    @property
    def held(self) -> bool:
        return self._held

    @property
    def last_polls(self) -> int:
        """How many times the last gate that opened polled the host word (read after it opened)."""
        return int(self._word_view[1])

    def hold(self) -> None:
        """Queues the gate on the current stream: nothing queued after it runs until `release`."""
        if self._held:
            raise RuntimeError("StreamGate.hold: the gate is already held; release it first")
        self._ticket += 1
        _hold_until[(1,)](self._word, self._ticket, self.max_polls, num_warps=1)
        self._held = True

    def read(self, values: torch.Tensor) -> list[int]:
        """The integers of ``values`` (a 1-d int32 tensor on the device, at most 8) on the host,
        with the stream held after them.

        Waits for the values only (an event recorded after their copy), not for the gate.
        """
        count = values.numel()
        if values.dim() != 1 or count > self._values.numel() or values.dtype != torch.int32:
            # Same dtype on both sides: a copy that converts is not asynchronous, and a read that
            # waits before the gate is queued would leave the stream empty, the thing it avoids.
            raise ValueError(f"StreamGate.read: values must be a 1-d int32 tensor of at most {self._values.numel()} "
                             f"integers, got {values.dtype} of shape {tuple(values.shape)}")
        if self._copied is None:
            self._copied = torch.cuda.Event()
        self._values[:count].copy_(values, non_blocking=True)
        self._copied.record()
        self.hold()
        self._copied.synchronize()
        return self._values[:count].tolist()

    def release(self) -> None:
        """Opens the gate (no-op when it is not held)."""
        if self._held:
            self._word_view[0] = self._ticket
            self._held = False

    def __enter__(self) -> "StreamGate":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


_GATES = threading.local()


def stream_gate(device: torch.device) -> StreamGate:
    """This thread's gate for ``device`` (a CUDA device), created on first use."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    gates = getattr(_GATES, "by_device", None)
    if gates is None:
        gates = _GATES.by_device = {}
    gate = gates.get(index)
    if gate is None:
        with torch.cuda.device(index):
            gate = gates[index] = StreamGate(torch.device("cuda", index))
    return gate
