#!/usr/bin/env bash
# Host-side (CPU) benchmarks of the reference permuters and selectors (pytest-benchmark).
# Writes benchmarks/cpu/full_run.json (git-ignored; benchmarks/results/ keeps only files the docs
# cite) with full-length timings. The normal test run (pytest -q) also runs them, briefly, into
# benchmarks/cpu/last_run.json (git-ignored).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python3 -m pytest benchmarks/cpu --benchmark-only --benchmark-json benchmarks/cpu/full_run.json \
    -p no:cacheprovider -o addopts="" "$@"
