#!/usr/bin/env bash
# GPU checks and benchmark in one call on the device machine (docs/benchmarks.md has the results):
#   bash scripts/gpu_check.sh [all|tests|bench|planning|hopper|selection|ttft|defaults|antidiagonal|lines|chunked|capturable|kernel-ab|ncu|clock|serve] [benchmark arguments...]
# tests: every GPU test; bench: the kernel benchmark (bench_kernel.py); planning: the planning breakdown
# and memory benchmarks (bench_planning.py with the arguments given, bench_plan_memory.py); hopper: the Gluon kernel's GPU tests,
# then the kernel benchmark;
# selection: every GPU test, then the planning benchmark (about 10 minutes);
# ttft: end-to-end time to first token, then the planning memory benchmark;
# defaults: the GPU tests of the dense fallback, the density probe and the Gluon kernel, the host time of each step
# of the dense path and the probe (scripts/host_overhead.py), then bench_defaults.py
# (pbs.attention with no config against cuDNN, 2K-512K, flat and structured inputs);
# antidiagonal: the antidiagonal share kernel's GPU test, then its two walks (two passes, one pass
# with partial sums in scratch) timed at strides 16 and 8, 32K and 128K (sweep_antidiagonal.py);
# lines: where a chunk's planning goes (scripts/profile_selector.py --defaults --chunk 8192 at 128K),
# then the launch sweeps of the vertical_slash line kernels (sweep_line_scores.py, row_lines and kept_lines);
# chunked: a 128K prompt in 8K and 16K chunks against one-shot (bench_chunked.py, defaults and pbs_paper),
# then 512-4K queries after 32K and 128K keys, planned sparse against dense (bench_dense_chunks.py --structured);
# capturable: the GPU tests of the serving entry points (CUDA-graph capture and replay among them), then
# bench_capturable.py (varlen_attention with capturable=True, eager and replayed, against the eager path);
# kernel-ab: a Gluon kernel change against a copy of the module from another revision (BEFORE=<file>,
# e.g. git show main:pbs/kernels/hopper_attn.py > .scratch/before.py, carried): the GPU tests of the files that run
# the Gluon kernel (contiguous, dense mode, paged), two pytest processes at once, then benchmarks/ab_kernel.py --dense --interleaved
# and scripts/kernel_tile_stamps.py against it, then both consumer warpgroups' softmax windows
# (scripts/kernel_softmax_windows.py, bf16 and e4m3); for the e4m3 kernel, add --precision fp8 --densities 0.1 0.3 0.5 1.0
# (passed to ab_kernel.py);
# ncu: Nsight Compute's warp-state samples of the Gluon kernel at 32K density 1.0, bf16 and e4m3
# (scripts/kernel_ncu_target.py under ncu --clock-control none), exported as CSV and summarized by
# stall reason and opcode over the loops over a tile's blocks (scripts/ncu_stall_summary.py);
# clock: the SM clock, power and cycles per block of the Gluon kernel (bf16, e4m3) and cuDNN dense, each run
# back to back at density 1.0, 128K and 32K (scripts/gpu_clock_under_load.py);
# serve: pbs serve's GPU test, then bench_serve_ttft.py (TTFT under load through pbs serve: 8 concurrent
# requests of 16K-64K tokens on a Llama-3.1-8B-shaped model, SDPA and PBS), with fastapi, uvicorn and
# openai installed from .device-wheels as well.
# The GPU machine has no network: it installs pydantic, pytest-benchmark and hypothesis (and for serve,
# fastapi, uvicorn and openai) from wheels in
# .device-wheels (git-ignored), downloaded beforehand on a machine with network access for the GPU
# machine's Python (3.12 there) and carried with the working tree:
#   python3 -m pip download -d .device-wheels --only-binary=:all: --python-version 3.12 \
#     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
#     pydantic pytest-benchmark hypothesis fastapi uvicorn openai
# Logs and the result JSON go to $OUT (default .gpu-out).
# Every result JSON records its command line and git revision (benchmarks/common.py); where the
# copy on the device machine has no .git, pass the revision in: PBS_GIT_REVISION=<git rev-parse HEAD>.
set -uo pipefail
mode=${1:-all}
shift || true
OUT=${OUT:-.gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --find-links .device-wheels pydantic pytest-benchmark hypothesis 2>&1 | grep -v WARNING
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
status=0
if [[ $mode == all || $mode == tests || $mode == selection ]]; then
  # The whole GPU suite took just over 300 s on an H100 (81 of ~85 tests ran before a 300 s limit);
  # "tests" alone gets 540 s, "selection" keeps 300 s so that the planning benchmark still fits.
  default_timeout=300
  [[ $mode == tests ]] && default_timeout=540
  timeout ${TEST_TIMEOUT:-$default_timeout} python3 -m pytest tests -m gpu -q -p no:cacheprovider -rf --durations=15 \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -n 40
  status=${PIPESTATUS[0]}
fi
if [[ $mode == hopper ]]; then
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest tests/test_hopper_attn.py -m gpu -q -p no:cacheprovider -x \
    2>&1 | tee "$OUT/gpu_tests_hopper.log" | tail -n 40
  status=${PIPESTATUS[0]}
  [[ $status == 0 ]] || exit $status
fi
if [[ $mode == defaults ]]; then
  timeout ${TEST_TIMEOUT:-150} python3 -m pytest tests/test_dense_fallback.py tests/test_density_probe.py tests/test_hopper_attn.py -m gpu -q -p no:cacheprovider \
    2>&1 | tee "$OUT/gpu_tests_defaults.log" | tail -n 30
  status=${PIPESTATUS[0]}
  timeout 120 python3 scripts/host_overhead.py --seq-len 2048 --probe-seq-len 32768 2>&1 | tee "$OUT/host_overhead.log"
  timeout ${DEFAULTS_TIMEOUT:-400} python3 benchmarks/bench_defaults.py --json "$OUT/defaults.json" "$@" 2>&1 | tee "$OUT/defaults.log"
fi
if [[ $mode == capturable ]]; then
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest tests/test_capturable_varlen.py tests/test_serving.py tests/test_compile_and_graphs.py \
    -m gpu -q -p no:cacheprovider -rf 2>&1 | tee "$OUT/gpu_tests_capturable.log" | tail -n 30
  status=${PIPESTATUS[0]}
  timeout ${BENCH_TIMEOUT:-240} python3 benchmarks/bench_capturable.py --json "$OUT/capturable.json" "$@" 2>&1 | tee "$OUT/capturable.log"
fi
if [[ $mode == serve ]]; then
  python3 -m pip install -q --no-index --find-links .device-wheels fastapi uvicorn openai 2>&1 | grep -v WARNING
  timeout ${TEST_TIMEOUT:-120} python3 -m pytest tests/test_serve.py -m gpu -q -p no:cacheprovider -rf \
    2>&1 | tee "$OUT/gpu_tests_serve.log" | tail -n 30
  status=${PIPESTATUS[0]}
  timeout ${BENCH_TIMEOUT:-450} python3 benchmarks/bench_serve_ttft.py --budget-s 360 --out "$OUT/serve_ttft.json" "$@" \
    2>&1 | tee "$OUT/serve_ttft.log"
fi
if [[ $mode == antidiagonal ]]; then
  timeout ${TEST_TIMEOUT:-150} python3 -m pytest tests/test_kernel_antidiagonal.py -m gpu -q -p no:cacheprovider -rf \
    2>&1 | tee "$OUT/gpu_tests_antidiagonal.log" | tail -n 20
  status=${PIPESTATUS[0]}
  for stride in 16 8; do
    timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/sweep_antidiagonal.py --stride $stride --lengths 32768 131072 \
      --variants 128,128,8,3 64,128,4,3 --walks two one --json "$OUT/antidiagonal_walks_stride$stride.json" \
      2>&1 | tee "$OUT/antidiagonal_walks_stride$stride.log" | cut -c1-200
  done
fi
if [[ $mode == lines ]]; then
  timeout 120 python3 scripts/profile_selector.py --defaults --n 131072 --chunk 8192 --rows 18 --host-rows 10 \
    > "$OUT/profile_chunk.log" 2>&1
  grep "Nq=" "$OUT/profile_chunk.log"
  for kernel in row_lines kept_lines; do
    timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/sweep_line_scores.py --kernel $kernel --json "$OUT/${kernel}_sweep.json" \
      2>&1 | tee "$OUT/${kernel}_sweep.log" | cut -c1-200
  done
fi
if [[ $mode == chunked ]]; then
  timeout ${BENCH_TIMEOUT:-400} python3 benchmarks/bench_chunked.py --budget-ms 150 --configs defaults pbs_paper \
    --json "$OUT/chunked.json" "$@" 2>&1 | tee "$OUT/chunked.log" | tail -n 40
  timeout 200 python3 benchmarks/bench_dense_chunks.py --structured --shapes 512x32768 1024x32768 2048x32768 \
    1024x131072 2048x131072 4096x131072 --json "$OUT/dense_chunks_structured.json" 2>&1 | tee "$OUT/dense_chunks_structured.log"
fi
if [[ $mode == kernel-ab ]]; then
  [[ -f ${BEFORE:-} ]] || { echo "kernel-ab needs BEFORE=<a copy of pbs/kernels/hopper_attn.py>"; exit 2; }
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest tests/test_paged.py -m gpu -k gluon_kernel_reads -q -p no:cacheprovider -rf \
    > "$OUT/gpu_tests_paged_gluon.log" 2>&1 &
  paged=$!
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest tests/test_hopper_attn.py tests/test_dense_fallback.py -m gpu -q -p no:cacheprovider -rf \
    2>&1 | tee "$OUT/gpu_tests_hopper.log" | tail -n 5
  status=${PIPESTATUS[0]}
  wait $paged || status=1
  tail -n 3 "$OUT/gpu_tests_paged_gluon.log"
  [[ $status == 0 ]] || exit $status
  timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/ab_kernel.py --before "$BEFORE" --dense --interleaved --json "$OUT/kernel_ab.json" "$@" \
    2>&1 | tee "$OUT/kernel_ab.log" | grep "^N="
  timeout 120 python3 scripts/kernel_tile_stamps.py --before "$BEFORE" --json "$OUT/tile_stamps.json" 2>&1 | cut -c1-600
  timeout 120 python3 scripts/kernel_softmax_windows.py --json "$OUT/softmax_windows.json" 2>&1 | cut -c1-600
fi
if [[ $mode == ncu ]]; then
  for p in native fp8; do
    timeout 300 ncu --clock-control none -k regex:_hopper_block_sparse_attn_fwd --launch-skip 1 --launch-count 1 \
      --section WarpStateStats --section SourceCounters --section SchedulerStats --section ComputeWorkloadAnalysis \
      -f -o "$OUT/ncu_$p" python3 scripts/kernel_ncu_target.py --precision $p 2>&1 | tail -n 3
    ncu -i "$OUT/ncu_$p.ncu-rep" --page details --csv > "$OUT/ncu_${p}_details.csv"
    ncu -i "$OUT/ncu_$p.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_${p}_sass.csv"
  done
  python3 scripts/ncu_stall_summary.py native="$OUT/ncu_native" fp8="$OUT/ncu_fp8" \
    --profiled "scripts/kernel_ncu_target.py --n 32768 --density 1.0, bf16 and fp8" --json "$OUT/ncu_stalls.json" | cut -c1-300
fi
if [[ $mode == clock ]]; then
  for n in 131072 32768; do
    timeout ${BENCH_TIMEOUT:-200} python3 scripts/gpu_clock_under_load.py --n $n --json "$OUT/clock_under_load_$n.json" 2>&1 | tail -n 3
  done
fi
if [[ $mode == all || $mode == bench || $mode == hopper ]]; then
  timeout ${BENCH_TIMEOUT:-320} python3 benchmarks/bench_kernel.py --json "$OUT/bench_kernel.json" "$@" 2>&1 | tee "$OUT/bench.log"
fi
if [[ $mode == all || $mode == planning || $mode == selection ]]; then
  planning_args=()
  [[ $mode == planning ]] && planning_args=("$@")
  timeout ${PLANNING_TIMEOUT:-330} python3 benchmarks/bench_planning.py --json "$OUT/planning.json" "${planning_args[@]}" 2>&1 | tee "$OUT/planning.log"
fi
if [[ $mode == all || $mode == planning || $mode == ttft ]]; then
  timeout ${MEMORY_TIMEOUT:-120} python3 benchmarks/bench_plan_memory.py --json "$OUT/plan_memory.json" 2>&1 | tee "$OUT/plan_memory.log"
fi
if [[ $mode == ttft ]]; then
  timeout ${TTFT_TIMEOUT:-300} python3 benchmarks/bench_ttft.py --out "$OUT/ttft.json" 2>&1 | tee "$OUT/ttft.log" | tail -n 20
fi
exit $status
