#!/usr/bin/env bash
# Context-parallel TTFT of a Llama-3.1-8B-shaped model on 4 GPUs (issue 29, point 5):
# benchmarks/bench_cp_ttft.py, the whole model (random bf16 weights, 16 GB) on every GPU and the 512K-token
# prompt split over them by pbs.integrations.context_parallel: pbs at density 0.2, the defaults (dense by the
# probe on random weights) and every layer dense, with peak memory per GPU and the last logits at 32K against
# one process.
#   bash scripts/gpu_cp_ttft.sh [smoke|4] [benchmark arguments...]
# smoke: the tiny model (2 layers, hidden 256) at 2048 and 3000 tokens on the 4 GPUs, in about a minute
# 4:     the measurement (estimated 5 minutes on 4 H100s, 8 at most: rows left after 450 s are skipped)
# Installs nothing. NVLink multicast stays as the machine sets it: not overridden. Results and logs go to
# $OUT (default .gpu-out): cp_ttft_4gpu.json / cp_ttft_smoke.json and their .log. Pass the revision in where
# the copy of the tree has no usable .git:
#   PBS_GIT_REVISION=<git rev-parse HEAD> bash scripts/gpu_cp_ttft.sh 4
set -uo pipefail
mode=${1:-4}
shift || true
OUT=${OUT:-.gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
{
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  echo "NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE-unset}"
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'nccl', torch.cuda.nccl.version())"
} | tee "$OUT/gpu_cp_ttft_env.txt"
BENCH=benchmarks/bench_cp_ttft.py
case $mode in
  smoke)
    python3 $BENCH --smoke --device cuda --world 4 --json "$OUT/cp_ttft_smoke.json" "$@" 2>&1 | tee "$OUT/cp_ttft_smoke.log"
    ;;
  4)
    python3 $BENCH --world 4 --json "$OUT/cp_ttft_4gpu.json" "$@" 2>&1 | tee "$OUT/cp_ttft_4gpu.log"
    ;;
  *)
    echo "usage: bash scripts/gpu_cp_ttft.sh [smoke|4] [benchmark arguments...]" >&2
    exit 2
    ;;
esac
exit "${PIPESTATUS[0]}"
