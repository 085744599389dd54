"""The ``pbs`` command line: ``pbs demo``, ``pbs list``."""

from __future__ import annotations

import argparse
import sys

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _threshold(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pbs", description="Permuted Block-Sparse Attention")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="compare dense, block-sparse and PBS attention on a synthetic workload")
    demo.add_argument("--seq-len", type=_positive_int, default=8192, help="tokens (default 8192)")
    demo.add_argument("--heads-q", type=_positive_int, default=8)
    demo.add_argument("--heads-kv", type=_positive_int, default=2)
    demo.add_argument("--head-dim", type=_positive_int, default=64)
    demo.add_argument("--batch", type=_positive_int, default=1)
    demo.add_argument("--threshold", type=_threshold, default=0.9, help="selection threshold tau (default 0.9)")
    demo.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    demo.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    demo.add_argument("--backend", choices=["auto", "reference", "triton", "flex"], default="auto")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    demo.add_argument("--quiet", action="store_true", help="no progress lines")

    sub.add_parser("list", help="list registered permuters, selectors and backends")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "list":
        import pbs

        print("permuters:", ", ".join(pbs.list_permuters()))
        print("selectors:", ", ".join(pbs.list_selectors()))
        print("backends: ", ", ".join(["auto", *pbs.list_backends()]))
        return 0
    if args.command == "demo":
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
            dtype=_DTYPES[args.dtype],
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
                f.write(rows_to_json(rows, **{k: str(v) for k, v in vars(args).items()}))
        return 0
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
