"""Block backends: each implements the block-kernel contract of
``core/kernel.py`` and registers itself with ``core/registry.py`` when
imported. ``xla`` (pure JAX, every platform) first; ``cudnn`` (the fused
cuDNN kernel, through our XLA FFI handlers) after it, and so preferred where
it serves a call, when its extension is built. ``pallas_decode`` registers
a decode-attention kernel."""

from jax_ring._src.backends import cudnn  # noqa: F401  (registers "cudnn")
from jax_ring._src.backends import xla  # noqa: F401  (registers "xla")
try:  # a jax without Pallas's Triton backend: decoding uses XLA alone
  from jax_ring._src.backends import pallas_decode  # noqa: F401  (decode)
except ImportError:
  pass
