"""``pbs demo``: the command-line face of :mod:`pbs.demo`."""

from __future__ import annotations

import argparse
import sys

import torch

from pbs.cli import DTYPES, positive_int, unit_interval


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    demo = sub.add_parser("demo", help="compare dense, block-sparse and PBS attention on a synthetic workload")
    demo.add_argument("--seq-len", type=positive_int, default=8192, help="tokens (default 8192)")
    demo.add_argument("--heads-q", type=positive_int, default=8)
    demo.add_argument("--heads-kv", type=positive_int, default=2)
    demo.add_argument("--head-dim", type=positive_int, default=64)
    demo.add_argument("--batch", type=positive_int, default=1)
    demo.add_argument("--threshold", type=unit_interval, default=0.9, help="selection threshold tau (default 0.9)")
    demo.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    demo.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    demo.add_argument("--backend", choices=["auto", "reference", "triton", "flex"], default="auto")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    demo.add_argument("--quiet", action="store_true", help="no progress lines")
    return demo


def run(args: argparse.Namespace) -> int:
    from pbs.demo import format_table, rows_to_json, run_demo

    if args.heads_q % args.heads_kv:
        print(f"pbs demo: --heads-q ({args.heads_q}) must be a multiple of --heads-kv ({args.heads_kv})", file=sys.stderr)
        return 2
    rows = run_demo(
        seq_len=args.seq_len,
        heads_q=args.heads_q,
        heads_kv=args.heads_kv,
        head_dim=args.head_dim,
        batch=args.batch,
        threshold=args.threshold,
        device=args.device,
        dtype=DTYPES[args.dtype],
        backend=args.backend,
        seed=args.seed,
        progress=not args.quiet,
    )
    print(
        f"pbs demo: B={args.batch} Hq={args.heads_q} Hkv={args.heads_kv} N={args.seq_len} D={args.head_dim} "
        f"{args.dtype} on {args.device}, block 128, segment 256, threshold {args.threshold}"
    )
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            f.write(rows_to_json(rows, **{k: str(v) for k, v in vars(args).items() if not k.startswith("_")}))
    return 0
