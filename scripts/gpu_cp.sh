#!/usr/bin/env bash
# Context-parallel prefill on 4 GPUs (issue 29, point 4): benchmarks/bench_context_parallel.py, one
# Llama-3.1-8B-shaped attention layer (Hq 32, Hkv 8, D 128, bf16, random inputs) at 256K, 512K and 1M
# tokens: pbs.distributed with the defaults, the defaults planned (density rules off) and a forced density
# of 0.2, against torch's ring SDPA (context_parallel), and one GPU (rank 0 alone) at 256K and 512K.
#   bash scripts/gpu_cp.sh [smoke|4|balance] [benchmark arguments...]
# smoke: tiny shapes (4 / 2 heads of 32, fp32, 2048 and 2432 tokens) on the 4 GPUs: NCCL, the side
#        communicator and pbs's kernels on every rank, in well under a minute of running
# 4:     the measurement (about 5 minutes on 4 H100s; the script skips the rows left after 300 s), with
#        every GPU's clocks, power, temperature and throttle reasons sampled twice a second (gpu_cp_smi.csv)
# balance: scripts/cp_balance.py at 1M tokens, one process per GPU and no NCCL, each timing one rank's two
#        chunks (kernel only), all four at once: first rank r on GPU r, then rank r on GPU (r + 1) % 4, so
#        that a slow rank can be told from a slow GPU (each half took 2-3 minutes on 4 H100s: the first
#        half of the one run so far finished inside 200 s, the second did not)
# Installs nothing. NVLink multicast stays as the machine sets it (NCCL_NVLS_ENABLE=0 there): not overridden.
# Results and logs go to $OUT (default .gpu-out): cp_4gpu.json / cp_smoke.json and their .log. Pass the
# revision in where the copy of the tree has no usable .git:
#   PBS_GIT_REVISION=<git rev-parse HEAD> bash scripts/gpu_cp.sh 4
set -uo pipefail
mode=${1:-4}
shift || true
OUT=${OUT:-.gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# 1M tokens hold about 20 GiB of inputs, gathered K/V and masks per GPU: fewer fragments
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
{
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  nvidia-smi topo -m 2>/dev/null | head -n 6
  echo "NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE-unset}"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())"
} | tee "$OUT/gpu_cp_env.txt"
BENCH=benchmarks/bench_context_parallel.py
case $mode in
  smoke)
    python3 $BENCH --smoke --device cuda --world 4 --json "$OUT/cp_smoke.json" "$@" 2>&1 | tee "$OUT/cp_smoke.log"
    ;;
  4)
    nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,clocks_throttle_reasons.active \
      --format=csv -lms 500 > "$OUT/gpu_cp_smi.csv" 2>&1 &
    monitor=$!
    python3 $BENCH --world 4 --json "$OUT/cp_4gpu.json" "$@" 2>&1 | tee "$OUT/cp_4gpu.log"
    status=${PIPESTATUS[0]}
    kill $monitor
    exit $status
    ;;
  balance)
    for shift in 0 1; do
      pids=()
      for gpu in 0 1 2 3; do
        rank=$(( (gpu + shift) % 4 ))
        CUDA_VISIBLE_DEVICES=$gpu python3 scripts/cp_balance.py --ranks $rank "$@" \
          --json "$OUT/cp_balance_shift${shift}_gpu${gpu}.json" > "$OUT/cp_balance_shift${shift}_gpu${gpu}.log" 2>&1 &
        pids+=($!)
      done
      for pid in "${pids[@]}"; do wait $pid; done
      tail -n 1 "$OUT"/cp_balance_shift${shift}_gpu*.log
    done
    exit 0
    ;;
  *)
    echo "usage: bash scripts/gpu_cp.sh [smoke|4|balance] [benchmark arguments...]" >&2
    exit 2
    ;;
esac
exit "${PIPESTATUS[0]}"
