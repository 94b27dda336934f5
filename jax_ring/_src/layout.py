"""Load-balance layouts: which device holds which tokens of the sequence.

With a causal mask, contiguous sharding gives device N-1 all of the work of
the last rows and device 0 almost none. Two layouts give every device early
and late tokens alike (S tokens, N devices, T = S / N tokens each):

* ``"dual_chunk"`` ("zigzag"): the sequence is cut into 2N chunks and device
  r holds chunks r and 2N-1-r, one early and one late;
* ``"striped"``: token i goes to device i mod N, as local token i // N, so
  device r holds tokens r, r+N, r+2N, ...

==========  ======  ===========================  ==========================
cp_size N   device  dual_chunk: chunks (of 2N)   striped: tokens (S = 4N)
==========  ======  ===========================  ==========================
2           0       [0, 3]                       0, 2, 4, 6
2           1       [1, 2]                       1, 3, 5, 7
4           0       [0, 7]                       0, 4, 8, 12
4           1       [1, 6]                       1, 5, 9, 13
4           2       [2, 5]                       2, 6, 10, 14
4           3       [3, 4]                       3, 7, 11, 15
==========  ======  ===========================  ==========================

Under both, each device's local tokens are in increasing global order, so
the valid tokens under a padding length are a prefix of the shard.
dual_chunk needs S % 2N == 0, striped S % N == 0.

``reorder_for_load_balance`` permutes a global array so that plain
contiguous sharding of the sequence axis yields the layout;
``reorder_from_load_balance`` undoes it. Apply the same reorder to q, k, v,
positions, segment ids, labels and loss masks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# The closed choice lives with the other static options, in config.
from jax_ring._src.config import LOAD_BALANCES, LoadBalance


def _dual_chunk_order(cp_size: int) -> np.ndarray:
  """Chunk ids in device order: [0, 2N-1, 1, 2N-2, ...]."""
  return np.stack([np.arange(cp_size), 2 * cp_size - 1 - np.arange(cp_size)],
                  axis=1).reshape(-1)


def _split(x, parts, seq_axis, layout, needs):
  """``x`` with its sequence axis split into ``parts`` equal pieces."""
  s = x.shape[seq_axis]
  if s % parts:
    raise ValueError(
        f"sequence length {s} (axis {seq_axis} of shape {tuple(x.shape)}) "
        f"must be divisible by {needs} = {parts} for the {layout} load "
        "balance")
  return x.reshape(x.shape[:seq_axis] + (parts, s // parts) +
                   x.shape[seq_axis + 1:])


def explicit_axes(mesh) -> tuple[str, ...]:
  """The mesh's axes of type Explicit (jax 0.10's ``make_mesh`` default)."""
  return tuple(a for a, kind in zip(mesh.axis_names, mesh.axis_types)
               if kind == jax.sharding.AxisType.Explicit)


def _reorder(x, cp_size, seq_axis, layout, inverse):
  x = jnp.asarray(x)
  sharding = getattr(jax.typeof(x), "sharding", None)
  explicit = explicit_axes(sharding.mesh) if sharding is not None else ()
  if explicit:  # the permutation is a gather: placed by the partitioner
    return jax.sharding.auto_axes(
        lambda y: _permute(y, cp_size, seq_axis, layout, inverse),
        axes=explicit, out_sharding=sharding)(x)
  return _permute(x, cp_size, seq_axis, layout, inverse)


def _permute(x, cp_size, seq_axis, layout, inverse):
  seq_axis = seq_axis % x.ndim
  if layout == "dual_chunk":
    chunks = _split(x, 2 * cp_size, seq_axis, layout, "2 * cp_size")
    order = _dual_chunk_order(cp_size)
    if inverse:
      order = np.argsort(order)
    return jnp.take(chunks, order, axis=seq_axis).reshape(x.shape)
  if layout == "striped":
    # Natural order is (T, N) row-major: token a * N + r. Device-major
    # order is (N, T): device r's local token a. A transpose maps one to
    # the other.
    y = _split(x, cp_size, seq_axis, layout, "cp_size")  # (N, T) pieces
    if not inverse:  # natural: read the same memory as (T, N)
      y = y.reshape(x.shape[:seq_axis] + (y.shape[seq_axis + 1], cp_size) +
                    x.shape[seq_axis + 1:])
    return jnp.swapaxes(y, seq_axis, seq_axis + 1).reshape(x.shape)
  raise ValueError(f"layout must be one of {LOAD_BALANCES}; got {layout!r}")


def reorder_for_load_balance(x, cp_size: int, *, seq_axis: int = 1,
                             layout: LoadBalance = "dual_chunk"):
  """Global natural order -> device-major ``layout`` order along seq_axis,
  so that contiguous sharding gives each device its tokens (module doc)."""
  return _reorder(x, cp_size, seq_axis, layout, inverse=False)


def reorder_from_load_balance(x, cp_size: int, *, seq_axis: int = 1,
                              layout: LoadBalance = "dual_chunk"):
  """Inverse of :func:`reorder_for_load_balance`."""
  return _reorder(x, cp_size, seq_axis, layout, inverse=True)
