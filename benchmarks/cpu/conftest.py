"""The suite's JSON records where it came from, as every benchmark result does: the command line and
the git revision (`benchmarks.common.provenance`)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:  # run as `pytest benchmarks/cpu` from elsewhere
    sys.path.insert(0, ROOT)

from benchmarks.common import provenance  # noqa: E402


def pytest_benchmark_update_json(config, benchmarks, output_json):
    output_json.update(provenance())
