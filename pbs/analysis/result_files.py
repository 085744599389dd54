"""How the analyses write their results: one JSON writer and one CSV writer for all of them."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


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
