#!/usr/bin/env bash
# One device-tool call: build the cuDNN extension, run the GPU tests and the
# CPU suite on the GPU image's jax, then the cuDNN benchmark. Results and logs
# go to $OUT (default: benchmarks/results). Wheels the image lacks are carried
# in .whl/ (nvidia-cudnn-frontend==1.32.0, hypothesis, pytest-xdist, ...).
set -uo pipefail
OUT=${OUT:-benchmarks/results}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
nvidia-smi -L
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
JAX_RING_CUDNN=ON python3 -m pip install --no-build-isolation --no-deps -e . \
  > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
python3 -c "import jax_ring._src.cudnn as c; print('cudnn ext:', c.LOAD_ERROR or c._cudnn.cudnn_version())"
python3 -m pytest -q tests/test_cudnn.py 2>&1 | tee "$OUT/test_cudnn.log" | tail -30
JAX_PLATFORMS=cpu python3 -m pytest -q -n 8 tests 2>&1 | tee "$OUT/test_cpu.log" | tail -5
python3 benchmarks/cudnn_attention.py "$@" 2>&1 | tee "$OUT/bench.log" | tail -25
cp benchmarks/results/*.json "$OUT"/ 2>/dev/null
exit 0
