#!/usr/bin/env bash
# One command on a GPU machine: build the cuDNN extension, run the GPU lane
# (python -m pytest tests -m gpu: the cuDNN tests, every context-parallel
# strategy with cuDNN blocks on this machine's GPUs, decoding and generation
# with the cache over the GPUs, the multi-process GPU rings) and write its
# summary, results/gpu_tests_<count>x<GPU>.txt, to $OUT.
#   bash benchmarks/gpu_tests.sh [WORKERS]    # pytest-xdist processes, 4
# LANE_SECONDS bounds pytest (default 0: no bound), for jobs with a time limit;
# TESTS narrows it to some test files (default: tests).
# LANE_SHARD=i/n runs the i-th of n parts of the selected tests (every n-th
# in the order of their ids' hashes, so each part mixes the lane; one job a
# part where a job's time is limited); the part's files are named
# gpu_tests_part<i>of<n>.xml and gpu_cases_part<i>of<n>.jsonl, and
# benchmarks/gpu_tests.py merges the parts (its docstring says how). The
# 4-GPU lane, as it was run:
#   TESTS="tests/test_gpu_cp.py tests/test_multiprocess.py tests/test_decode.py
#     tests/test_generate.py" LANE_SHARD=1/2 bash benchmarks/gpu_tests.sh 24
#   (then LANE_SHARD=2/2 on the same machine)
# The workers share the GPUs (no preallocation); each compiles on the host
# and solves float64 references there (each problem once a machine: they
# are kept in JAX_RING_REF_CACHE), so give a machine of many cores more
# workers; each gets an equal share of the cores for NumPy's threads.
set -uo pipefail
. benchmarks/gpu_setup.sh || exit 1
# Every case compiles a program of its own: no persistent cache to write.
unset JAX_COMPILATION_CACHE_DIR
workers=${1:-4}
threads=$(( $(nproc) / workers > 0 ? $(nproc) / workers : 1 ))
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# Every worker holds a CUDA context, an allocator pool and NCCL's buffers on
# every GPU. Capped so that many workers fit one GPU's memory (the lane's
# arrays are small): the pool at 0.6/WORKERS of the GPU, NCCL at 2 channels
# of 1 MiB buffers (its defaults take hundreds of MB a communicator).
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-$(
  python3 -c "print(round(min(0.75, 0.6 / $workers), 4))")}
export NCCL_BUFFSIZE=${NCCL_BUFFSIZE:-1048576}
export NCCL_MAX_NCHANNELS=${NCCL_MAX_NCHANNELS:-2}
export OMP_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=$threads
export MKL_NUM_THREADS=$threads
export JAX_RING_REF_CACHE=${JAX_RING_REF_CACHE:-$PWD/.lane_cache/reference}
part=${LANE_SHARD:+_part${LANE_SHARD/\//of}}
export JAX_RING_TEST_RECORD="$OUT/gpu_cases$part.jsonl"
rm -f "$JAX_RING_TEST_RECORD"
# Case by case over the workers (--dist load), not a file a worker as the
# CPU run's default: the lane's cases are mostly in one file.
command="python -m pytest ${TESTS:-tests} -m gpu -n $workers --dist load"
command+="${LANE_SHARD:+ --lane-shard $LANE_SHARD}"
start=$(date +%s)
# Interrupted (SIGINT) after LANE_SECONDS, pytest still writes its report,
# so the summary holds what ran; unless the interrupt lands in the workers'
# shutdown, after the last test: then the summary says it has no report.
timeout -s INT "${LANE_SECONDS:-0}" \
  $command -q -p no:cacheprovider --junitxml="$OUT/gpu_tests$part.xml" 2>&1 \
  | tee "$OUT/gpu_tests$part.log" | tail -40
status=${PIPESTATUS[0]}
python3 benchmarks/gpu_tests.py --junit "$OUT/gpu_tests$part.xml" \
  --record "$JAX_RING_TEST_RECORD" --seconds $(( $(date +%s) - start )) \
  --command "$command" --out "$OUT"
exit "$status"
