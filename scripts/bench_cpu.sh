#!/usr/bin/env bash
# Host-side (CPU) benchmarks of the reference permuters and selectors (pytest-benchmark).
# Writes benchmarks/results/cpu_host.json. The normal test run neither collects nor times these.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p benchmarks/results
python3 -m pytest benchmarks/cpu --benchmark-only --benchmark-json benchmarks/results/cpu_host.json \
    -p no:cacheprovider -o addopts="" "$@"
