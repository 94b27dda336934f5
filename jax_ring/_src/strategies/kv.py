"""K and V as the strategies move them, and their gradients.

``k (B, S, K, H)`` and ``v (B, S, K, Hv)`` travel as one buffer when they
share a shape (H == Hv): stacked ``(2, B, S, K, H)``, so that each move is
one collective. With another value head dim (multi-head latent attention)
they travel as the pair ``(k, v)``: each move is two collectives of exactly
their sizes, never a buffer padded to the wider head dim. Either form
indexes as ``kv[0]`` (K) and ``kv[1]`` (V); :func:`along` applies an
axis-wise operation to either, naming the axis as an axis of ``k``.
dK/dV come in the same form (``kernel.attention_backward_dkv``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def pack(k, v):
  """The moving form of ``k`` and ``v``: stacked if they share a shape,
  else the pair."""
  return jnp.stack([k, v]) if k.shape == v.shape else (k, v)


def unpack(kv):
  """The pair ``(k, v)`` of the moving form ``kv``."""
  return kv if isinstance(kv, tuple) else (kv[0], kv[1])


def along(fn, kv, axis: int):
  """``fn(x, axis')`` on the moving form ``kv``, for ``axis`` an axis of
  ``k (B, S, K, H)``: once on the stacked buffer (whose axes are one
  further), or on each of the pair."""
  if isinstance(kv, tuple):
    return tuple(fn(x, axis) for x in kv)
  return fn(kv, axis + 1)


def zeros(kv, rows=None, dtype=jnp.float32):
  """Zeros in the moving form of ``kv``, with ``rows`` tokens (default:
  as many as ``kv``)."""
  return along(lambda x, ax: jnp.zeros(
      x.shape[:ax] + (rows or x.shape[ax],) + x.shape[ax + 1:], dtype), kv, 1)


def add(a, b):
  """``a + b`` leaf by leaf, in float32 (``a`` may be the float 0.0)."""
  if isinstance(a, float):
    return jax.tree.map(lambda y: a + y.astype(jnp.float32), b)
  return jax.tree.map(lambda x, y: x + y.astype(jnp.float32), a, b)


def add_rows(x, part, start: int, axis: int = 1):
  """``x`` with ``part`` added into its rows ``start ..`` along ``axis``,
  summed in float32 and kept in ``x``'s dtype."""
  rows = lax.slice_in_dim(x, start, start + part.shape[axis], axis=axis)
  rows = rows.astype(jnp.float32) + part.astype(jnp.float32)
  return lax.dynamic_update_slice_in_dim(x, rows.astype(x.dtype), start, axis)


def add_last(a, b):
  """Moving form ``a`` with ``b`` (a moving form of fewer tokens) added
  into its last rows (:func:`add_rows`)."""
  if isinstance(a, tuple):
    return tuple(add_rows(x, y, x.shape[1] - y.shape[1]) for x, y in zip(a, b))
  return add_rows(a, b, a.shape[2] - b.shape[2], 2)


def concat(parts, axis: int):
  """Concatenate moving forms along ``axis`` (an axis of ``k``)."""
  if isinstance(parts[0], tuple):
    return tuple(jnp.concatenate(xs, axis) for xs in zip(*parts))
  return jnp.concatenate(parts, axis + 1)


def nbytes(k, v) -> int:
  return k.size * k.dtype.itemsize + v.size * v.dtype.itemsize
