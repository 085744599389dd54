"""How one kernel's time drifts over back-to-back calls: the first call after an idle pause
against the calls that follow it, with the GPU's SM clock and power drawn meanwhile.

A profiled call (`benchmarks.common.profile_call`, ``bench_defaults.py --profile``) runs after a
host sync on a GPU that has rested; a benchmark's timed calls run back to back. Where a kernel
holds the GPU at its power limit, the clock drops within a few calls and the two disagree. This
script measures that drift for pbs's attention kernel on the defaults' plan and for cuDNN dense
attention on the same inputs (cuDNN forced; the first result file, ``sustained_h200_46eff0f.json``,
ran SDPA's own choice, whose times match forced cuDNN's in ``bench_defaults.py``): each after a pause of ``--pause`` seconds, ``--calls`` calls queued
back to back, each between two CUDA events (no host sync between calls), while a thread samples
``nvidia-smi``'s SM clock and power draw every 50 ms.

Shapes: B=1, Hq=32, Hkv=8, D=128, bf16, causal, ``pbs.testing.make_qkv``'s structured inputs.

    python benchmarks/bench_sustained.py --n 65536 --json benchmarks/results/defaults/sustained_h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

if __package__ in (None, ""):  # run as a file: python3 benchmarks/bench_sustained.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pbs  # noqa: E402
import pbs.testing  # noqa: E402
from benchmarks.common import GpuSampler, environment, save  # noqa: E402

HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128
SAMPLE_MS = 50


def back_to_back_ms(fn: Callable[[], object], calls: int, device: torch.device) -> list[float]:
    """Each of ``calls`` calls of ``fn`` queued back to back: CUDA events around each on a GPU (one
    host sync at the end), wall time around each on the CPU."""
    if device.type != "cuda":
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return times
    events = [torch.cuda.Event(enable_timing=True) for _ in range(calls + 1)]
    events[0].record()
    for i in range(calls):
        fn()
        events[i + 1].record()
    torch.cuda.synchronize()
    return [events[i].elapsed_time(events[i + 1]) for i in range(calls)]


def readings(rows: list[list[str]]) -> list[tuple[float, float]]:
    """`benchmarks.common.GpuSampler`'s rows of ``clocks.sm,power.draw`` as numbers, the rows that
    are not numbers (``[N/A]``) left out."""
    numbers = []
    for clock, power in rows:
        try:
            numbers.append((float(clock), float(power)))
        except ValueError:
            continue
    return numbers


def drift(times: list[float], samples: list[tuple[float, float]]) -> dict:
    """The first call, the median of the last half, their ratio, and ``samples``' (SM clock in MHz,
    power in W) range."""
    steady = statistics.median(times[len(times) // 2:])
    summary = {"calls_ms": times, "first_ms": times[0], "steady_ms": steady, "steady_over_first": steady / times[0]}
    if samples:
        clocks = [clock for clock, _ in samples]
        summary |= {"sm_clock_mhz_max": max(clocks), "sm_clock_mhz_min": min(clocks),
                    "sm_clock_mhz_last": clocks[-1], "power_w_max": max(power for _, power in samples),
                    "samples": samples}
    return summary


def measure(n: int, calls: int, pause_s: float, device: torch.device) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v = pbs.testing.make_qkv(batch=1, heads_q=HEADS_Q, heads_kv=HEADS_KV, seq_len=n, head_dim=HEAD_DIM,
                                   dtype=dtype, device=device)
    plan = pbs.plan(q, k)
    timed = {
        "pbs_run": lambda: pbs.run(plan, q, k, v),
        "cudnn": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
    }
    point = {"seq_len": n, "density": float(plan.density), "backend": plan.backend}
    for name, fn in timed.items():
        # cuDNN forced around the whole sequence, as in bench_defaults.py (the CPU has no cuDNN)
        forced = name == "cudnn" and device.type == "cuda"
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION) if forced else contextlib.nullcontext():
            fn()  # compiled and tuned before the pause
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            time.sleep(pause_s)
            with GpuSampler("clocks.sm,power.draw", device.index or 0, SAMPLE_MS) as sampler:
                times = back_to_back_ms(fn, calls, device)
        samples = readings(sampler.rows)
        point[name] = drift(times, samples)
        print(f"N={n} {name}: first {times[0]:.2f} ms, steady {point[name]['steady_ms']:.2f} "
              f"({point[name]['steady_over_first']:.3f}x)"
              + (f", SM clock {point[name]['sm_clock_mhz_max']:.0f} -> {point[name]['sm_clock_mhz_last']:.0f} MHz,"
                 f" up to {point[name]['power_w_max']:.0f} W" if samples else ""), flush=True)
    return point


def main(argv: list[str] | None = None, device: str = "cuda") -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[65536])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--pause", type=float, default=3.0, help="seconds the GPU rests before each sequence")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.calls < 2:
        parser.error(f"--calls must be at least 2, got {args.calls}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    result = {**environment(dev), "shape": {"batch": 1, "heads_q": HEADS_Q, "heads_kv": HEADS_KV, "head_dim": HEAD_DIM},
              "calls": args.calls, "pause_s": args.pause,
              "points": [measure(n, args.calls, args.pause, dev) for n in args.n]}
    if args.json:
        save(result, args.json)
    return result


if __name__ == "__main__":
    main()
