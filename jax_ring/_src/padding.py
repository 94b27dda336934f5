"""Sequences of any length on a context-parallel mesh: zeros appended up to
the lengths the layout divides (``validate.padded_lengths``), hidden by the
mask, so that the first T rows of the output, and every real token's
gradient, are the unpadded call's."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_ring._src.core.config import AttentionConfig
from jax_ring._src.core.mask import TokenMask


def pad(query, key, value, tm: TokenMask, config: AttentionConfig, t: int,
        s: int):
  """``(query, key, value, tm)`` at sequence lengths ``t >= T`` and
  ``s >= S`` (:func:`validate.padded_lengths`), zeros appended, such that
  the first T rows of the output, and every real token's gradient, are
  the unpadded call's. A padded query row is cut from the output: its
  cotangent is zero, so it adds to no gradient. Padded keys are hidden
  from the real queries by the causal mask where it does so (T <= S: the
  segment ids, if any, extend each row's last document, adding none);
  else by a segment id of their own where the call has segment ids
  (cuDNN's packed path takes no lengths beside them); else by
  ``kv_lengths`` (natural positions). Only constant pads, reductions and
  elementwise ops: they serve arrays sharded along the sequence on
  Explicit mesh axes too."""
  pad_t, pad_s = t - query.shape[1], s - key.shape[1]
  if not pad_t and not pad_s:
    return query, key, value, tm
  grow = lambda x, n: jnp.pad(x, [(0, 0), (0, n)] + [(0, 0)] * (x.ndim - 2))
  causal = config.is_causal and query.shape[1] <= key.shape[1]
  ids = [x for x in (tm.q_segment_ids, tm.kv_segment_ids) if x is not None]
  if ids and causal:  # each row's last id, by a reduction (no slice)
    def pad_ids(x, n):
      if x is None or not n:
        return x
      at = jnp.arange(x.shape[1] + n)
      last = jnp.max(jnp.where(at[None, :x.shape[1]] == x.shape[1] - 1, x,
                               jnp.iinfo(x.dtype).min), axis=1)
      return jnp.where(at[None] < x.shape[1], grow(x, n), last[:, None])
  elif ids:  # an id no real token has
    fresh = _unused_id(ids)
    pad_ids = lambda x, n: None if x is None else jnp.where(
        jnp.arange(x.shape[1] + n)[None] < x.shape[1], grow(x, n), fresh)
  else:
    pad_ids = lambda x, n: x
  kv_lengths = tm.kv_lengths
  if pad_s and not ids and not causal:
    real = key.shape[1]
    kv_lengths = (jnp.full(key.shape[:1], real, jnp.int32) if kv_lengths is
                  None else jnp.minimum(kv_lengths, real))
  return (grow(query, pad_t), grow(key, pad_s), grow(value, pad_s),
          TokenMask(q_segment_ids=pad_ids(tm.q_segment_ids, pad_t),
                    kv_segment_ids=pad_ids(tm.kv_segment_ids, pad_s),
                    q_lengths=tm.q_lengths, kv_lengths=kv_lengths))


def _unused_id(ids):
  """An id that none of the int arrays ``ids`` holds: above their largest,
  else below their smallest, else (both ends of the dtype taken) one that
  a search by counts finds: a range holding fewer ids than values has a
  half that does too, down to one value that no id holds (the whole
  range holds fewer tokens than values). Reductions only, so that arrays
  sharded along the sequence on Explicit axes serve as they are."""
  dtype = jnp.dtype(ids[0].dtype)
  info, bits = jnp.iinfo(dtype), 8 * dtype.itemsize
  top = functools.reduce(jnp.maximum, [jnp.max(x) for x in ids])
  low = functools.reduce(jnp.minimum, [jnp.min(x) for x in ids])
  unsigned = jnp.dtype(f"uint{bits}")
  flip = (lambda u: u ^ unsigned.type(1 << (bits - 1))) if info.min else (
      lambda u: u)  # order-preserving, signed <-> unsigned

  def search():
    keys = [flip(jax.lax.bitcast_convert_type(x, unsigned)) for x in ids]

    def halve(_, bounds):
      lo, hi = bounds
      mid = lo + (hi - lo) // 2
      held = sum(jnp.sum((u >= lo) & (u <= mid), dtype=jnp.int32)
                 for u in keys)
      free = held.astype(unsigned) < mid - lo + 1
      return jnp.where(free, lo, mid + 1), jnp.where(free, mid, hi)

    lo, _ = jax.lax.fori_loop(0, bits, halve, (
        unsigned.type(0), unsigned.type(np.iinfo(unsigned).max)))
    return jax.lax.bitcast_convert_type(flip(lo), dtype)

  return jnp.where(top < info.max, top + 1, jnp.where(
      low > info.min, low - 1, jax.lax.cond(
          (top == info.max) & (low == info.min), search,
          lambda: jnp.asarray(0, dtype)))).astype(dtype)


def explained(lengths, run, unit: int, dual_chunk: bool):
  """``explain``'s ``padding`` entry: the tokens appended to the query and
  key rows (``lengths`` (T, S) run as ``run``, multiples of ``unit``), and
  why."""
  (t, s), (run_t, run_s) = lengths, run
  twice = ", and twice the ring" if dual_chunk else ""
  return ({"query": run_t - t, "key": run_s - s},
          f"tokens appended to each row: lengths (T, S) = ({t}, {s}) run as "
          f"({run_t}, {run_s}), multiples of {unit} (the context devices"
          f"{twice}); the padding is masked, cut from the output and adds "
          f"to no gradient; attention work "
          f"+{100 * (run_t * run_s / max(t * s, 1) - 1):.1f}%")
