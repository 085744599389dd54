"""``pbs list``: registered permuters, selectors and backends."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return sub.add_parser("list", help="list registered permuters, selectors and backends")


def run(args: argparse.Namespace) -> int:
    import pbs

    print("permuters:", ", ".join(pbs.list_permuters()))
    print("selectors:", ", ".join(pbs.list_selectors()))
    print("backends: ", ", ".join(["auto", *pbs.list_backends()]))
    return 0
