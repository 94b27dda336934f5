"""Prints the build inputs of the cuDNN extension as CMake `-D` lines.

Everything comes from installed Python packages, the same ones jax loads:
XLA FFI headers from jaxlib, cudnn.h and libcudnn.so.9 from the
nvidia-cudnn-cu13 (or -cu12) wheel, the cuDNN frontend headers from the
nvidia-cudnn-frontend wheel, and nvrtc.h (included by the frontend) from the
nvidia-cuda-nvrtc wheel when the CUDA toolkit lacks them.
"""

import importlib.metadata as md
import pathlib
import sys


def _dist_file(dists, suffix):
  for name in dists:
    try:
      dist = md.distribution(name)
    except md.PackageNotFoundError:
      continue
    for f in dist.files or ():
      if str(f).endswith(suffix):
        return pathlib.Path(dist.locate_file(f)).resolve()
  return None


def main():
  import jax.ffi

  found = {
      "JAX_RING_XLA_INCLUDE": pathlib.Path(jax.ffi.include_dir()),
      "JAX_RING_CUDNN_HEADER": _dist_file(
          ["nvidia-cudnn-cu13", "nvidia-cudnn-cu12"], "include/cudnn.h"),
      "JAX_RING_CUDNN_LIBRARY": _dist_file(
          ["nvidia-cudnn-cu13", "nvidia-cudnn-cu12"], "lib/libcudnn.so.9"),
      "JAX_RING_FRONTEND_HEADER": _dist_file(["nvidia-cudnn-frontend"],
                                             "include/cudnn_frontend.h"),
  }
  # The frontend's headers call NVRTC; the toolkit may lack it (CPU CI).
  nvrtc = ["nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu13", "nvidia-cuda-nvrtc-cu12"]
  optional = {
      "JAX_RING_NVRTC_HEADER": _dist_file(nvrtc, "include/nvrtc.h"),
      "JAX_RING_NVRTC_LIBRARY": (_dist_file(nvrtc, "lib/libnvrtc.so.13") or
                                 _dist_file(nvrtc, "lib/libnvrtc.so.12")),
  }
  for key, path in found.items():
    if path is None:
      sys.exit(f"jax_ring build: cannot find {key}; install jax[cuda13] (or "
               "nvidia-cudnn-cu13) and `pip install --no-deps "
               "nvidia-cudnn-frontend`")
    print(f"{key}={path}")
  for key, path in optional.items():
    print(f"{key}={path or ''}")


if __name__ == "__main__":
  main()
