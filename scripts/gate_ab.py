"""Same-instance A/B of the density probe's read with and without the stream gate, against cuDNN.

``pbs.attention`` with the defaults reads the probe's estimate through `pbs.kernels.stream_gate`
(the stream held by a polling kernel while the host reads and launches what follows). The
``ungated`` variant swaps the gate for none (the read the probe had before: the stream runs empty
while the host waits). Both take turns with cuDNN and with cuDNN once more (A/A) in the same
rotation, in three columns as in ``benchmarks/bench_defaults.py``: events on an idle GPU, events
with GPU work queued before the call, and back-to-back wall time. Two rounds.

    python3 scripts/gate_ab.py --lengths 32768 65536 --json gate_ab.json
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pbs  # noqa: E402
import pbs.api  # noqa: E402
from pbs.testing import benchmark_cuda_interleaved  # noqa: E402

BUSY_GPU_CYCLES = 10_000_000


def qkv(kind: str, n: int):
    if kind == "structured":
        return pbs.testing.make_qkv(batch=1, heads_q=32, heads_kv=8, seq_len=n, head_dim=128,
                                    dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(n)
    q = torch.randn(1, 32, n, 128, generator=gen, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, n, 128, generator=gen, device="cuda", dtype=torch.bfloat16)
    return q, k, torch.randn_like(k)


def wall_ms(fn, calls: int) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768])
    parser.add_argument("--inputs", nargs="+", default=["flat", "structured"])
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--wall-calls", type=int, default=30)
    parser.add_argument("--json")
    args = parser.parse_args()
    gated_gate = pbs.api._probe_gate

    def ungated_gate(q):
        return contextlib.nullcontext(None)

    rows = []
    for n in args.lengths:
        for kind in args.inputs:
            q, k, v = qkv(kind, n)

            def cudnn():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

            def gated():
                pbs.api._probe_gate = gated_gate
                return pbs.attention(q, k, v)

            def ungated():
                pbs.api._probe_gate = ungated_gate
                try:
                    return pbs.attention(q, k, v)
                finally:
                    pbs.api._probe_gate = gated_gate

            fns = {"cudnn": cudnn, "gated": gated, "ungated": ungated, "cudnn_again": cudnn}
            for round_ in (1, 2):
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    idle = benchmark_cuda_interleaved(fns, warmup=2, iters=args.iters)
                    busy = benchmark_cuda_interleaved(fns, warmup=1, iters=args.iters, busy_gpu_cycles=BUSY_GPU_CYCLES)
                walls: dict[str, list[float]] = {name: [] for name in fns}
                for _ in range(3):
                    for name, fn in fns.items():
                        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION) if name.startswith("cudnn") else contextlib.nullcontext():
                            walls[name].append(wall_ms(fn, args.wall_calls))
                wall = {name: statistics.median(t) for name, t in walls.items()}
                row = {"input": kind, "seq_len": n, "round": round_, "idle_ms": idle, "busy_ms": busy, "wall_ms": wall}
                for col, t in (("idle", idle), ("busy", busy), ("wall", wall)):
                    row[f"ratio_{col}"] = {name: t[name] / t["cudnn"] for name in ("gated", "ungated", "cudnn_again")}
                rows.append(row)
                r = row
                print(f"{kind:>10} {n:>7} round {round_}: cuDNN idle {idle['cudnn']:.3f} ms | ratio idle / busy / wall: "
                      + "  ".join(f"{name} {r['ratio_idle'][name]:.3f}/{r['ratio_busy'][name]:.3f}/{r['ratio_wall'][name]:.3f}"
                                  for name in ("gated", "ungated", "cudnn_again")), flush=True)
            del q, k, v
            torch.cuda.empty_cache()
    if args.json:
        from benchmarks.common import environment, save

        save({"benchmark": "gate_ab", **environment("cuda"), "rows": rows}, args.json)


if __name__ == "__main__":
    main()
