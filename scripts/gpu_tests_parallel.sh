#!/usr/bin/env bash
# Every GPU test at once: the test files in 8 groups, one pytest process per group, group i on GPU
# i % (GPUs on the host) (CUDA_VISIBLE_DEVICES). Most of a group's time is compiling kernels on the
# CPU, so one GPU with 16 cores runs all eight at once. On 2 H200s (48b9ef8, four groups then)
# test_paged.py alone had run 15 of its 17 tests at 430 s, so it is split three ways here, and the
# mixed group of serving, dense-policy and kernel files ran past 480 s on one H200 at 70f9bdd, so it
# is split in two; every group has TEST_TIMEOUT seconds (default 540). The groups share a GPU's memory:
# tests/conftest.py caps each GPU test's PyTorch memory (GPU_TEST_MEMORY_GIB) and each test's peak
# goes to $OUT/gpu_test_memory.log (largest first).
#   bash scripts/gpu_tests_parallel.sh        (logs in $OUT, default .gpu-out: gpu_tests.log, every group's
#                                             output in turn, and gpu_test_memory.log)
# The groups run the tests marked gpu, except the last: the files of WHOLE_FILES run whole (their
# tests run on CUDA when there is one, on the CPU otherwise: the FP8 kernels against their twin).
# Installs pydantic, pytest-benchmark and hypothesis from .device-wheels first (scripts/gpu_check.sh says how
# to download them); WHEELS=<folder> points elsewhere.
set -uo pipefail
OUT=${OUT:-.gpu-out}
mkdir -p "$OUT"
rm -f "$OUT"/gpu_test_memory_group*.log
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --find-links "${WHEELS:-.device-wheels}" pydantic pytest-benchmark hypothesis 2>&1 | grep -v WARNING
# pbs serve's GPU test needs these too (skipped without them); apart, so that their absence stops nothing else.
python3 -m pip install -q --no-index --find-links "${WHEELS:-.device-wheels}" fastapi uvicorn openai 2>&1 | grep -v WARNING
WHOLE_FILES="tests/test_fp8.py tests/test_fp8_quant.py"
groups=(
  "tests/test_kernel_gpu_selection.py -m gpu"
  "tests/test_block_sparse_attn.py tests/test_vertical_slash.py tests/test_serve.py -m gpu"
  "tests/test_hopper_attn.py tests/test_compile_and_graphs.py tests/test_kernel_flex.py tests/test_serving.py tests/test_capturable_varlen.py -m gpu"
  "tests/test_pad_rows.py tests/test_dense_fallback.py tests/test_density_probe.py tests/test_lse.py tests/test_nan_semantics.py tests/test_quality.py tests/test_testing_helpers.py tests/test_kernel_antidiagonal.py tests/test_backends.py tests/test_rank_agreement.py -m gpu"
  "tests/test_paged.py -m gpu -k bf16"
  "tests/test_paged.py -m gpu -k gluon_kernel_reads"
  "tests/test_paged.py -m gpu -k not(bf16)and(not(gluon_kernel_reads))"
  "$WHOLE_FILES"
)
gpus=$(nvidia-smi -L | wc -l)
(( gpus > 0 )) || { echo "no GPU"; exit 1; }
pids=()
for i in "${!groups[@]}"; do
  # shellcheck disable=SC2086  # a group is a list of pytest arguments
  PBS_GPU_MEMORY_LOG="$OUT/gpu_test_memory_group$i.log" CUDA_VISIBLE_DEVICES=$((i % gpus)) timeout "${TEST_TIMEOUT:-540}" python3 -m pytest ${groups[$i]} -q \
    -p no:cacheprovider -rfs > "$OUT/gpu_tests_group$i.log" 2>&1 &
  pids+=($!)
done
status=0
for i in "${!groups[@]}"; do
  wait "${pids[$i]}" || status=1
  echo "== group $i: ${groups[$i]}"
  tail -n 8 "$OUT/gpu_tests_group$i.log"
done
echo "== the GPU tests that reserved the most memory "
cat "$OUT"/gpu_test_memory_group*.log 2>/dev/null | sort -rn | tee "$OUT/gpu_test_memory.log" | head -n 5
# One log of each kind: the device tool brings back at most 8 files from $OUT, and 16 per-group
# files crowded out the results of the benchmarks that run in the same call.
for i in "${!groups[@]}"; do
  echo "== group $i: ${groups[$i]}"
  cat "$OUT/gpu_tests_group$i.log"
done > "$OUT/gpu_tests.log"
rm -f "$OUT"/gpu_tests_group*.log "$OUT"/gpu_test_memory_group*.log
exit $status
