"""Why one rank of context parallelism idles: each rank's two chunks timed alone on one GPU.

Context parallelism at 1M tokens on 4 GPUs left rank 0 busy 934 ms and the others 710-728 ms
at a forced density of 0.2 (`benchmarks/results/distributed/cp_4gpu_h100.json`), although the
zigzag split gives every rank the same number of causal query-key pairs. This script runs on one
GPU what each rank runs: for rank ``r`` of ``P``, chunks ``r`` and ``2P - 1 - r`` as cached-prefix
calls (the chunk's queries against every key up to its end), planned by `pbs.attention` with
``return_plan`` and then timed as `pbs.run` of the plan (attention only, L2 flushed), with the
plan's blocks, its longest row and the backend that ran it. If the per-rank sums differ as on
4 GPUs, the imbalance is in the kernel's work, not in the communication.

    python3 scripts/cp_balance.py --seq-len 1048576 --world 4 --json .gpu-out/cp_balance.json
    python3 scripts/cp_balance.py --device cpu --seq-len 4096 --heads 2 1 --head-dim 32 --dtype float32  # smoke
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pbs  # noqa: E402
from benchmarks.common import environment, save, time_ms  # noqa: E402
from pbs.distributed.sharding import chunk_bounds  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=1 << 20)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--heads", type=int, nargs=2, default=(32, 8), metavar=("HQ", "HKV"))
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--density", type=float, default=0.2)
    parser.add_argument("--budget-ms", type=float, default=1000, help="timing budget per chunk")
    parser.add_argument("--repeats", type=int, default=1, help="medians of time_ms (each 9 runs at least)")
    parser.add_argument("--ranks", type=int, nargs="*", help="time these ranks only (default: every rank)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    q, k, v = pbs.testing.make_qkv(batch=1, heads_q=args.heads[0], heads_kv=args.heads[1], seq_len=args.seq_len,
                                   head_dim=args.head_dim, dtype=dtype, device=args.device)
    config = {"selector": {"name": "budget", "density": args.density}, "check_finite": False,
              "dense_fallback": {"min_seq_len": 0, "max_density": None}}
    rows = []
    chunks = chunk_bounds(args.seq_len, args.world)
    ranks = range(args.world) if args.ranks is None else args.ranks
    for rank in ranks:
        for start, end in (chunks[rank], chunks[2 * args.world - 1 - rank]):
            qc, kc, vc = q[:, :, start:end], k[:, :, :end], v[:, :, :end]
            _, plan = pbs.attention(qc, kc, vc, config, return_plan=True)
            counts = plan.mask.counts.long()
            if qc.is_cuda:
                kernel_ms = time_ms(lambda: pbs.run(plan, qc, kc, vc), budget_ms=args.budget_ms,
                                    repeats=args.repeats)
            else:  # the smoke run: one wall-clock run
                began = time.perf_counter()
                pbs.run(plan, qc, kc, vc)
                kernel_ms = (time.perf_counter() - began) * 1e3
            rows.append({"rank": rank, "chunk": [start, end], "backend": plan.backend, "kernel_ms": kernel_ms,
                         "blocks": int(counts.sum()), "longest_row": int(counts.max()),
                         "density": plan.density})
            print(rows[-1], flush=True)
    per_rank = {rank: sum(r["kernel_ms"] for r in rows if r["rank"] == rank) for rank in ranks}
    blocks = {rank: sum(r["blocks"] for r in rows if r["rank"] == rank) for rank in ranks}
    print("kernel ms per rank", {rank: round(t, 1) for rank, t in per_rank.items()}, "blocks per rank", blocks)
    if args.json:
        save({"benchmark": "cp_balance", "environment": environment(), "seq_len": args.seq_len,
                         "world": args.world, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "heads": list(args.heads), "head_dim": args.head_dim,
                         "dtype": args.dtype, "config": config, "rows": rows, "kernel_ms_per_rank": per_rank,
                         "blocks_per_rank": blocks}, args.json)


if __name__ == "__main__":
    main()
