"""``pbs demo``: the command-line face of `pbs.demo`."""

from __future__ import annotations

import argparse

from pbs.backends import list_backends
from pbs.cli.common import (
    DTYPES,
    UsageError,
    check_device,
    check_output_file,
    config_error_message,
    default_device,
    positive_int,
    unit_interval,
)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    import pbs
    from pbs.demo import DEFAULT_SELECTORS

    demo = sub.add_parser(
        "demo",
        help="compare dense, block-sparse and PBS attention on a synthetic workload",
        description=(
            "Runs dense attention, then each selector without permutation and with --permuter, on the "
            "synthetic workload, and prints density, coverage and error twice: at the same threshold, and "
            "at equal density (the unpermuted selector re-run at the threshold that reaches each PBS row's "
            "density); then the library's default config on the same inputs."
        ),
    )
    demo.add_argument("--seq-len", type=positive_int, default=8192, help="tokens (default 8192)")
    demo.add_argument("--heads-q", type=positive_int, default=8)
    demo.add_argument("--heads-kv", type=positive_int, default=2)
    demo.add_argument("--head-dim", type=positive_int, default=64)
    demo.add_argument("--batch", type=positive_int, default=1)
    demo.add_argument("--block-size", type=positive_int, default=128, help="tokens per block (default 128)")
    demo.add_argument("--segment-size", type=positive_int, default=256, help="tokens per permutation segment (default 256)")
    demo.add_argument("--permuter", choices=pbs.list_permuters(), default="last_block", metavar="NAME",
                      help=f"permuter of the PBS rows (default last_block; choices: {', '.join(pbs.list_permuters())})")
    demo.add_argument("--selector", nargs="+", choices=pbs.list_selectors(), default=list(DEFAULT_SELECTORS),
                      metavar="NAME", dest="selectors",
                      help=f"selectors, each run without and with permutation (default: {' '.join(DEFAULT_SELECTORS)}; "
                           f"choices: {', '.join(pbs.list_selectors())})")
    demo.add_argument("--threshold", type=unit_interval, default=0.9,
                      help="selection threshold tau (default 0.9); sets budget's density and oracle's coverage")
    demo.add_argument("--no-equal-density", action="store_true",
                      help="skip the equal-density view (its threshold search and extra runs)")
    demo.add_argument("--no-defaults", action="store_true",
                      help="skip the last row, the library's default config (PBSConfig()) on the same inputs")
    demo.add_argument("--device", type=check_device, default=default_device(), help="cpu or cuda (default: cuda if available)")
    demo.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    demo.add_argument("--backend", choices=["auto", *list_backends()], default="auto",
                      help="attention backend (default auto: the fastest that can run the call)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    demo.add_argument("--quiet", action="store_true", help="no progress lines")
    return demo


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from pbs.config import PBSConfig
    from pbs.demo import format_result, rows_to_json, run_demo

    if args.heads_q % args.heads_kv:
        raise UsageError(f"--heads-q ({args.heads_q}) must be a multiple of --heads-kv ({args.heads_kv})")
    check_output_file(args.json, "--json")
    try:
        result = run_demo(
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
            block_size=args.block_size,
            segment_size=args.segment_size,
            permuter=args.permuter,
            selectors=args.selectors,
            equal_density=not args.no_equal_density,
            defaults=not args.no_defaults,
        )
    except (ValidationError, ValueError) as exc:  # a config or a backend that cannot run; raised before any row
        raise UsageError(config_error_message(exc)) from None
    defaults_permuter = PBSConfig().permuter.name
    defaults_note = "" if args.no_defaults else (
        " (the defaults row permutes nothing)" if defaults_permuter == "none"
        else f" (the defaults row: permuter {defaults_permuter})"
    )
    print(
        f"pbs demo: B={args.batch} Hq={args.heads_q} Hkv={args.heads_kv} N={args.seq_len} D={args.head_dim} "
        f"{args.dtype} on {args.device}, block {args.block_size}, segment {args.segment_size}, "
        f"permuter {args.permuter} in the PBS rows{defaults_note}, backend {args.backend}"
    )
    print(format_result(result))
    if args.json:
        with open(args.json, "w") as f:
            f.write(rows_to_json(result))
    return 0
