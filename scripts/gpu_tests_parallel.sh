#!/usr/bin/env bash
# Every GPU test at once on a host of several GPUs: the test files in 4 groups, one pytest process per group,
# group i on GPU i % (GPUs on the host) (CUDA_VISIBLE_DEVICES), so that 2 GPUs run two groups each at once.
# On 2 H200s (48b9ef8, two groups per GPU) group 0 took 306 s, group 1 291 s, group 2 220 s and then 53 s for
# the whole FP8 files; group 3, then test_paged.py and the ten files now in group 2, had run 15 tests (all in
# test_paged.py) at 430 s, so test_paged.py is a group alone and the limit per group is 540 s (TEST_TIMEOUT).
#   bash scripts/gpu_tests_parallel.sh        (logs in $OUT, default .gpu-out: gpu_tests_group<N>.log)
# The groups run the tests marked gpu; the files of WHOLE_FILES run whole (their tests run on CUDA when
# there is one, on the CPU otherwise: the FP8 kernels against their twin).
# Installs pydantic, pytest-benchmark and hypothesis from .device-wheels first (scripts/gpu_check.sh says how
# to download them); WHEELS=<folder> points elsewhere.
set -uo pipefail
OUT=${OUT:-.gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --find-links "${WHEELS:-.device-wheels}" pydantic pytest-benchmark hypothesis 2>&1 | grep -v WARNING
# pbs serve's GPU test needs these too (skipped without them); apart, so that their absence stops nothing else.
python3 -m pip install -q --no-index --find-links "${WHEELS:-.device-wheels}" fastapi uvicorn openai 2>&1 | grep -v WARNING
WHOLE_FILES="tests/test_fp8.py tests/test_fp8_quant.py"
groups=(
  "tests/test_kernel_gpu_selection.py"
  "tests/test_block_sparse_attn.py tests/test_vertical_slash.py tests/test_serve.py"
  "tests/test_hopper_attn.py tests/test_compile_and_graphs.py tests/test_kernel_flex.py tests/test_serving.py tests/test_capturable_varlen.py tests/test_pad_rows.py tests/test_dense_fallback.py tests/test_density_probe.py tests/test_lse.py tests/test_nan_semantics.py tests/test_quality.py tests/test_testing_helpers.py tests/test_kernel_antidiagonal.py tests/test_backends.py tests/test_rank_agreement.py"
  "tests/test_paged.py"
)
gpus=$(nvidia-smi -L | wc -l)
(( gpus > 0 )) || { echo "no GPU"; exit 1; }
pids=()
for i in 0 1 2 3; do
  (
    # shellcheck disable=SC2086  # a group is a list of files
    CUDA_VISIBLE_DEVICES=$((i % gpus)) timeout ${TEST_TIMEOUT:-540} python3 -m pytest ${groups[$i]} -m gpu -q \
      -p no:cacheprovider -rf
    status=$?
    if (( i == 1 )); then  # a group that ends early runs the whole files after its own
      # shellcheck disable=SC2086
      CUDA_VISIBLE_DEVICES=$((i % gpus)) timeout ${TEST_TIMEOUT:-540} python3 -m pytest $WHOLE_FILES -q \
        -p no:cacheprovider -rf || status=1
    fi
    exit $status
  ) > "$OUT/gpu_tests_group$i.log" 2>&1 &
  pids+=($!)
done
status=0
for i in 0 1 2 3; do
  wait "${pids[$i]}" || status=1
  echo "== group $i: ${groups[$i]}$( (( i == 1 )) && echo " then $WHOLE_FILES")"
  tail -n 8 "$OUT/gpu_tests_group$i.log"
done
exit $status
