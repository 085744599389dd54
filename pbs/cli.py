"""The ``pbs`` command line: ``pbs demo``, ``pbs list`` and the subcommands features add."""

from __future__ import annotations

import argparse

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def unit_interval(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


# Each subcommand lives in its own module exposing ``add_parser(subparsers)`` and ``run(args) -> int``,
# so a feature adds its command without touching the others.
SUBCOMMAND_MODULES: tuple[str, ...] = ("pbs.demo_cli", "pbs.list_cli", "pbs.integrations.cli", "pbs.analysis.cli", "pbs.analysis.quality_cli")


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(prog="pbs", description="Permuted Block-Sparse Attention")
    sub = parser.add_subparsers(dest="command", required=True)
    for module_name in SUBCOMMAND_MODULES:
        module = importlib.import_module(module_name)
        module.add_parser(sub).set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args))


if __name__ == "__main__":
    raise SystemExit(main())
