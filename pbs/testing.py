"""Public test helpers: a structured synthetic workload, error measures, and GPU timing.

``make_qkv`` builds queries and keys whose attention has the patterns long-context LLM heads show:
attention sinks (the first token draws attention from every query), scattered heavy hitters (a few
tokens anywhere in the sequence that every query attends to), local windows (attention decays with
distance) and slash lines (attention to fixed offsets behind the query). Heads cycle through mixes
of these, so block selection and permutation face realistic, varied structure with no model.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = ["make_qkv", "relative_error", "assert_close_to_reference", "benchmark_cuda"]

# Pattern strengths per head kind, as logit contributions: (sink, heavy hitters, local, slash).
_HEAD_KINDS: tuple[tuple[float, float, float, float], ...] = (
    (9.0, 9.0, 3.0, 0.0),  # sink + scattered heavy hitters
    (9.0, 5.0, 9.0, 0.0),  # sink + local window
    (9.0, 6.0, 2.0, 8.0),  # sink + slash lines
    (9.0, 8.0, 5.0, 4.0),  # a mix of everything
)


def make_qkv(
    batch: int = 1,
    heads_q: int = 8,
    heads_kv: int = 2,
    seq_len: int = 4096,
    head_dim: int = 64,
    *,
    seq_len_q: int | None = None,
    heavy_hitter_fraction: float = 0.02,
    slash_offsets: tuple[int, ...] = (64, 512),
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A structured synthetic attention workload.

    Args:
        batch, heads_q, heads_kv, seq_len, head_dim: shapes (``heads_q % heads_kv == 0``,
            ``head_dim >= 16`` and even).
        seq_len_q: number of queries (the last ones), default ``seq_len``.
        heavy_hitter_fraction: share of key positions that are global heavy hitters.
        slash_offsets: distances behind the query that "slash" heads attend to.
        seed: generator seed (results are the same on every device).
        dtype, device: of the returned tensors.

    Returns:
        ``q (B, Hq, Nq, D)``, ``k (B, Hkv, N, D)``, ``v (B, Hkv, N, D)``.
    """
    if head_dim < 16 or head_dim % 2:
        raise ValueError(f"head_dim must be even and >= 16, got {head_dim}")
    if heads_kv <= 0 or heads_q % heads_kv:
        raise ValueError(f"heads_q ({heads_q}) must be a positive multiple of heads_kv ({heads_kv})")
    nq = seq_len if seq_len_q is None else seq_len_q
    if not 0 < nq <= seq_len:
        raise ValueError(f"seq_len_q must be in [1, seq_len={seq_len}], got {nq}")
    gen = torch.Generator().manual_seed(seed)
    d = head_dim
    group = heads_q // heads_kv
    n_freq = max(2, (d - 2) // 4)  # dims 2 .. 2+4F: local and slash sinusoid pairs
    pos = torch.arange(seq_len, dtype=torch.float64)
    # Random frequencies below 2*pi/512 make the local kernel mean_f cos(w_f * dist) a window about
    # a few hundred tokens wide with no periodic revival; frequencies up to pi make sharp offset peaks.
    local_freq = torch.rand(n_freq, generator=gen, dtype=torch.float64) * (2 * math.pi / 512)
    slash_freq = torch.rand(n_freq, generator=gen, dtype=torch.float64) * math.pi

    q = torch.zeros(batch, heads_kv, group, seq_len, d, dtype=torch.float64)
    k = torch.zeros(batch, heads_kv, seq_len, d, dtype=torch.float64)
    amp = math.sqrt(math.sqrt(d))  # logit = q.k / sqrt(d): amp^2 per unit of q and k
    o = 2 + 2 * n_freq
    for b in range(batch):
        for h in range(heads_kv):
            sink, heavy, local, slash = _HEAD_KINDS[(b * heads_kv + h) % len(_HEAD_KINDS)]
            kk = k[b, h]
            kk[0, 0] = amp
            # Key importance is long-tailed (most keys near 0, a few near 1) plus rare spikes at 1:
            # the scattered heavy hitters that permutation gathers into few blocks.
            # Relevant passages (a quarter of the text, in stretches of ~1K tokens) hold most of
            # the important keys, as in retrieval-style prompts.
            passage = torch.rand(seq_len // 1024 + 1, generator=gen) < 0.25
            relevant = passage.repeat_interleave(1024)[:seq_len].double()
            importance = relevant * torch.rand(seq_len, generator=gen, dtype=torch.float64) ** 4
            spikes = torch.rand(seq_len, generator=gen) < heavy_hitter_fraction
            importance[spikes] = 0.7 + 0.3 * torch.rand(int(spikes.sum()), generator=gen, dtype=torch.float64)
            kk[:, 1] = amp * importance
            ang_l = pos[:, None] * local_freq
            kk[:, 2 : 2 + n_freq] = amp * torch.cos(ang_l)
            kk[:, 2 + n_freq : o] = amp * torch.sin(ang_l)
            ang_s = pos[:, None] * slash_freq
            kk[:, o : o + n_freq] = amp * torch.cos(ang_s)
            kk[:, o + n_freq : o + 2 * n_freq] = amp * torch.sin(ang_s)
            for g in range(group):
                jitter = 0.8 + 0.4 * torch.rand(4, generator=gen, dtype=torch.float64)
                qq = q[b, h, g]
                qq[:, 0] = amp * sink * jitter[0]
                qq[:, 1] = amp * heavy * jitter[1]
                w_local = amp * local * jitter[2] / n_freq
                qq[:, 2 : 2 + n_freq] = w_local * torch.cos(ang_l)
                qq[:, 2 + n_freq : o] = w_local * torch.sin(ang_l)
                w_slash = amp * slash * jitter[3] / n_freq
                for off in slash_offsets:
                    ang = (pos[:, None] - off) * slash_freq
                    qq[:, o : o + n_freq] += w_slash * torch.cos(ang)
                    qq[:, o + n_freq : o + 2 * n_freq] += w_slash * torch.sin(ang)
    # Content noise in the spare dims, then one random rotation per KV head (shared by its query
    # heads, so logits are unchanged) so that no pattern sits on a coordinate axis.
    spare = 2 + 4 * n_freq
    if spare < d:
        q[..., spare:] = torch.randn(q[..., spare:].shape, generator=gen, dtype=torch.float64) * amp * 0.2
        k[..., spare:] = torch.randn(k[..., spare:].shape, generator=gen, dtype=torch.float64) * amp * 0.2
    rot = torch.linalg.qr(torch.randn(heads_kv, d, d, generator=gen, dtype=torch.float64))[0]
    q = torch.einsum("bhgnd,hde->bhgne", q, rot).reshape(batch, heads_q, seq_len, d)[:, :, seq_len - nq :]
    k = torch.einsum("bhnd,hde->bhne", k, rot)
    v = torch.randn(batch, heads_kv, seq_len, d, generator=gen, dtype=torch.float64)
    return tuple(x.to(dtype=dtype, device=device).contiguous() for x in (q, k, v))  # type: ignore[return-value]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in fp64."""
    a, e = actual.double(), expected.double()
    return float((a - e).norm() / e.norm().clamp(min=1e-300))


def assert_close_to_reference(
    actual: torch.Tensor,
    torch_at_dtype: torch.Tensor,
    truth: torch.Tensor,
    factor: float = 2.0,
    floor: float = 1e-5,
) -> None:
    """Kernel error judged against PyTorch's own error at the same dtype.

    Passes when ``err(actual) <= factor * err(torch_at_dtype) + floor``, errors relative to ``truth``
    (computed in fp32 or better).
    """
    err = relative_error(actual, truth)
    ref_err = relative_error(torch_at_dtype, truth)
    bound = factor * ref_err + floor
    if not err <= bound:
        raise AssertionError(f"relative error {err:.3e} exceeds {factor} x torch's {ref_err:.3e} + {floor:g} = {bound:.3e}")


def benchmark_cuda(fn: Callable[[], object], warmup: int = 5, iters: int = 20, flush_l2: bool = True) -> float:
    """Median time of ``fn()`` in milliseconds, measured with CUDA events after warm-up.

    Clears the L2 cache (by writing a 256 MiB buffer) before each timed call, so repeated runs do
    not measure a warm cache.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("benchmark_cuda needs a CUDA device")
    return benchmark_cuda_interleaved({"fn": fn}, warmup=warmup, iters=iters, flush_l2=flush_l2)["fn"]


def benchmark_cuda_interleaved(fns: dict[str, Callable[[], object]], warmup: int = 3, iters: int = 20,
                               flush_l2: bool = True, busy_gpu_cycles: int = 0) -> dict[str, float]:
    """Median CUDA-event time in milliseconds of each of ``fns``, timed call by call in turn.

    Like `benchmark_cuda` (L2 flushed before each timed call), but the functions take turns within
    every iteration, in an order that rotates, so that clock and thermal drift during the
    measurement fall on all of them alike. Timing two identical functions this way shows the
    protocol's own spread (an A/A comparison).

    On an idle GPU the events also hold whatever host time a call spends before its first launch
    beyond what the flush hides. ``busy_gpu_cycles`` queues that many GPU clock cycles of busy
    work (``torch.cuda._sleep``; 2e6 cycles are about a millisecond on an H100) after the flush,
    before the start event: the host then launches while the GPU is busy, as in a model's layer
    loop, and the events hold device time only (plus any host time after a sync inside the call).
    """
    if not torch.cuda.is_available():
        raise RuntimeError("benchmark_cuda_interleaved needs a CUDA device")
    if busy_gpu_cycles < 0:
        raise ValueError(f"busy_gpu_cycles must be >= 0, got {busy_gpu_cycles}")
    scratch = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda") if flush_l2 else None
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(iters):
        for name in names[i % len(names):] + names[:i % len(names)]:
            if scratch is not None:
                scratch.zero_()
            if busy_gpu_cycles:
                torch.cuda._sleep(busy_gpu_cycles)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fns[name]()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}
