"""Host time of each step of ``pbs.attention``'s dense path, next to SDPA's own, on a CUDA device.

The GPU is kept busy (a queued spin) while the host loops, so every number is host time only: what
a call costs before its kernels can start. Prints microseconds per call (median of 5 loops).

    python3 scripts/host_overhead.py --seq-len 2048
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import pbs
from pbs.api import _scale
from pbs.config import PBSConfig
from pbs.dense import DensePolicy, dense_attention_sdpa
from pbs.validation import check_qkv


def host_us(fn, calls: int, launches: bool) -> float:
    fn()
    torch.cuda.synchronize()
    loops = []
    for _ in range(5):
        if launches:
            torch.cuda._sleep(200_000_000)  # far longer than the loop: the host never waits
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        loops.append((time.perf_counter() - start) * 1e6 / calls)
        torch.cuda.synchronize()
    return statistics.median(loops)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--probe-seq-len", type=int, default=0, help="also time the density probe's steps at this length")
    args = parser.parse_args()
    if args.probe_seq_len:
        probe_steps(args.probe_seq_len)
    n = args.seq_len
    q = torch.randn(1, 32, n, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, n, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    config = PBSConfig.coerce(None)
    steps = {
        "torch.compiler.is_compiling": (torch.compiler.is_compiling, False),
        "PBSConfig.coerce(None)": (lambda: PBSConfig.coerce(None), False),
        "config.checks_finite": (lambda: config.checks_finite(q.device), False),
        "check_qkv": (lambda: check_qkv(q, k, v, check_finite=False), False),
        "_scale": (lambda: _scale(q, None), False),
        "DensePolicy(config).length_reason": (lambda: DensePolicy(config).length_reason(q, k), False),
        "SDPA priority order: get": (torch._C._get_sdp_priority_order, False),
        "q.shape; q.dtype; q.device": (lambda: (q.shape, q.dtype, q.device), False),
        "F.sdpa (default priority order)": (
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), True),
        "dense_attention_sdpa": (lambda: dense_attention_sdpa(q, k, v, scale=128**-0.5), True),
        "pbs.attention": (lambda: pbs.attention(q, k, v), True),
    }
    print(f"N={n} torch {torch.__version__} {torch.cuda.get_device_name()} "
          f"SDPA priority order {torch._C._get_sdp_priority_order()} (cuDNN is {int(SDPBackend.CUDNN_ATTENTION)})")
    for name, (fn, launches) in steps.items():
        print(f"{name:40s} {host_us(fn, 200 if launches else 5000, launches):8.2f} us", flush=True)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        print(f"{'F.sdpa inside sdpa_kernel(CUDNN)':40s} "
              f"{host_us(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), 200, True):8.2f} us")
        print(f"{'pbs.attention inside sdpa_kernel(CUDNN)':40s} {host_us(lambda: pbs.attention(q, k, v), 200, True):8.2f} us")
    cudnn_op = torch.ops.aten._scaled_dot_product_cudnn_attention.default
    try:
        direct = cudnn_op(q, k, v, None, False, 0.0, True, False, scale=128**-0.5)[0]
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        print("aten cuDNN op with Hq != Hkv: max abs diff to F.sdpa", float((direct - expected).abs().max()))
        print(f"{'aten cuDNN op called directly':40s} "
              f"{host_us(lambda: cudnn_op(q, k, v, None, False, 0.0, True, False, scale=128**-0.5), 200, True):8.2f} us")
    except Exception as error:  # noqa: BLE001 - a diagnostic: report whatever the op says
        print("aten cuDNN op with Hq != Hkv failed:", type(error).__name__, str(error).splitlines()[0])
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, True, True)
    print(f"{'SDPAParams + can_use_cudnn_attention':40s} "
          f"{host_us(lambda: torch.backends.cuda.can_use_cudnn_attention(torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, True, True)), 2000, False):8.2f} us",
          torch.backends.cuda.can_use_cudnn_attention(params))


def probe_steps(n: int) -> None:
    """Host time of the density probe's steps at ``n`` tokens (flat inputs: it runs before dense)."""
    from pbs.kernels.block_means import block_means
    from pbs.kernels.density_probe import probe_density_triton

    q = torch.randn(1, 32, n, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, n, 128, device="cuda", dtype=torch.bfloat16)
    config = PBSConfig.coerce(None)
    args = dict(block_size=128, num_blocks=config.dense_fallback.probe_blocks, threshold=0.9, scale=128**-0.5)
    counter = torch.zeros(2, dtype=torch.int32, device="cuda")
    steps = {
        "config.selector.mass_share()": (lambda: config.selector.mass_share(), False),
        "block_means(k) launch": (lambda: block_means(k, 128), True),
        "torch.empty + torch.zeros(2)": (lambda: (torch.empty(4096, device="cuda"), torch.zeros(2, dtype=torch.int32, device="cuda")), True),
        "two ints read (sync, idle GPU)": (lambda: counter.tolist(), False),
        "probe_density_triton (with its sync)": (lambda: probe_density_triton(q, k, **args), False),
        "probe_estimate (with its sync)": (lambda: DensePolicy(config).probe_estimate(q, k, 128**-0.5), False),
    }
    print(f"N={n} flat, density probe steps")
    for name, (fn, launches) in steps.items():
        print(f"{name:40s} {host_us(fn, 200, launches):8.2f} us", flush=True)
    print(f"N={n} flat, right after a host sync (the idle-GPU case), median of 50, GPU time included")
    for name in ("two ints read (sync, idle GPU)", "probe_density_triton (with its sync)", "probe_estimate (with its sync)"):
        print(f"{name:40s} {after_sync_us(steps[name][0]):8.2f} us", flush=True)


def after_sync_us(fn, calls: int = 50) -> float:
    """Wall time of ``fn`` started right after the host waited on the GPU, as a call in a timed
    loop of single calls (or the first after a probe's read) starts."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        torch.cuda._sleep(2_000_000)  # about 1 ms of GPU work the host then waits for
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


if __name__ == "__main__":
    main()
