"""How long the GPU waits for the host after a host read, by the way the host waits, on a CUDA device.

The density probe ends in a host read; dense attention can start only once the host has read the
estimate and launched it. This times, in CUDA events on an otherwise idle GPU, a short GPU job (as
long as the probe), the host's wait for it, and the cuDNN launch that follows, for several ways of
waiting: a blocking copy to the host (what ``.tolist()`` / ``.cpu()`` do), ``torch.cuda.synchronize``,
and a copy into pinned memory followed by a Python spin on an event (the thread never sleeps).
Prints medians in microseconds; the gap is the events' time minus the GPU job and cuDNN alone.

    python3 scripts/after_sync_check.py --seq-len 32768
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--job-cycles", type=int, default=200_000, help="torch.cuda._sleep cycles of the GPU job")
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    n = args.seq_len
    q = torch.randn(1, 32, n, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, n, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    counts = torch.ones(1024, dtype=torch.int32, device="cuda")
    pinned = torch.empty(1024, dtype=torch.int32, pin_memory=True)
    done = torch.cuda.Event()

    def attention():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def read_blocking():
        return counts.cpu().sum().item()

    def read_tolist():
        return sum(counts[:2].tolist())

    def read_synchronize():
        torch.cuda.synchronize()
        return 0

    def read_pinned_spin():
        pinned.copy_(counts, non_blocking=True)
        done.record()
        while not done.query():
            pass
        return int(pinned[0])

    def read_pinned_spin_sleep0():
        pinned.copy_(counts, non_blocking=True)
        done.record()
        while not done.query():
            time.sleep(0)
        return int(pinned[0])

    waits = {"no wait (GPU job, then cuDNN)": None, ".cpu() of 1024 ints": read_blocking, ".tolist() of 2 ints": read_tolist,
             "torch.cuda.synchronize()": read_synchronize, "pinned copy + spin on event.query()": read_pinned_spin,
             "pinned copy + spin with sleep(0)": read_pinned_spin_sleep0}
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        attention()
        for wait in waits.values():
            if wait is not None:
                wait()
        torch.cuda.synchronize()
        print(f"N={n} {torch.cuda.get_device_name()} torch {torch.__version__}; GPU job {args.job_cycles} cycles")
        results = {}
        for _ in range(2):  # the second round is reported
            for name, wait in waits.items():
                times, hosts = [], []
                for _ in range(args.iters):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    torch.cuda.synchronize()
                    start.record()
                    torch.cuda._sleep(args.job_cycles)
                    if wait is not None:
                        wait()
                    t0 = time.perf_counter()
                    attention()
                    hosts.append((time.perf_counter() - t0) * 1e6)
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end) * 1e3)
                results[name] = (statistics.median(times), statistics.median(hosts))
        base = results["no wait (GPU job, then cuDNN)"][0]
        for name, (us, host) in results.items():
            print(f"{name:40s} events {us:10.1f} us  (+{us - base:7.1f} over no wait)  cuDNN call's host time {host:7.1f} us")


if __name__ == "__main__":
    main()
