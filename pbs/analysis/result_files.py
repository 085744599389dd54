"""How the analyses write their results: one JSON writer and one CSV writer for all of them, and
the git revision a result was made at."""

from __future__ import annotations

import csv
import json
import os
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

CHECKOUT = Path(__file__).resolve().parents[2]
"""The directory above the ``pbs`` package: the repository root when pbs runs from a checkout."""


def git_revision(root: str | Path | None = None) -> tuple[str | None, bool | None]:
    """``(commit, dirty)`` of the checkout at ``root`` (default `CHECKOUT`, when it holds a
    ``.git``: an installed pbs is no checkout), or ``(None, None)``.

    ``PBS_GIT_REVISION`` (``git rev-parse HEAD`` where a copy of the working tree was made for
    another machine), when set, is taken as the commit with ``dirty`` None (unknown); it wins over
    the checkout's own git, since a copied tree may carry a stale ``.git``.
    """
    if os.environ.get("PBS_GIT_REVISION"):
        return os.environ["PBS_GIT_REVISION"], None
    if root is None:
        if not (CHECKOUT / ".git").exists():
            return None, None
        root = CHECKOUT
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if head.returncode == 0:
            status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                    capture_output=True, text=True, timeout=10)
            dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
            return head.stdout.strip(), dirty
    except (OSError, subprocess.SubprocessError):
        pass
    return None, None


def write_json(data: dict[str, Any], path: str | Path) -> Path:
    """Writes ``data`` (a result's ``to_dict()``) to ``path`` as indented JSON; returns the path."""
    path = Path(path)
    path.write_text(json.dumps(data, indent=1))
    return path


def write_csv(header: Sequence[str], rows: Iterable[Sequence[Any]], path: str | Path) -> Path:
    """Writes ``header`` and then ``rows`` (each as long as the header) to ``path`` as CSV; returns the path."""
    path = Path(path)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return path
