# Source on a GPU machine with jax[cuda13] installed, from the repo root:
#   . benchmarks/gpu_setup.sh
# Installs any wheels placed in .whl/ (for a machine without a package index:
# nvidia-cudnn-frontend 1.32.0, hypothesis, pytest-xdist, ...), builds the
# cuDNN extension, and sets
# OUT (default benchmarks/results; the benchmarks' results files are also
# copied there: JAX_RING_RESULTS_COPY), NCCL_NVLS_ENABLE=0, unbuffered output
# and jax's persistent compilation cache in .lane_cache/jax (ignored by git):
# a command that runs again on the same machine, or one split over several
# commands (lm_training.py --append), reuses what an earlier one compiled.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$PWD/.lane_cache/jax}
OUT=${OUT:-benchmarks/results}
export JAX_RING_RESULTS_COPY=${JAX_RING_RESULTS_COPY:-$OUT}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl || return 1
  export PYTHONPATH=/tmp/site
fi
# benchmarks/maxtext_wheels.sh's stub of xprof, which tokamax imports.
[ -d .whl/xprof-stub ] && export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/.whl/xprof-stub
nvidia-smi -L
JAX_RING_CUDNN=ON python3 -m pip install --no-build-isolation --no-deps -e . \
  > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; return 1; }
python3 -c "import jax, jax_ring._src.backends.cudnn as c; print('jax', jax.__version__, jax.devices()); print('cudnn ext:', c.LOAD_ERROR or c.version())"
