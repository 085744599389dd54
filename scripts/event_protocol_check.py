"""Why a CUDA-event ratio can exceed 1 while both calls run the same kernel: host time before launch.

`benchmarks/bench_defaults.py` times each call with CUDA events after an L2 flush, on an otherwise
idle GPU. When a call spends longer on the host before its first launch than the flush takes on
the GPU (about 80 us on an H100), the GPU idles and the event time grows by the difference. This
script times cuDNN, ``pbs.attention`` (defaults) and ``pbs.dense.dense_attention_sdpa`` in turn,
``--iters`` times each, and prints the 10th/50th/90th percentile event times and the host time of
the call itself, first after the flush alone and then with a GPU spin of about a millisecond
queued after the flush (the GPU is busy while the host launches, as in a model's layer loop), which
leaves the device time alone.

    python3 scripts/event_protocol_check.py --lengths 8192 16384
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import pbs
from pbs.dense import dense_attention_sdpa


def inputs(kind: str, n: int):
    if kind == "structured":
        return pbs.testing.make_qkv(batch=1, heads_q=32, heads_kv=8, seq_len=n, head_dim=128,
                                    dtype=torch.bfloat16, device="cuda")
    q = torch.randn(1, 32, n, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, n, 128, device="cuda", dtype=torch.bfloat16)
    return q, k, torch.randn_like(k)


def measure(n: int, kind: str, spin: bool, iters: int) -> None:
    q, k, v = inputs(kind, n)
    fns = {
        "cudnn": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        "pbs": lambda: pbs.attention(q, k, v),
        "sdpa_path": lambda: dense_attention_sdpa(q, k, v, scale=128**-0.5),
    }
    scratch = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    times: dict[str, list[float]] = {name: [] for name in fns}
    host: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        for fn in fns.values():
            fn()
        torch.cuda.synchronize()
        for i in range(iters):
            for name in names[i % 3:] + names[:i % 3]:
                scratch.zero_()
                if spin:
                    torch.cuda._sleep(2_000_000)  # about a millisecond of GPU clock cycles
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                t0 = time.perf_counter()
                fns[name]()
                host[name].append(time.perf_counter() - t0)
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end))
    for name in names:
        t, h = sorted(times[name]), sorted(host[name])
        p = lambda xs, f: xs[int(f * (len(xs) - 1))]  # noqa: E731
        print(f"N={n} {kind} spin={spin} {name:9s} events p10 {p(t, .1):.4f} p50 {p(t, .5):.4f} p90 {p(t, .9):.4f} ms"
              f" | host p50 {p(h, .5) * 1e6:.0f} us p90 {p(h, .9) * 1e6:.0f} us", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--iters", type=int, default=150)
    parser.add_argument("--inputs", nargs="+", default=["flat", "structured"], choices=["flat", "structured"])
    parser.add_argument("--spin-inputs", nargs="*", default=["structured"], choices=["flat", "structured"],
                        help="inputs timed a second time with the GPU spin")
    args = parser.parse_args()
    for n in args.lengths:
        for kind in args.inputs:
            measure(n, kind, False, args.iters)
        for kind in args.spin_inputs:
            measure(n, kind, True, args.iters)


if __name__ == "__main__":
    main()
