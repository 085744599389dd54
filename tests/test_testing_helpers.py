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
