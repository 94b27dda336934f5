"""Load-balance layouts: which device holds which tokens of the sequence.

With a causal mask, contiguous sharding gives device N-1 all of the work of
the last rows and device 0 almost none. The dual-chunk ("zigzag") layout cuts
the sequence into 2N chunks and gives device r chunks r and 2N-1-r, so every
device holds one early and one late chunk:

==========  ===============  ===========================
cp_size N   device           chunks held (of 2N)
==========  ===============  ===========================
2           0, 1             [0, 3], [1, 2]
4           0, 1, 2, 3       [0, 7], [1, 6], [2, 5], [3, 4]
==========  ===============  ===========================

``reorder_for_load_balance`` permutes a global array so that plain
contiguous sharding of the sequence axis yields this layout;
``reorder_from_load_balance`` undoes it. Apply the same reorder to q, k, v,
positions, segment ids, labels and loss masks.
"""

from __future__ import annotations

from typing import Literal

import jax.numpy as jnp
import numpy as np

LoadBalance = Literal["dual_chunk"]


def _dual_chunk_order(cp_size: int) -> np.ndarray:
  """Chunk ids in device order: [0, 2N-1, 1, 2N-2, ...]."""
  return np.stack([np.arange(cp_size), 2 * cp_size - 1 - np.arange(cp_size)],
                  axis=1).reshape(-1)


def _split(x, cp_size, seq_axis):
  s = x.shape[seq_axis]
  if s % (2 * cp_size):
    raise ValueError(
        f"sequence length {s} (axis {seq_axis} of shape {tuple(x.shape)}) "
        f"must be divisible by 2 * cp_size = {2 * cp_size} for the "
        "dual_chunk load balance")
  return x.reshape(x.shape[:seq_axis] + (2 * cp_size, s // (2 * cp_size)) +
                   x.shape[seq_axis + 1:])


def reorder_for_load_balance(x, cp_size: int, *, seq_axis: int = 1,
                             layout: LoadBalance = "dual_chunk"):
  """Global natural order -> device-major dual-chunk order along seq_axis."""
  del layout  # the only layout so far
  x = jnp.asarray(x)
  chunks = _split(x, cp_size, seq_axis)
  out = jnp.take(chunks, _dual_chunk_order(cp_size), axis=seq_axis)
  return out.reshape(x.shape)


def reorder_from_load_balance(x, cp_size: int, *, seq_axis: int = 1,
                              layout: LoadBalance = "dual_chunk"):
  """Inverse of :func:`reorder_for_load_balance`."""
  del layout
  x = jnp.asarray(x)
  chunks = _split(x, cp_size, seq_axis)
  inverse = np.argsort(_dual_chunk_order(cp_size))
  return jnp.take(chunks, inverse, axis=seq_axis).reshape(x.shape)
