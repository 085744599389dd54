"""Host time of one Gluon-kernel call by part, with the GPU kept busy (so none of it waits on the GPU).

On the kernel benchmark's 16K input at density 0.1 (`benchmarks/bench_kernel.py`'s mask), prints the
microseconds per call of ``hopper_block_sparse_attention`` whole, of ``prepare_call``, of
``launch_arguments`` (the TMA descriptors and the scalar arguments) and of the launch itself, then a
``cProfile`` of 30 whole calls. The kernel benchmark times an idle GPU, where this host time shows
in the events when it is longer than the L2 flush before the call.

    python3 scripts/gluon_launch_host_time.py > $OUT/host_launch.log
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import KERNEL_SHAPE  # noqa: E402
from benchmarks.common import kernel_plan as make_plan  # noqa: E402
from pbs.kernels import hopper_attn  # noqa: E402
from pbs.kernels._common import sm_count  # noqa: E402
from pbs.kernels.block_sparse_attn import prepare_call  # noqa: E402

_, HEADS_Q, HEADS_KV, HEAD_DIM = KERNEL_SHAPE
N, DENSITY, CALLS = 16384, 0.1, 50


def host_us(fn) -> float:
    """Microseconds of host time per call, over CALLS calls queued behind a GPU spin."""
    torch.cuda._sleep(int(3e9))
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    elapsed = (time.perf_counter() - start) / CALLS * 1e6
    torch.cuda.synchronize()
    return elapsed


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(N)
    q, k, v = (torch.randn(1, h, N, HEAD_DIM, device="cuda", generator=gen).bfloat16() for h in (HEADS_Q, HEADS_KV, HEADS_KV))
    plan = make_plan(q, k, DENSITY)
    kp, vp = plan.key_permutation.apply(k), plan.key_permutation.apply(v)
    kpos = plan.key_positions()
    sms = sm_count(q.device)

    def whole():
        return hopper_attn.hopper_block_sparse_attention(q, kp, vp, plan.mask, None, kpos)

    call = prepare_call(q, kp, vp, plan.mask, None, kpos, None, True, None)
    for _ in range(5):
        whole()
    torch.cuda.synchronize()
    grid, args, kwargs = hopper_attn.launch_arguments(call, sms)
    print(f"full call           {host_us(whole):8.1f} us")
    print(f"prepare_call        {host_us(lambda: prepare_call(q, kp, vp, plan.mask, None, kpos, None, True, None)):8.1f} us")
    print(f"launch_arguments    {host_us(lambda: hopper_attn.launch_arguments(call, sms)):8.1f} us")
    print(f"kernel[grid](...)   {host_us(lambda: hopper_attn._hopper_block_sparse_attn_fwd[grid](*args, **kwargs)):8.1f} us")
    print(f"torch.zeros(1)      {host_us(lambda: torch.zeros(1, dtype=torch.int32, device='cuda')):8.1f} us")
    torch.cuda._sleep(int(3e9))
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(30):
        whole()
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(28)
    print(text.getvalue())


if __name__ == "__main__":
    main()
