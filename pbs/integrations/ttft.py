"""Time to first token (TTFT) of a causal LM: the one measurement behind ``pbs generate`` and
``benchmarks/bench_ttft.py``.

TTFT here is one prefill forward of the prompt with a KV cache plus picking the greedy first token
from the last position's logits. Only that position's logits are computed (``logits_to_keep=1``
where the model takes it, as generation does), so a long prompt never materialises ``(N, vocab)``
logits. Each timed run starts on an idle device and ends when the first token has reached the host.
On CUDA the runs are also timed with CUDA events around the same work:

    ttft = measure_ttft(model, input_ids, warmup=1, repeats=3)
    print(ttft.median, ttft.device_times)

transformers is not imported here: any module whose ``forward(input_ids=..., use_cache=True)``
returns an object with ``.logits`` works.
"""

from __future__ import annotations

import inspect
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, TextIO

import torch

__all__ = ["DEFAULT_REPEATS", "LONG_PREFILL_S", "TTFT", "PrefillProgress", "measure_ttft", "prefill_first_token"]

DEFAULT_REPEATS = 5
LONG_PREFILL_S = 10.0  # a prefill at least this long times 3 repeats by default instead of DEFAULT_REPEATS


@dataclass(frozen=True)
class TTFT:
    """Timed prefills of one attention implementation, in seconds.

    ``times`` are wall-clock times; ``device_times`` the CUDA-event times of the same runs (``None``
    off CUDA).
    """

    times: tuple[float, ...]
    device_times: tuple[float, ...] | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def min(self) -> float:
        return min(self.times)

    @property
    def max(self) -> float:
        return max(self.times)


def _forward_kwargs(model: torch.nn.Module) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"use_cache": True}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kwargs["logits_to_keep"] = 1
    return kwargs


def _prefill(model: torch.nn.Module, input_ids: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    logits = model(input_ids=input_ids, **kwargs).logits
    return logits[:, -1].argmax(-1)


@torch.inference_mode()
def prefill_first_token(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """One prefill with a KV cache, then the greedy first token from the last position's logits.

    Args:
        model: a causal LM (``forward(input_ids, use_cache=True)`` returning ``.logits``).
        input_ids: ``(B, N)`` prompt tokens on the model's device.

    Returns:
        ``(B,)`` token ids, on the model's device (no sync).
    """
    return _prefill(model, input_ids, _forward_kwargs(model))


def measure_ttft(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    warmup: int = 1,
    repeats: int | None = None,
    progress: PrefillProgress | None = None,
    label: str = "prefill",
) -> TTFT:
    """Times `prefill_first_token` (prefill forward plus the greedy first token).

    Args:
        model: a causal LM (``forward(input_ids, use_cache=True)`` returning ``.logits``).
        input_ids: ``(B, N)`` prompt tokens on the model's device.
        warmup: untimed runs first (the first PBS call compiles its Triton kernels).
        repeats: timed runs; ``None``: ``DEFAULT_REPEATS`` (5), or 3 when the first timed run takes
            over ``LONG_PREFILL_S`` (10 s).
        progress: shows per-layer progress of long prefills.
        label: names the runs in the progress lines.

    Returns:
        The wall-clock time of every timed run, from an idle device to the first token on the host,
        and on CUDA the CUDA-event time of the same runs.
    """
    kwargs = _forward_kwargs(model)
    cuda = input_ids.device.type == "cuda"
    times: list[float] = []
    device_times: list[float] = []
    planned = repeats if repeats is not None else DEFAULT_REPEATS
    i = 0
    with torch.inference_mode():
        while i < warmup + planned:
            what = f"warm-up {i + 1}/{warmup}" if i < warmup else f"timed {i - warmup + 1}/{planned}"
            with progress.forward(f"{label} {what}") if progress is not None else nullcontext():
                if cuda:
                    torch.cuda.synchronize(input_ids.device)
                    start_event = torch.cuda.Event(enable_timing=True)
                    end_event = torch.cuda.Event(enable_timing=True)
                start = time.perf_counter()
                if cuda:
                    start_event.record()
                first_token = _prefill(model, input_ids, kwargs)
                if cuda:
                    end_event.record()
                first_token.cpu()  # waits for the device
                elapsed = time.perf_counter() - start
            if i >= warmup:
                times.append(elapsed)
                if cuda:
                    end_event.synchronize()
                    device_times.append(start_event.elapsed_time(end_event) / 1e3)
                if repeats is None and len(times) == 1 and elapsed > LONG_PREFILL_S:
                    planned = 3
            i += 1
    return TTFT(tuple(times), tuple(device_times) if cuda else None)


class PrefillProgress:
    """Per-layer progress of long prefills (and of the decoding after them), on stderr.

    Forward hooks on the decoder layers count the layers done. Nothing is shown until a forward has
    run for ``after_s`` seconds, so short prefills stay silent; then a terminal gets one line redrawn
    in place. A log file or pipe gets few lines: at most one per ``every_s`` seconds, and fewer as
    the forward goes on (the gap grows with the time elapsed, ``backoff`` times it, so a forward
    of an hour writes about twenty lines), plus the line of a prefill's last layer and, after a
    decode, one closing line with the tokens decoded. Lines start with ``prefix`` and a colon.
    """

    def __init__(self, model: torch.nn.Module, *, enabled: bool = True, stream: TextIO | None = None,
                 after_s: float = 2.0, every_s: float = 5.0, backoff: float = 0.5, prefix: str = "pbs generate"):
        self.layers = decoder_layers(model)
        self.enabled = enabled and bool(self.layers)
        self.stream = stream if stream is not None else sys.stderr
        self.after_s, self.every_s, self.backoff = after_s, every_s, backoff
        self.prefix = prefix
        self._interactive = bool(getattr(self.stream, "isatty", lambda: False)())
        self._label: str | None = None
        self._done = 0
        self._start = self._last = 0.0
        self._drawn = False
        self._pending = False  # the state has moved on since the last line written to a non-terminal
        self._width = 0

    @contextmanager
    def forward(self, label: str) -> Iterator[None]:
        """Shows the progress of the forwards run inside the ``with`` block as ``label``."""
        if not self.enabled:
            yield
            return
        handles = [layer.register_forward_hook(self._layer_done) for layer in self.layers]
        self._label, self._done, self._drawn, self._pending = label, 0, False, False
        self._start = self._last = time.perf_counter()
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            if self._drawn and self._interactive:
                self.stream.write("\n")
                self.stream.flush()
            elif self._drawn and self._pending:  # a log's last line says where it ended
                self._write(time.perf_counter(), done=True)
            self._label = None

    def _layer_done(self, *_: Any) -> None:
        self._done += 1
        now = time.perf_counter()
        if now - self._start < self.after_s:
            return
        if not self._interactive and self._drawn and self._done != len(self.layers):
            gap = max(self.every_s, self.backoff * (now - self._start))
            if now - self._last < gap:
                self._pending = True
                return
        self._write(now)

    def _write(self, now: float, done: bool = False) -> None:
        self._last = now
        n = len(self.layers)
        if self._done <= n:
            where = f"layer {self._done}/{n}"
        else:
            tokens = self._done // n - 1  # decoded in full
            where = f"decoded {tokens} token{'s' if tokens != 1 else ''}" if done else f"decoding token {tokens + 1}"
        line = f"{self.prefix}: {self._label}: {where}, {now - self._start:.1f} s"
        if self._interactive:
            line, self._width = "\r" + line.ljust(self._width), max(self._width, len(line))
        else:
            line += "\n"
        self.stream.write(line)
        self.stream.flush()
        self._drawn, self._pending = True, False


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: ``model.model.layers`` where it exists (Llama, Qwen, Mistral, ...),
    else every module with a ``layer_idx`` (the attention layers)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers):
        return list(layers)
    return [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int)]
