"""Packed documents (segment ids) on cuDNN's ragged offsets, not a copy
into a padded batch: each row's runs of equal query ids become up to
``SLOTS`` virtual batches ``b * SLOTS + j`` that start, in place, at the
run's first query and at the first key with that id.

==========================  ================================================
query and kv ids            served masks
==========================  ================================================
one array (same ids)        all: causal/window bands hold per document,
                            because its queries and keys are the same tokens
two different arrays        none (non-causal, no window): a ring's
                            off-diagonal blocks
two arrays, or one with     causal, no window, keys at or after the queries
kv_offset > q_offset        (the striped ring's steps)
==========================  ================================================

A causal mask between two id arrays keeps key b for query a iff ``b <= a -
shift`` (``shift = kv_offset - q_offset``) within a document: each slot
starts its queries at ``kv_start + shift``. That is exact when no
document's first key lies before its first query's diagonal, which the
striped layout guarantees and ``Docs.fits`` checks at run time; a batch
that does not fit goes to the ``xla`` backend through a ``lax.cond``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_ring._src.backends.cudnn import ffi
from jax_ring._src.backends.cudnn.band import Band
from jax_ring._src.core.mask import MASK_VALUE


# Packed documents per batch row that the ragged path serves. Its stats
# buffer is SLOTS x the dense one, and rows with more documents fall back
# to xla at run time.
SLOTS = 16


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Docs:
  """Up to SLOTS documents per row. (B, M) int32 starts and lengths of each
  slot's query run and key range; ``slot (B, T)`` of each query token."""

  q_start: jax.Array
  q_len: jax.Array
  kv_start: jax.Array
  kv_len: jax.Array
  slot: jax.Array
  fits: jax.Array  # () bool: every row fits the slots, ids contiguous


def documents(q_ids, kv_ids, shift: int | None = None) -> Docs:
  """The slots of each row; ``shift``: a causal mask between two id arrays
  (``b <= a - shift``, see the module doc), whose slots start their queries
  at their first key's diagonal."""
  b, t = q_ids.shape
  s = kv_ids.shape[1]
  new = jnp.concatenate([jnp.ones((b, 1), bool),
                         q_ids[:, 1:] != q_ids[:, :-1]], 1)
  slot = jnp.cumsum(new, 1, dtype=jnp.int32) - 1
  j = jnp.arange(SLOTS, dtype=jnp.int32)[None, :, None]
  in_slot = slot[:, None, :] == j  # (B, M, T)
  q_len = in_slot.sum(-1, dtype=jnp.int32)
  q_start = jnp.where(in_slot, jnp.arange(t, dtype=jnp.int32), t).min(-1)
  ids = jnp.take_along_axis(q_ids, jnp.minimum(q_start, t - 1), 1)  # (B, M)
  q_count = (q_ids[:, None, :] == ids[:, :, None]).sum(-1, dtype=jnp.int32)
  hit = kv_ids[:, None, :] == ids[:, :, None]  # (B, M, S)
  kv_len = hit.sum(-1, dtype=jnp.int32)
  pos = jnp.arange(s, dtype=jnp.int32)
  kv_start = jnp.where(hit, pos, s).min(-1)
  kv_last = jnp.where(hit, pos, -1).max(-1)
  used = q_len > 0
  fits = (jnp.all(slot[:, -1] < SLOTS) & jnp.all(~used | (q_count == q_len))
          & jnp.all(~used | (kv_len == 0) | (kv_last - kv_start + 1 == kv_len)))
  # Unused slots: empty, starting at the row's end.
  q_start = jnp.where(used, q_start, t)
  kv_len = jnp.where(used, kv_len, 0)
  kv_start = jnp.where(kv_len > 0, kv_start, s)
  if shift is not None:
    keys = kv_len > 0
    diagonal = kv_start + shift
    fits &= jnp.all(~keys | (diagonal >= q_start))
    first = jnp.where(keys, jnp.clip(diagonal, q_start, q_start + q_len),
                      q_start)
    q_start, q_len = first, q_start + q_len - first
  return Docs(q_start, q_len, kv_start, kv_len, jnp.minimum(slot, SLOTS - 1),
               fits)


def offsets(start, rows, heads, h):
  """(B * M + 1,) element offsets of each slot's first row in a BSHD buffer
  of ``rows`` rows per batch; the last entry is the buffer's end."""
  b = start.shape[0]
  first = (jnp.arange(b, dtype=jnp.int32)[:, None] * rows + start)
  return jnp.append(first.reshape(-1) * heads * h, b * rows * heads * h)


def doc_rows(docs: Docs, q, k, v):
  """The handlers' row operands: (B * M,) query and key lengths, then the
  (B * M + 1,) ragged offsets of q (and dq), k (dk), v (dv) and out
  (dout), for q (B, T, N, H), k (B, S, K, H), v (B, S, K, Hv)."""
  _, t, n, h = q.shape
  _, s, kh, _ = k.shape
  hv = v.shape[3]
  return (docs.q_len.reshape(-1), docs.kv_len.reshape(-1),
          offsets(docs.q_start, t, n, h), offsets(docs.kv_start, s, kh, h),
          offsets(docs.kv_start, s, kh, hv), offsets(docs.q_start, t, n, hv))


def doc_index(docs: Docs, t):
  """(batch, slot, row-in-document) indices of each query token, (B, T)."""
  bi = jnp.arange(docs.slot.shape[0])[:, None]
  row = jnp.arange(t)[None, :] - jnp.take_along_axis(docs.q_start, docs.slot,
                                                     1)
  return bi, docs.slot, row


def doc_row_valid(docs: Docs, t):
  """(B, T): the query lies in its slot (at or after the slot's start) and
  its document has keys (bands keep the slot's diagonal)."""
  _, _, row = doc_index(docs, t)
  return (jnp.take_along_axis(docs.kv_len, docs.slot, 1) > 0) & (row >= 0)


def doc_col_valid(docs: Docs, s):
  """(B, S): the key lies in some slot's key range."""
  j = jnp.arange(s)[None, None, :]
  inside = (j >= docs.kv_start[:, :, None]) & (
      j < (docs.kv_start + docs.kv_len)[:, :, None])
  return inside.any(1)


def diagonal_shift(config, mask) -> int | None:
  """``kv_offset - q_offset`` of a causal mask (no window) that the slots
  must carry (two id arrays, or unequal offsets); None otherwise."""
  if not config.is_causal or config.local_window is not None or (
      mask.same_ids and mask.q_offset == mask.kv_offset):
    return None
  return mask.kv_offset - mask.q_offset


def packed_slots(config, mask, bnd: Band) -> tuple[Docs, Band]:
  """The slots of a packed call and the band cuDNN applies inside each."""
  shift = diagonal_shift(config, mask)
  docs = documents(mask.q_segment_ids, mask.kv_ids(), shift)
  return docs, bnd if shift is None else Band(right_bound=0)


def packed_forward(q, k, v, docs: Docs, config, bnd: Band):
  b, t, n, _ = q.shape
  out, stats = ffi.sdpa(
      "jax_ring_sdpa_fwd",
      (jax.ShapeDtypeStruct((b, t, n, v.shape[3]), q.dtype),
       jax.ShapeDtypeStruct((b * SLOTS, n, t), jnp.float32)),
      q, k, v, *doc_rows(docs, q, k, v),
      **ffi.attrs(config, bnd, False, SLOTS))
  bi, slot, row = doc_index(docs, t)
  valid = doc_row_valid(docs, t)
  row = jnp.where(valid, row, 0)
  lse = stats.reshape(b, SLOTS, n, t)[bi, slot, :, row]  # (B, T, N)
  return (jnp.where(valid[:, :, None, None], out, 0),
          jnp.where(valid[:, :, None], lse, MASK_VALUE))


def packed_backward(q, k, v, docs: Docs, out, lse, dout, config, bnd: Band):
  b, t, n, _ = q.shape
  bi, slot, row = doc_index(docs, t)
  valid = doc_row_valid(docs, t)
  row = jnp.where(valid, row, t)  # rows before their slot: dropped
  stats = jnp.zeros((b, SLOTS, n, t), jnp.float32).at[bi, slot, :, row].set(
      lse.astype(jnp.float32), mode="drop").reshape(b * SLOTS, n, t)
  dq, dk, dv = ffi.sdpa(
      "jax_ring_sdpa_bwd",
      (jax.ShapeDtypeStruct(q.shape, q.dtype),
       jax.ShapeDtypeStruct(k.shape, k.dtype),
       jax.ShapeDtypeStruct(v.shape, v.dtype)),
      q, k, v, out, stats, dout, *doc_rows(docs, q, k, v),
      **ffi.attrs(config, bnd, False, SLOTS))
  rows = valid[:, :, None, None]
  cols = doc_col_valid(docs, k.shape[1])[:, :, None, None]
  return (jnp.where(rows, dq, 0), jnp.where(cols, dk, 0),
          jnp.where(cols, dv, 0))


def unsupported_ids(config, query, key, value, mask) -> str | None:
  """Why the ragged path cannot serve these segment ids, or None."""
  t, s = query.shape[1], key.shape[1]
  same = mask.same_ids
  if mask.q_lengths is not None or mask.kv_lengths is not None:
    return "segment_ids with padding lengths"
  if config.logits_soft_cap is not None:
    return "segment_ids with logits_soft_cap"
  if config.local_window is not None and not (
      same and t == s and mask.q_offset == mask.kv_offset):
    return ("segment_ids with a window between different query and key ids "
            "or offsets")
  shift = diagonal_shift(config, mask)
  if shift is not None and shift < 0:
    return ("segment_ids with a causal diagonal before the first key "
            "(kv_offset < q_offset)")
  b, n, kh = query.shape[0], query.shape[2], key.shape[2]
  h = max(query.shape[3], value.shape[3])  # q, k or v, out: int32 offsets
  if max(b * t * n * h, b * s * kh * h) >= 2**31:
    return "segment_ids on buffers of 2**31 elements or more"
  return None
