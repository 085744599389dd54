"""``pbs list``: registered permuters, selectors and backends, and the named presets."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return sub.add_parser("list", help="list registered permuters, selectors and backends, and the presets")


def run(args: argparse.Namespace) -> int:
    import pbs
    from pbs.backends import get_backend
    from pbs.config import DEFAULT_PRESET

    backends = pbs.list_backends()
    tried = [name for name in backends if get_backend(name).auto_priority is not None]
    print("permuters:", ", ".join(pbs.list_permuters()))
    print("selectors:", ", ".join(pbs.list_selectors()))
    # The names pbs.list_backends() returns; "auto" is not one of them but a choice among them.
    print("backends: ", ", ".join(backends), f"(backend=\"auto\", the default, tries {', '.join(tried)} in this order)")
    print("presets:  ", ", ".join(f"{name} (default)" if name == DEFAULT_PRESET else name for name in pbs.list_presets()))
    return 0
