"""Packed documents (segment ids) on cuDNN's ragged offsets, not a copy
into a padded batch: each row's runs of equal query ids become virtual
batches ``b * SLOTS + j`` that start, in place, at the run's first query
and at the first key with that id. One cuDNN call takes ``SLOTS``
documents a row; a row of more runs as several calls, call ``g`` on
documents ``g * SLOTS ...`` (a ``while`` loop, each call's rows and keys
merged into the result: they are disjoint).

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
striped layout guarantees. :func:`layout` checks that, and that each id is
one run of queries and one range of keys, at run time; a batch that does
not fit goes to the ``xla`` backend: one ``lax.cond`` picks it or the
loop of calls. A row of at most SLOTS documents is the loop's one
iteration: a second branch for it would put a second cuDNN call into
every packed block of the compiled program, and the compile time of a
ring over many blocks grows with those (4 GPUs, a 16-layer model).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_ring._src.backends import xla
from jax_ring._src.backends.cudnn import ffi
from jax_ring._src.backends.cudnn.band import Band
from jax_ring._src.core import vma
from jax_ring._src.core.mask import MASK_VALUE


# Documents per row in one cuDNN call: its stats buffer is SLOTS x the
# dense one (cuDNN 9.19's backward reads no ragged stats).
SLOTS = 16


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Docs:
  """One call's documents: (B, M) int32 starts and lengths of each slot's
  query run and key range; ``slot (B, T)`` of each query token (clipped to
  the slots), ``member (B, T)`` whether its document is in this call."""

  q_start: jax.Array
  q_len: jax.Array
  kv_start: jax.Array
  kv_len: jax.Array
  slot: jax.Array
  member: jax.Array


def documents(q_ids, kv_ids, shift: int | None = None, first=0) -> Docs:
  """The slots of each row's documents ``first ... first + SLOTS - 1``
  (in order of their query runs); ``shift``: a causal mask between two id
  arrays (``b <= a - shift``, see the module doc), whose slots start their
  queries at their first key's diagonal. Meaningful where :func:`layout`
  fits."""
  b, t = q_ids.shape
  s = kv_ids.shape[1]
  new = jnp.concatenate([jnp.ones((b, 1), bool),
                         q_ids[:, 1:] != q_ids[:, :-1]], 1)
  slot = jnp.cumsum(new, 1, dtype=jnp.int32) - 1 - first
  j = jnp.arange(SLOTS, dtype=jnp.int32)[None, :, None]
  in_slot = slot[:, None, :] == j  # (B, M, T)
  q_len = in_slot.sum(-1, dtype=jnp.int32)
  q_start = jnp.where(in_slot, jnp.arange(t, dtype=jnp.int32), t).min(-1)
  ids = jnp.take_along_axis(q_ids, jnp.minimum(q_start, t - 1), 1)  # (B, M)
  hit = kv_ids[:, None, :] == ids[:, :, None]  # (B, M, S)
  kv_len = hit.sum(-1, dtype=jnp.int32)
  kv_start = jnp.where(hit, jnp.arange(s, dtype=jnp.int32), s).min(-1)
  used = q_len > 0
  # Unused slots: empty, starting at the row's end.
  q_start = jnp.where(used, q_start, t)
  kv_len = jnp.where(used, kv_len, 0)
  kv_start = jnp.where(kv_len > 0, kv_start, s)
  if shift is not None:
    keys = kv_len > 0
    diagonal = kv_start + shift
    first_row = jnp.where(keys, jnp.clip(diagonal, q_start, q_start + q_len),
                          q_start)
    q_start, q_len = first_row, q_start + q_len - first_row
  return Docs(q_start, q_len, kv_start, kv_len,
              jnp.clip(slot, 0, SLOTS - 1), (slot >= 0) & (slot < SLOTS))


def layout(q_ids, kv_ids, shift: int | None = None):
  """``(fits, calls)``, both ``()``: whether every row's query ids are runs
  of one id each (no id in two runs), the keys of each such id one
  contiguous range, and (``shift``) no document's first key before its
  first query's diagonal; and the calls of SLOTS documents the row with
  the most documents needs. O(T log T) a row (sorts)."""

  def row(q, kv):
    t, s = q.shape[0], kv.shape[0]
    runs = 1 + (q[1:] != q[:-1]).sum(dtype=jnp.int32)
    order = jnp.argsort(q, stable=True)  # an id's first query comes first
    sq = q[order]
    distinct = 1 + (sq[1:] != sq[:-1]).sum(dtype=jnp.int32)
    at = jnp.clip(jnp.searchsorted(sq, kv), 0, t - 1)
    member = sq[at] == kv  # the key's id has queries
    starts = member & jnp.concatenate([jnp.ones((1,), bool),
                                       kv[1:] != kv[:-1]])
    by_id = jnp.lexsort((kv, ~member))  # members first, by id
    sk, sm = kv[by_id], member[by_id]
    key_docs = (sm & jnp.concatenate([jnp.ones((1,), bool),
                                      (sk[1:] != sk[:-1]) |
                                      (sm[1:] != sm[:-1])])
                ).sum(dtype=jnp.int32)  # distinct ids among the members
    fits = (runs == distinct) & (starts.sum(dtype=jnp.int32) == key_docs)
    if shift is not None:
      diagonal = jnp.arange(s, dtype=jnp.int32) + shift
      fits &= jnp.all(~starts | (diagonal >= order[at]))
    return fits, runs

  fits, runs = jax.vmap(row)(q_ids, kv_ids)
  return jnp.all(fits), (jnp.max(runs) + SLOTS - 1) // SLOTS


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
  """(B, T): the query's document is in this call, the query lies in its
  slot (at or after the slot's start) and its document has keys (bands
  keep the slot's diagonal)."""
  _, _, row = doc_index(docs, t)
  return docs.member & (
      jnp.take_along_axis(docs.kv_len, docs.slot, 1) > 0) & (row >= 0)


def doc_col_valid(docs: Docs, s):
  """(B, S): the key lies in some slot's key range of this call."""
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


def call_forward(q, k, v, docs: Docs, config, bnd: Band):
  """One call's (out, lse): zero and MASK_VALUE outside its rows."""
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


def call_backward(q, k, v, docs: Docs, out, lse, dout, config, bnd: Band):
  """One call's (dq, dk, dv): zero outside its rows and keys."""
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


def forward(q, k, v, mask, config, bnd: Band):
  """The block forward on packed ``mask`` ids: ``(out, lse)``."""
  shift = diagonal_shift(config, mask)
  inner = bnd if shift is None else Band(right_bound=0)
  q_ids, kv_ids = mask.q_segment_ids, mask.kv_ids()
  t = q.shape[1]

  def call(g, acc):
    docs = documents(q_ids, kv_ids, shift, g * SLOTS)
    out, lse = call_forward(q, k, v, docs, config, inner)
    valid = doc_row_valid(docs, t)[:, :, None]
    return acc[0] + out, jnp.where(valid, lse, acc[1])

  def loop():
    b, _, n, _ = q.shape
    init = (jnp.zeros((b, t, n, v.shape[3]), q.dtype),
            jnp.full((b, t, n), MASK_VALUE, jnp.float32))
    # Inside shard_map the carry varies as the calls' results do.
    init = vma.like(init, q, k, v, q_ids, kv_ids)
    return jax.lax.fori_loop(0, calls, call, init)

  fits, calls = layout(q_ids, kv_ids, shift)
  return jax.lax.cond(fits, loop,
                      lambda: xla.forward(q, k, v, None, mask, config))


def backward(q, k, v, mask, out, lse, dout, config, bnd: Band):
  """The block backward on packed ``mask`` ids: ``(dq, dk, dv)``."""
  shift = diagonal_shift(config, mask)
  inner = bnd if shift is None else Band(right_bound=0)
  q_ids, kv_ids = mask.q_segment_ids, mask.kv_ids()

  def call(g, acc):
    docs = documents(q_ids, kv_ids, shift, g * SLOTS)
    grads = call_backward(q, k, v, docs, out, lse, dout, config, inner)
    return tuple(a + x for a, x in zip(acc, grads))  # disjoint rows, keys

  def loop():
    init = (jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v))
    init = vma.like(init, q, k, v, out, lse, dout, q_ids, kv_ids)
    return jax.lax.fori_loop(0, calls, call, init)

  fits, calls = layout(q_ids, kv_ids, shift)
  return jax.lax.cond(fits, loop, lambda: xla.backward(
      q, k, v, None, mask, out, lse, dout, None, config)[:3])


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
