"""The ``pbs`` command line: the dispatcher.

Each subcommand lives in its own module of this package, named after the command
(``pbs.cli.demo``, ``pbs.cli.list``, ``pbs.cli.generate``, ``pbs.cli.analyze``,
``pbs.cli.quality``), exposing ``add_parser(subparsers)`` and ``run(args) -> int``; what they share
(dtype names, argparse value checks) is in `pbs.cli.common`. A module imports what its command needs
when the command runs, so ``pbs --help`` and ``import pbs`` stay light.
"""

from __future__ import annotations

import argparse
import importlib

# In the order ``pbs --help`` lists them. (Importing ``pbs.cli.list`` binds the name ``list`` in
# this module to it, so this module never calls the builtin ``list``.)
SUBCOMMANDS: tuple[str, ...] = ("demo", "list", "generate", "analyze", "quality")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pbs", description="Permuted Block-Sparse Attention")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"{__name__}.{name}")
        module.add_parser(sub).set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args))


if __name__ == "__main__":
    raise SystemExit(main())
