"""Whether a block's segment ids fit the ragged calls (:mod:`packed`):
every row's query ids are runs of one id each (no id in two runs), the
keys of each such id one contiguous range, and (``shift``, a causal mask
between two id arrays) no document's first key before its first query's
diagonal. ``()`` bool, decided on the device, two ways:

- :func:`by_table`, O(T + S) a row with no sort: each id's first query and
  first key found in a table of ``T + S`` slots (``T`` for one array,
  :func:`idtable.slots`). Exact where every id of the row lies in ``[lo, lo
  + T + S)`` (``known``, ``lo`` the row's least id); no answer
  otherwise.
- :func:`by_sort`, O(T log T) a row: exact for any ids.

:meth:`packed.Block.decide` branches on ``known`` so that rows the table
decides run no sort.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ring._src.core import idtable


def _run_starts(ids):
  """``(B, N)`` int32: the first position of each token's run of equal
  ids."""
  pos = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]
  return jax.lax.cummax(jnp.where(idtable.run_starts(ids), pos, 0), axis=1)


def first_seen(slot, slots: int):
  """``(B, slots)`` int32: each slot's first position in ``slot (B, N)``
  (``N`` where absent). Only the first token of each run of equal slots
  is scattered (no later token of a run is its slot's first), so a row
  of long documents updates each slot about once, not once a token."""
  b, n = slot.shape
  pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[None], (b, n))
  at = jnp.where(idtable.run_starts(slot), slot, slots)  # else dropped
  return jnp.full((b, slots), n, jnp.int32).at[
      jnp.arange(b)[:, None], at].min(pos, mode="drop")


def slots(q_ids, kv_ids, same: bool = False):
  """``(d_q (B, T), d_k (B, S), size, known)``: :func:`idtable.slots` of the
  row's queries' ids (one array, ``size = T``) or of its queries' and
  keys' (``size = T + S``)."""
  t = q_ids.shape[1]
  if same:
    d, known = idtable.slots(q_ids)
    return d, d, t, known
  d, known = idtable.slots(jnp.concatenate([q_ids, kv_ids], 1))
  return d[:, :t], d[:, t:], d.shape[1], known


def by_table(q_ids, kv_ids, shift: int | None = None, same: bool = False):
  """``(known, fits)``, two ``()`` bools: whether every row's ids lie
  within its table (:func:`idtable.slots`), and where so, whether the ids fit
  (exactly)."""
  t, s = q_ids.shape[1], kv_ids.shape[1]
  d_q, d_k, size, known = slots(q_ids, kv_ids, same)
  take = lambda table, slot: jnp.take_along_axis(table, slot, 1)
  q_first = first_seen(d_q, size)  # each id's first query (T: none)
  fits = jnp.all(take(q_first, d_q) == _run_starts(q_ids))
  if not same:
    member = take(q_first, d_k) < t  # the key's id has queries
    k_start = _run_starts(kv_ids)
    fits &= jnp.all(~member | (take(first_seen(d_k, size), d_k) == k_start))
    if shift is not None:
      first = member & (k_start == jnp.arange(s, dtype=jnp.int32)[None])
      diagonal = jnp.arange(s, dtype=jnp.int32)[None] + shift
      fits &= jnp.all(~first | (diagonal >= take(q_first, d_k)))
  return known, fits


def by_sort(q_ids, kv_ids, shift: int | None = None, same: bool = False):
  """``()`` bool: whether the ids fit, for any ids. ``same``: the keys'
  ids are the queries' array, so the first condition is all (a run's keys
  are its queries, and a ``shift >= 0`` puts no first key before its
  diagonal): one sort a row."""

  def one_array(q):
    sq = jnp.sort(q)
    return ((q[1:] != q[:-1]).sum(dtype=jnp.int32) ==
            (sq[1:] != sq[:-1]).sum(dtype=jnp.int32))

  def row(q, kv):
    t, s = q.shape[0], kv.shape[0]
    runs = 1 + (q[1:] != q[:-1]).sum(dtype=jnp.int32)
    order = jnp.argsort(q, stable=True)  # an id's first query comes first
    sq = q[order]
    distinct = 1 + (sq[1:] != sq[:-1]).sum(dtype=jnp.int32)
    at = jnp.clip(jnp.searchsorted(sq, kv, method="sort"), 0, t - 1)
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
    return fits

  if same:
    return jnp.all(jax.vmap(one_array)(q_ids))
  return jnp.all(jax.vmap(row)(q_ids, kv_ids))
