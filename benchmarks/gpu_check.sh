#!/usr/bin/env bash
# One command on a GPU machine: build the cuDNN extension, run the GPU tests and the
# CPU suite on the GPU image's jax, then the cuDNN benchmark. Results and logs
# go to $OUT (default: benchmarks/results). Wheels the machine lacks may be
# placed in .whl/ (nvidia-cudnn-frontend==1.32.0, hypothesis, pytest-xdist, ...).
set -uo pipefail
. benchmarks/gpu_setup.sh || exit 1
python3 -m pytest -q -m gpu tests/test_cudnn.py 2>&1 | tee "$OUT/test_cudnn.log" | tail -30
JAX_PLATFORMS=cpu python3 -m pytest -q -n 8 tests 2>&1 | tee "$OUT/test_cpu.log" | tail -5
python3 benchmarks/cudnn_attention.py "$@" 2>&1 | tee "$OUT/bench.log" | tail -25
cp benchmarks/results/*.json "$OUT"/ 2>/dev/null
exit 0
