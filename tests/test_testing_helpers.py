"""`pbs.testing`'s timing helpers: what the benchmarks' numbers rest on."""

from __future__ import annotations

import pytest
import torch

from pbs.testing import benchmark_cuda_interleaved


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_interleaved_timing_says_it_needs_a_gpu():
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        benchmark_cuda_interleaved({"a": lambda: None})


@pytest.mark.gpu
def test_interleaved_timing_times_every_function_in_turn():
    x = torch.randn(2048, 2048, device="cuda")
    calls = {"small": 0, "large": 0}

    def small():
        calls["small"] += 1
        return x @ x

    def large():
        calls["large"] += 1
        return torch.cat([x] * 4) @ x

    times = benchmark_cuda_interleaved({"small": small, "large": large}, warmup=1, iters=6)
    assert set(times) == {"small", "large"} and calls == {"small": 7, "large": 7}
    assert 0 < times["small"] < times["large"]  # four times the work takes longer


@pytest.mark.gpu
def test_busy_gpu_hides_host_time_before_the_launch():
    # A call that spends ~2 ms on the host before its one launch: on an idle GPU the events hold
    # that time; with the GPU kept busy before the start event they hold the kernel's time only.
    import time

    x = torch.randn(1024, 1024, device="cuda")

    def slow_host():
        time.sleep(0.002)
        return x @ x

    idle = benchmark_cuda_interleaved({"f": slow_host}, warmup=1, iters=5)["f"]
    busy = benchmark_cuda_interleaved({"f": slow_host}, warmup=1, iters=5, busy_gpu_cycles=20_000_000)["f"]
    assert idle > 1.5 and busy < 1.0, (idle, busy)
