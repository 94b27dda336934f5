"""A block's causal/window band in cuDNN's terms.

With static offsets, query ``i`` sees key ``j`` of the block iff ``lower
<= j - i <= upper``, where ``d = q_offset - kv_offset``, ``(left, right)``
the config's ``band``, ``upper = d + right`` and ``lower = d - left``.
cuDNN's top-left band keeps ``i' - left_bound < j' <= i' + right_bound``
and needs ``right_bound >= 0`` and ``left_bound >= 1``, so a diagonal that
leaves the block is shifted back into it by skipping rows and columns:

==========================  ================================================
``row_start = max(0, -upper)``  rows above it see no key (output 0)
``col_start = max(0, lower + row_start)``  keys left of it are never seen
``right_bound = upper + row_start - col_start``  (>= 0)
``left_bound = col_start - lower - row_start + 1``  (>= 1)
==========================  ================================================

The handlers start their q/out/dq pointers at ``row_start`` and their
k/v/dk/dv pointers at ``col_start``, so nothing is copied. Padding lengths
(global positions) become per-batch lengths of that window.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


_NONE = 1 << 62  # "no bound" while computing the band


@dataclasses.dataclass(frozen=True)
class Band:
  """cuDNN's view of one block's causal/window mask (see module doc)."""

  row_start: int = 0
  col_start: int = 0
  right_bound: int = -1  # < 0: none
  left_bound: int = 0  # < 1: none
  empty: bool = False  # no query sees any key


def band(config, q_offset: int, kv_offset: int, t: int, s: int) -> Band:
  d = q_offset - kv_offset
  left, right = (_NONE if x is None else x for x in config.band)
  if right == _NONE and left == _NONE:
    return Band()
  upper = d + right if right != _NONE else _NONE
  lower = d - left if left != _NONE else -_NONE
  row = max(0, -upper) if upper != _NONE else 0
  col = max(0, lower + row) if lower != -_NONE else 0
  if row >= t or col >= s:
    return Band(empty=True)
  return Band(
      row_start=row, col_start=col,
      right_bound=upper + row - col if upper != _NONE else -1,
      left_bound=col - lower - row + 1 if lower != -_NONE else 0)


def needs_padding(mask, bnd: Band, t, s) -> bool:
  """Whether cuDNN's padding mask (per-batch lengths) must be on."""
  rows, cols = t - bnd.row_start, s - bnd.col_start
  # cuDNN refuses a left bound with more rows than keys unless padded.
  return (mask.q_lengths is not None or mask.kv_lengths is not None or
          (bnd.left_bound >= 1 and rows > cols))


def window_lengths(mask, bnd: Band, b, t, s):
  """Per-batch (B,) int32 lengths of the shifted window, and whether the
  padding mask is needed at all."""
  rows, cols = t - bnd.row_start, s - bnd.col_start
  seq_q = jnp.full((b,), rows, jnp.int32)
  seq_kv = jnp.full((b,), cols, jnp.int32)
  if mask.q_lengths is not None:
    seq_q = jnp.clip(mask.q_lengths - mask.q_offset - bnd.row_start, 0, rows)
  if mask.kv_lengths is not None:
    seq_kv = jnp.clip(mask.kv_lengths - mask.kv_offset - bnd.col_start, 0,
                      cols)
  return seq_q, seq_kv, needs_padding(mask, bnd, t, s)


def rows_may_be_empty(bnd: Band, padding, t, s):
  """Statically: can some row see no key (so its output must be zeroed)?"""
  rows, cols = t - bnd.row_start, s - bnd.col_start
  # The last row's first visible key is rows - left_bound.
  return (padding or bnd.row_start > 0 or
          (bnd.left_bound >= 1 and rows - bnd.left_bound >= cols))


def row_valid(bnd: Band, seq_q, seq_kv, t):
  """(B, T) bool: the row sees at least one key."""
  i = jnp.arange(t, dtype=jnp.int32)[None, :] - bnd.row_start
  first = jnp.zeros_like(i)
  last = seq_kv[:, None] - 1
  if bnd.left_bound >= 1:
    first = jnp.maximum(first, i - bnd.left_bound + 1)
  if bnd.right_bound >= 0:
    last = jnp.minimum(last, i + bnd.right_bound)
  return (i >= 0) & (i < seq_q[:, None]) & (first <= last)


def col_valid(bnd: Band, seq_kv, s):
  j = jnp.arange(s, dtype=jnp.int32)[None, :] - bnd.col_start
  return (j >= 0) & (j < seq_kv[:, None])
