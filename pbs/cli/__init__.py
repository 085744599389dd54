"""The ``pbs`` command line: the dispatcher.

Each subcommand lives in its own module of this package, named after the command
(``pbs.cli.demo``, ``pbs.cli.list``, ``pbs.cli.generate``, ``pbs.cli.analyze``,
``pbs.cli.quality``), exposing ``add_parser(subparsers)`` and ``run(args) -> int``; what they share
(dtype names, argparse value checks, `pbs.cli.common.UsageError`) is in `pbs.cli.common`. A module
imports what its command needs when the command runs, so ``pbs --help`` and ``import pbs`` stay light.

A user mistake ends in one line on stderr and exit status 2, never a traceback: argparse's own
errors come with the subcommand's usage, those found later (`pbs.cli.common.UsageError`) alone.
Ctrl-C ends any command with one line, ``pbs <command>: interrupted``, and exit status 130 (the
shell's 128 + SIGINT). A process that ``pbs generate --tp`` started under torchrun reports either
to the launching process instead (`pbs.cli.generate.report_to_launcher`), which prints the one line.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pbs.cli.common import UsageError, close_match_hint

# In the order ``pbs --help`` lists them. (Importing ``pbs.cli.list`` binds the name ``list`` in
# this module to it, so this module never calls the builtin ``list``.)
SUBCOMMANDS: tuple[str, ...] = ("demo", "list", "generate", "analyze", "quality", "serve")


def build_parser() -> argparse.ArgumentParser:
    import pbs

    parser = argparse.ArgumentParser(prog="pbs", description="Permuted Block-Sparse Attention")
    parser.add_argument("--version", action="version", version=f"pbs-attn {pbs.__version__}",
                        help="print the installed version of pbs-attn (this package's install name) and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"{__name__}.{name}")
        subparser = module.add_parser(sub)
        subparser.set_defaults(_run=module.run, _parser=subparser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs ``pbs <command> ...``; returns the exit status (2 for a user mistake)."""
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:
        # parse_args would report these with the top-level usage; the subcommand's is the one to read.
        _reject_unknown(args._parser, unknown)
    try:
        return int(args._run(args))
    except UsageError as exc:
        return _report(args, f"{args._parser.prog}: error: {exc}", 2)
    except KeyboardInterrupt:
        return _report(args, f"{args._parser.prog}: interrupted", INTERRUPTED)


INTERRUPTED = 130
"""The exit status after Ctrl-C: 128 + SIGINT, as a shell reports a process that SIGINT ended."""


def _report(args: argparse.Namespace, line: str, status: int) -> int:
    """Prints ``line`` on stderr (a torchrun rank of ``pbs generate --tp`` hands it to its launcher
    instead) and returns ``status``."""
    from pbs.cli.generate import report_to_launcher

    if not report_to_launcher(line, status):
        print(line, file=sys.stderr, flush=True)
    return status


def _reject_unknown(parser: argparse.ArgumentParser, unknown: list[str]) -> None:
    options = [option for action in parser._actions for option in action.option_strings]
    first_option = next((arg.split("=")[0] for arg in unknown if arg.startswith("-")), None)
    hint = close_match_hint(first_option, options) if first_option else ""
    parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")


if __name__ == "__main__":
    raise SystemExit(main())
