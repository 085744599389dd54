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


def test_the_last_failures_tensors_are_freed_before_the_next_gpu_test():
    # What the cap's GPU test below checks across processes, here on the CPU: pytest keeps the last
    # failure's traceback in sys.last_traceback, whose frames hold the test's tensors.
    import sys
    import weakref

    from tests.conftest import _free_gpu_memory

    held = []

    def failing_test():
        x = torch.empty(1000)
        held.append(weakref.ref(x))
        raise AssertionError("a failure holding x")

    try:
        failing_test()
    except AssertionError as error:
        sys.last_type, sys.last_value, sys.last_traceback = type(error), error, error.__traceback__
    _free_gpu_memory()
    assert held[0]() is not None  # collecting alone does not reach what the traceback holds
    _free_gpu_memory(drop_last_failure=True)
    assert held[0]() is None and not hasattr(sys, "last_traceback")


@pytest.mark.gpu
def test_a_gpu_test_past_its_memory_cap_fails_alone_and_its_peak_is_logged(tmp_path):
    # tests/conftest.py's cap and cleanup keep the eight parallel GPU test processes from starving
    # each other, and a failed test from starving the next one of its own process.
    import os
    import subprocess
    import sys

    inner = tmp_path / "test_inner.py"
    inner.write_text(
        "import pytest, torch\n\n"
        "@pytest.mark.gpu\ndef test_1_one_gib():\n    x = torch.empty(1 << 30, dtype=torch.uint8, device='cuda')\n\n"
        "@pytest.mark.gpu\ndef test_2_fails_holding_three_gib():\n"
        "    x = torch.empty(3 << 30, dtype=torch.uint8, device='cuda')\n    assert x.numel() == 0\n\n"
        "@pytest.mark.gpu\ndef test_3_starts_with_nothing_allocated():\n    assert torch.cuda.memory_allocated() == 0\n")
    log = tmp_path / "memory.log"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def run(budget_gib, test):
        env = dict(os.environ, PBS_GPU_TEST_MEMORY_GIB=str(budget_gib), PBS_GPU_MEMORY_LOG=str(log), PYTHONPATH=root)
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                               "--rootdir", str(tmp_path), f"{inner}{test}"], cwd=root, env=env,
                              capture_output=True, text=True).stdout

    over = run(0.5, "::test_1_one_gib")
    assert "OutOfMemoryError" in over and "1 failed" in over, over
    log.unlink()
    within = run(4, "")
    assert "1 failed, 2 passed" in within and "test_2_fails_holding_three_gib" in within, within
    peaks = [float(line.split()[0]) for line in log.read_text().splitlines()]
    assert len(peaks) == 3 and 1.0 <= peaks[0] < 1.1 and 3.0 <= peaks[1] < 3.1, peaks
