#!/usr/bin/env bash
# Tensor-parallel prefill on a machine with 2 GPUs (issue 29, point 1): benchmarks/bench_tensor_parallel.py,
# a Llama-3.1-8B-shaped model with random bf16 weights, TTFT at 128K and 256K for sdpa, pbs's defaults
# and pbs at a forced density of 0.2, peak memory per GPU, and the tensor-parallel logits against the
# unsharded model at 32K.
#   bash scripts/gpu_tp.sh [smoke|1|2|both|combine] [benchmark arguments...]
# smoke:   the tiny model (2 layers, hidden 256) on both GPUs, 512 and 1024 tokens: NCCL, the loading and
#          pbs's kernels on cuda:1 in well under a minute of running
# 1:       world 1, the whole model on GPU 0 (one timed run at 256K): about 6 minutes on an H100
# 2:       world 2, tensor parallelism over both GPUs: about 5 minutes on H100s; takes world 1's result
#          as its baseline (speed-up, scaling efficiency) when an earlier call left it in .gpu-out/tp/
# both:    1 then 2 (about 11 minutes: more than one 10-minute device command; prefer two calls)
# combine: no GPU work: the table of every result in .gpu-out/tp/ and $OUT/tp_combined.json
# Installs nothing: torch, transformers, einops and pydantic must be installed already.
# Results and logs go to $OUT (default .gpu-out): tp_world1.json, tp_world2.json, tp_combined.json (once
# both exist), tp_smoke.json, with their .log; copies stay in .gpu-out/tp/ (git-ignored) for the next call
# while the machine stays warm. Pass the revision in where the copy of the tree has no usable .git:
#   PBS_GIT_REVISION=<git rev-parse HEAD> bash scripts/gpu_tp.sh 2
set -uo pipefail
mode=${1:-2}
shift || true
OUT=${OUT:-.gpu-out}
KEEP=.gpu-out/tp
mkdir -p "$OUT" "$KEEP"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0  # NVLink multicast off on the lent machines
# fewer fragments: world 1 at 256K needs about 76 GiB of an H100's 79 (estimated from bench_ttft's 128K peak)
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
BENCH=benchmarks/bench_tensor_parallel.py
nvidia-smi --query-gpu=index,name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu_tp_env.txt"
nvidia-smi topo -m 2>/dev/null | head -n 4 | tee -a "$OUT/gpu_tp_env.txt"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" \
  | tee -a "$OUT/gpu_tp_env.txt"
status=0

keep() {  # keep a result for later calls (while the machine stays warm)
  [[ -f $OUT/$1 && $OUT != "$KEEP" ]] && cp "$OUT/$1" "$KEEP/$1"
  return 0
}

if [[ $mode == smoke ]]; then
  timeout ${SMOKE_TIMEOUT:-240} python3 $BENCH --smoke --world 2 --json "$OUT/tp_smoke.json" "$@" 2>&1 | tee "$OUT/tp_smoke.log"
  status=${PIPESTATUS[0]}
fi
if [[ $mode == 1 || $mode == both ]]; then
  # rows still to run after 480 s are skipped (recorded as such): the 600 s command limit stays clear
  CUDA_VISIBLE_DEVICES=${TP1_GPU:-0} timeout ${TP1_TIMEOUT:-590} python3 $BENCH --world 1 --long-repeats 1 --budget-s 480 \
    --json "$OUT/tp_world1.json" "$@" 2>&1 | tee "$OUT/tp_world1.log"
  status=${PIPESTATUS[0]}
  keep tp_world1.json
fi
if [[ $mode == 2 || $mode == both ]]; then
  baseline=()
  [[ -f $KEEP/tp_world1.json ]] && baseline=(--baseline "$KEEP/tp_world1.json")
  timeout ${TP2_TIMEOUT:-590} python3 $BENCH --world 2 --budget-s 480 "${baseline[@]}" \
    --json "$OUT/tp_world2.json" "$@" 2>&1 | tee "$OUT/tp_world2.log"
  s=${PIPESTATUS[0]}
  [[ $s != 0 ]] && status=$s
  keep tp_world2.json
fi
if [[ -f $KEEP/tp_world1.json && -f $KEEP/tp_world2.json ]] && [[ $mode != smoke ]]; then
  python3 $BENCH --combine "$KEEP/tp_world1.json" "$KEEP/tp_world2.json" --json "$OUT/tp_combined.json" \
    2>&1 | tee "$OUT/tp_combined.log"
fi
exit $status
