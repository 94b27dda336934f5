#!/usr/bin/env bash
# One command on a GPU machine: build the cuDNN extension, run the GPU lane
# (python -m pytest tests -m gpu: the cuDNN tests, every context-parallel
# strategy with cuDNN blocks on this machine's GPUs, the 2-process GPU ring)
# and write its summary, results/gpu_tests_<count>x<GPU>.txt, to $OUT.
#   bash benchmarks/gpu_tests.sh [WORKERS]    # pytest-xdist processes, 4
# LANE_SECONDS bounds pytest (default 0: no bound), for jobs with a time limit;
# TESTS narrows it to some test files (default: tests).
# The workers share the GPUs (no preallocation); each compiles on the host,
# which bounds the lane: on 2 H200s, 4 workers ran 231 of its 237 tests in
# 595 s, so give a machine of several GPUs more workers (2 H200s: 32 cores).
set -uo pipefail
. benchmarks/gpu_setup.sh || exit 1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAX_RING_TEST_RECORD="$OUT/gpu_cases.jsonl"
rm -f "$JAX_RING_TEST_RECORD"
command="python -m pytest ${TESTS:-tests} -m gpu -n ${1:-4}"
start=$(date +%s)
# Interrupted (SIGINT) after LANE_SECONDS, pytest still writes its report,
# so the summary holds what ran.
timeout -s INT "${LANE_SECONDS:-0}" \
  $command -q -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml" 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -40
status=${PIPESTATUS[0]}
python3 benchmarks/gpu_tests.py --junit "$OUT/gpu_tests.xml" \
  --record "$JAX_RING_TEST_RECORD" --seconds $(( $(date +%s) - start )) \
  --command "$command" --out "$OUT"
exit "$status"
