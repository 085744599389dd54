"""``pbs list``: registered permuters, selectors and backends, and the named presets."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return sub.add_parser("list", help="list registered permuters, selectors and backends, and the presets")


def run(args: argparse.Namespace) -> int:
    import pbs
    from pbs.config import DEFAULT_PRESET, PRESETS

    print("permuters:", ", ".join(pbs.list_permuters()))
    print("selectors:", ", ".join(pbs.list_selectors()))
    print("backends: ", ", ".join(["auto", *pbs.list_backends()]))
    print("presets:  ", ", ".join(f"{name} (default)" if name == DEFAULT_PRESET else name for name in PRESETS))
    return 0
