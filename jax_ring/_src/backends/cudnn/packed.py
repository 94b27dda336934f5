"""Packed documents (segment ids) on cuDNN's ragged offsets, at the cost of
their work: each row's runs of equal query ids are documents, and every
cuDNN call takes the documents of one *length class* as virtual batches
of that class's length, starting in place (ragged offsets) at the
document's first query and first key. No copies into a padded batch.

**Classes.** A block of ``T`` queries and ``S`` keys has the static
lengths ``L_0 = min(SMALLEST, max(T, S))``, ``L_c = min(RATIO *
L_(c-1), max(T, S))``: a document whose longer side (queries or keys) is
``e`` belongs to the smallest ``L_c >= e``. A call of class ``c`` holds
``M`` documents a row: grid and stats ``(B * M, N, L_c)`` are sized by
the documents, not by the row (cuDNN's backward also passes over all
``B * M * L_c`` rows outside its main kernel). For ``c > 0`` ``M =
ceil(max(T, S) / L_c)`` (a dense row's worth of query tiles) and the
class runs as a loop of ``ceil(count / M)`` calls, at most ``RATIO`` for
one id array (its documents are longer than ``L_(c-1)``). Class 0's
documents are at most one cuDNN tile (``TILE`` rows) each, as in a dense
batch of them, and may be as many as ``T``: it picks ``M`` from
``ceil(max(T, S) / TILE) * RATIO**i`` up to ``T`` by ``lax.switch`` on
the count, one call (a call holds at most ``MAX_BATCHES`` virtual
batches in all; past that class 0 loops too). So a row runs at most ``1 +
RATIO * (classes - 1)`` calls for one id array, whatever its number of
documents, and usually one call a class present.

**In place.** The ``_into`` handlers write each call's rows of ``out``
(dq) and keys (dk, dv) into buffers they are given (aliased): documents
are disjoint, so the calls fill one buffer with no merge, and rows no
call writes keep their initial zeros. Each call's stats are gathered to
its tokens' ``lse`` (``MASK_VALUE`` where no call writes), and scattered
back for the backward (cuDNN 9.19's backward reads no ragged stats).

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
shift`` (``shift = kv_offset - q_offset``) within a document: each
document starts its queries at ``kv_start + shift``. That is exact when no
document's first key lies before its first query's diagonal, which the
striped layout guarantees. :func:`layout` checks that, and that each id is
one run of queries and one range of keys, at run time; a batch that does
not fit goes to the ``xla`` backend (the calls' loop then runs once,
through it).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_ring._src.backends import xla
from jax_ring._src.backends.cudnn import ffi, fits
from jax_ring._src.backends.cudnn.band import Band
from jax_ring._src.core import idtable, vma
from jax_ring._src.core.mask import MASK_VALUE


# cuDNN's query tile: a document of up to TILE tokens costs one tile a head.
TILE = 128
# Class 0's length: documents of up to SMALLEST tokens.
SMALLEST = 32
# A call's virtual batches in all (B * M) stay within CUDA's bound on a
# grid's y and z dimensions, wherever cuDNN puts them; above it a class
# loops. This also bounds class 0's stats, (B * M, N, SMALLEST) float32.
MAX_BATCHES = 65535
# Each class is RATIO x the previous one's length.
RATIO = 4


@dataclasses.dataclass(frozen=True)
class Geometry:
  """One length class: virtual batches of ``length`` rows and keys;
  ``batches`` the choices of virtual batches a row per call (one, or
  class 0's ascending menu)."""

  length: int
  batches: tuple[int, ...]


def geometries(t: int, s: int, b: int = 1) -> tuple[Geometry, ...]:
  """The length classes of a block of ``b`` rows of ``t`` queries and
  ``s`` keys."""
  top, lengths = max(t, s), [min(SMALLEST, max(t, s))]
  while lengths[-1] < top:
    lengths.append(min(lengths[-1] * RATIO, top))
  out = []
  for c, length in enumerate(lengths):
    menu = [-(-top // max(length, TILE if c == 0 else 1))]
    while c == 0 and menu[-1] < t:
      menu.append(min(menu[-1] * RATIO, t))
    cap = max(1, MAX_BATCHES // b)
    out.append(Geometry(length, tuple(sorted({min(m, cap) for m in menu}))))
  return tuple(out)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Docs:
  """Each row's documents, indexed by query run (``(B, T)``; runs past a
  row's count are empty): first query and query count (after a causal
  shift), first key and key count, length class (``-1``: no call, as it
  has no queries or no keys), rank within its class; and ``run (B, T)``,
  each query token's run."""

  q_start: jax.Array
  q_len: jax.Array
  kv_start: jax.Array
  kv_len: jax.Array
  cls: jax.Array
  rank: jax.Array
  run: jax.Array


def _runs(ids):
  """``(run (B, N), start (B, N), length (B, N))``: each token's run of
  equal ids, and each run's first token and length (runs past the row's
  count start at N with length 0)."""
  b, n = ids.shape
  new = idtable.run_starts(ids)
  run = jnp.cumsum(new, 1, dtype=jnp.int32) - 1
  bi = jnp.arange(b)[:, None]
  start = jnp.full((b, n), n, jnp.int32).at[bi, jnp.where(new, run, n)].set(
      jnp.arange(n, dtype=jnp.int32)[None], mode="drop")
  length = jnp.diff(start, append=jnp.full((b, 1), n, jnp.int32), axis=1)
  return run, start, length


def _keys_of(q_ids, q_start, kv_ids):
  """``(kv_start, kv_len)`` (B, T) of each query run's id among the keys'
  runs (``S, 0`` where the keys lack it); each id one key run (see
  :func:`layout`)."""
  b, t = q_ids.shape
  s = kv_ids.shape[1]
  _, k_start, k_len = _runs(kv_ids)
  k_id = jnp.take_along_axis(kv_ids, jnp.minimum(k_start, s - 1), 1)
  used = k_len > 0
  order = jnp.lexsort((k_id, ~used), axis=1)  # used runs first, by id
  sorted_id = jnp.take_along_axis(k_id, order, 1)
  sorted_id = jnp.where(jnp.take_along_axis(used, order, 1), sorted_id,
                        jnp.iinfo(jnp.int32).max)
  want = jnp.take_along_axis(q_ids, jnp.minimum(q_start, t - 1), 1)
  at = jnp.clip(jax.vmap(functools.partial(jnp.searchsorted, method="sort"))(
      sorted_id, want), 0, s - 1)
  hit = (jnp.take_along_axis(sorted_id, at, 1) == want) & (
      at < used.sum(1, keepdims=True))
  run = jnp.take_along_axis(order, at, 1)
  return (jnp.where(hit, jnp.take_along_axis(k_start, run, 1), s),
          jnp.where(hit, jnp.take_along_axis(k_len, run, 1), 0))


def _keys_by_table(q_ids, q_start, kv_ids):
  """:func:`_keys_of` from the ids' table (:func:`fits.slots`): each id's
  first key and its keys' count; meaningful where the table knows and the
  ids fit (each id one range of keys)."""
  b, t = q_ids.shape
  s = kv_ids.shape[1]
  d_q, d_k, size, _ = fits.slots(q_ids, kv_ids)
  # Each run of keys adds its length once (runs past the row's: none).
  _, k_start, k_len = _runs(d_k)
  at = jnp.where(k_len > 0, jnp.take_along_axis(
      d_k, jnp.minimum(k_start, s - 1), 1), size)
  count = jnp.zeros((b, size), jnp.int32).at[
      jnp.arange(b)[:, None], at].add(k_len, mode="drop")
  slot = jnp.take_along_axis(d_q, jnp.minimum(q_start, t - 1), 1)
  take = lambda x: jnp.take_along_axis(x, slot, 1)
  return take(fits.first_seen(d_k, size)), take(count)


def documents(q_ids, kv_ids, shift: int | None = None, same: bool = False,
              by_table: bool = False) -> Docs:
  """Each row's documents (:class:`Docs`). ``same``: the keys' ids are the
  queries' array (each document's keys are its queries); ``shift``: a
  causal mask between two id arrays (``b <= a - shift``, see the module
  doc), whose documents start their queries at their first key's
  diagonal. Meaningful where :func:`layout` fits, and (``by_table``: two
  arrays' keys found without a sort) where :func:`fits.by_table` knows."""
  t, s = q_ids.shape[1], kv_ids.shape[1]
  run, q_start, q_len = _runs(q_ids)
  if same:
    kv_start, kv_len = q_start, q_len
  elif by_table:
    kv_start, kv_len = _keys_by_table(q_ids, q_start, kv_ids)
  else:
    kv_start, kv_len = _keys_of(q_ids, q_start, kv_ids)
  if shift is not None:
    first = jnp.where(kv_len > 0, jnp.clip(kv_start + shift, q_start,
                                           q_start + q_len), q_start)
    q_start, q_len = first, q_start + q_len - first
  lengths = jnp.asarray([g.length for g in geometries(t, s)], jnp.int32)
  active = (q_len > 0) & (kv_len > 0)
  cls = jnp.where(active, jnp.searchsorted(
      lengths, jnp.maximum(q_len, kv_len), method="compare_all"), -1)
  hot = cls[:, :, None] == jnp.arange(len(lengths))[None, None]
  rank = jnp.take_along_axis(jnp.cumsum(hot, 1, dtype=jnp.int32),
                             jnp.maximum(cls, 0)[:, :, None], 2)[:, :, 0] - 1
  return Docs(q_start, q_len, kv_start, kv_len, cls, rank, run)


def layout(q_ids, kv_ids, shift: int | None = None, same: bool = False):
  """Whether the ids fit the calls (``()`` bool; see :mod:`fits`):
  every row's query ids are runs of one id each (no id in two runs), the
  keys of each such id one contiguous range, and (``shift``) no
  document's first key before its first query's diagonal. Computed both
  ways (the table's answer where it knows, else the sort's), for any ids:
  the calls decide with :meth:`Block.decide` instead."""
  known, ok = fits.by_table(q_ids, kv_ids, shift, same)
  return jnp.where(known, ok, fits.by_sort(q_ids, kv_ids, shift, same))


def class_counts(docs: Docs, classes: int):
  """``(classes,)`` int32: the most documents of each class in a row."""
  hot = docs.cls[:, :, None] == jnp.arange(classes)[None, None]
  return hot.sum(1, dtype=jnp.int32).max(0)


def calls(docs: Docs, t: int, s: int):
  """``()`` int32: the cuDNN calls one direction runs on these documents."""
  geo = geometries(t, s, docs.cls.shape[0])
  counts = class_counts(docs, len(geo))
  tops = jnp.asarray([g.batches[-1] for g in geo], jnp.int32)
  return jnp.sum(-(-counts // tops))


@dataclasses.dataclass(frozen=True)
class Call:
  """One call's virtual batches: ``(B, M)`` starts and lengths of each
  one's queries and keys; per query token ``(B, T)``, its batch in the
  call (``M`` if none) and its row in it."""

  q_start: jax.Array
  q_len: jax.Array
  kv_start: jax.Array
  kv_len: jax.Array
  batch: jax.Array
  row: jax.Array


def select(docs: Docs, cls: int, first, m: int, t: int, s: int) -> Call:
  """The documents of class ``cls`` ranked ``first ... first + m - 1`` in
  each row, as ``m`` virtual batches (unused ones empty, at the row's
  end)."""
  b = docs.cls.shape[0]
  bi = jnp.arange(b)[:, None]
  rank = docs.rank - first
  pick = (docs.cls == cls) & (rank >= 0) & (rank < m)
  slot = jnp.where(pick, rank, m)

  def put(x, fill):
    return jnp.full((b, m), fill, jnp.int32).at[bi, slot].set(x, mode="drop")

  q_start = jnp.take_along_axis(docs.q_start, docs.run, 1)
  row = jnp.arange(t, dtype=jnp.int32)[None] - q_start
  batch = jnp.where(jnp.take_along_axis(pick, docs.run, 1) & (row >= 0),
                    jnp.take_along_axis(slot, docs.run, 1), m)
  return Call(put(docs.q_start, t), put(docs.q_len, 0), put(docs.kv_start, s),
              put(docs.kv_len, 0), batch, jnp.where(batch < m, row, 0))


def offsets(start, rows, heads, h):
  """(B * M + 1,) element offsets of each virtual batch's first row in a
  BSHD buffer of ``rows`` rows per batch; the last entry is its end."""
  b = start.shape[0]
  first = (jnp.arange(b, dtype=jnp.int32)[:, None] * rows + start)
  return jnp.append(first.reshape(-1) * heads * h, b * rows * heads * h)


def call_rows(c: Call, q, k, v):
  """The handlers' row operands: (B * M,) query and key lengths, then the
  (B * M + 1,) ragged offsets of q (and dq), k (dk), v (dv) and out
  (dout), for q (B, T, N, H), k (B, S, K, H), v (B, S, K, Hv)."""
  _, t, n, h = q.shape
  _, s, kh, _ = k.shape
  hv = v.shape[3]
  return (c.q_len.reshape(-1), c.kv_len.reshape(-1),
          offsets(c.q_start, t, n, h), offsets(c.kv_start, s, kh, h),
          offsets(c.kv_start, s, kh, hv), offsets(c.q_start, t, n, hv))


def diagonal_shift(config, mask) -> int | None:
  """``kv_offset - q_offset`` of a causal mask (no window) that the
  documents must carry (two id arrays, or unequal offsets); None
  otherwise."""
  if not config.is_causal or config.local_window is not None or (
      mask.same_ids and mask.q_offset == mask.kv_offset):
    return None
  return mask.kv_offset - mask.q_offset


def each_call(docs: Docs, t: int, s: int, one, acc, fits, fallback,
              fresh: bool = False):
  """``acc`` through ``one(acc, cls, first, geometry, m)`` for every call
  the documents need, all in one loop: iteration ``w`` is the ``w``-th
  call (class by class), its class and its number of virtual batches (class
  0's menu) picked by one ``lax.switch``. Where the ids do not fit
  (``fits``, ``()`` bool) the loop runs once, through ``fallback(acc)``.
  One loop and one branch a call: on a GPU, each loop test and each branch
  waits for the device (a block with no documents waits once).

  ``fresh``: every token is some call's (one id array, no shift), so the
  first call writes fresh buffers instead of zeroed ones: it runs before
  the loop, on ``()``, and ``one`` and ``fallback`` given ``()`` return
  the whole ``acc``."""
  geo = geometries(t, s, docs.cls.shape[0])
  counts = class_counts(docs, len(geo))
  tops = jnp.asarray([g.batches[-1] for g in geo], jnp.int32)
  calls = -(-counts // tops)
  ends = jnp.cumsum(calls)
  offsets = jnp.asarray(np.cumsum([0] + [len(g.batches) for g in geo[:-1]]),
                        jnp.int32)
  picks = jnp.stack([jnp.minimum(jnp.searchsorted(
      jnp.asarray(g.batches), counts[c], method="compare_all"),
      len(g.batches) - 1) for c, g in enumerate(geo)])
  calls_of = [functools.partial(one, cls=c, geometry=g, m=m)
              for c, g in enumerate(geo) for m in g.batches]

  def body(w, acc):
    c = jnp.minimum(jnp.sum(ends <= w), len(geo) - 1)
    first = (w - ends[c] + calls[c]) * tops[c]
    return jax.lax.switch(
        jnp.where(fits, 1 + offsets[c] + picks[c], 0),
        [fallback] + [lambda acc, f=f: f(acc, first=first) for f in calls_of],
        acc)

  start = 0
  if fresh:
    acc, start = body(0, ()), 1
  return jax.lax.fori_loop(start, jnp.maximum(
      jnp.where(fits, ends[-1], 1), start), body, acc)


@dataclasses.dataclass(frozen=True)
class Block:
  """What a block's forward and backward share: the band inside each
  document, the ids, the documents, the causal ``shift`` between two id
  arrays, whether the keys' ids are the queries' (``same``), the ids'
  table check (:func:`fits.by_table`: ``known``, ``table_fits``; the
  decision, :meth:`decide`) and whether every token is some call's (one
  id array, no shift: the first call can write fresh buffers,
  :func:`each_call`'s ``fresh``)."""

  inner: Band
  q_ids: jax.Array
  kv_ids: jax.Array
  shift: int | None
  same: bool

  @property
  def fresh(self) -> bool:
    return self.same and self.shift is None

  # Computed where asked for (:meth:`decide`): a pass given its tables
  # (``passes.prepare``) traces none of them.
  @functools.cached_property
  def docs(self) -> Docs:  # two arrays: by the table (``by_table``)
    return documents(self.q_ids, self.kv_ids, self.shift, self.same,
                     by_table=True)

  @functools.cached_property
  def _by_table(self) -> tuple[jax.Array, jax.Array]:
    return fits.by_table(self.q_ids, self.kv_ids, self.shift, self.same)

  @property
  def known(self) -> jax.Array:
    return self._by_table[0]

  @property
  def table_fits(self) -> jax.Array:
    return self._by_table[1]

  def decide(self) -> tuple[jax.Array, Docs]:
    """``(ok, docs)``: whether the ids fit the calls (``()`` bool), and
    their documents (meaningful where they fit). Where the ids' table
    knows (:func:`fits.by_table`), its answer and :attr:`docs`; else the
    sort's (:func:`fits.by_sort`) and, for two id arrays, the documents
    with their keys found by a sort. Chosen by a ``lax.cond``, so that
    rows the table knows run no sort: on a GPU one more wait for the
    device, where a sort is a dozen launches the host makes one by one."""
    by_sort = lambda: fits.by_sort(self.q_ids, self.kv_ids, self.shift,
                                   self.same)
    if self.same:
      return jax.lax.cond(self.known, lambda: self.table_fits,
                          by_sort), self.docs
    return jax.lax.cond(
        self.known, lambda: (self.table_fits, self.docs),
        lambda: (by_sort(), documents(self.q_ids, self.kv_ids, self.shift)))


def block(mask, config, bnd: Band) -> Block:
  """The packed block of ``mask``'s ids under ``config``'s mask."""
  shift = diagonal_shift(config, mask)
  q_ids, kv_ids = mask.q_segment_ids, mask.kv_ids()
  return Block(bnd if shift is None else Band(right_bound=0), q_ids, kv_ids,
               shift, mask.same_ids)


def forward(q, k, v, mask, config, bnd: Band):
  """The block forward on packed ``mask`` ids: ``(out, lse)``."""
  blk = block(mask, config, bnd)
  b, t, n, _ = q.shape
  s = k.shape[1]
  refs = (q, k, v, blk.q_ids, blk.kv_ids)  # inside shard_map: what varies
  ok, docs = blk.decide()
  lse0 = jnp.full((b, t, n), MASK_VALUE, jnp.float32)

  def one(acc, cls, first, geometry, m):
    c = select(docs, cls, first, m, t, s)
    shapes = (jax.ShapeDtypeStruct((b, t, n, v.shape[3]), q.dtype),
              jax.ShapeDtypeStruct((b * m, n, geometry.length), jnp.float32))
    args = (q, k, v, *call_rows(c, q, k, v))
    at = ffi.attrs(config, blk.inner, False, m, geometry.length)
    if acc:
      out, stats = ffi.sdpa("jax_ring_sdpa_fwd_into", shapes, *args, acc[0],
                            aliases={9: 0}, **at)
    else:  # the first call on fresh buffers (each_call's ``fresh``)
      out, stats = ffi.sdpa("jax_ring_sdpa_fwd", shapes, *args, **at)
    bi = jnp.arange(b)[:, None]
    lse = stats.reshape(b, m, n, -1)[bi, jnp.minimum(c.batch, m - 1), :,
                                     c.row]  # (B, T, N)
    # Inside shard_map a call's results vary as the carry does.
    return vma.like((out, jnp.where((c.batch < m)[:, :, None], lse,
                                    acc[1] if acc else lse0)), *refs)

  init = () if blk.fresh else vma.like((jnp.zeros((b, t, n, v.shape[3]),
                                              q.dtype), lse0), *refs)
  return each_call(docs, t, s, one, init, ok, lambda acc: vma.like(
      xla.forward(q, k, v, None, mask, config), *refs), blk.fresh)


def backward(q, k, v, mask, out, lse, dout, config, bnd: Band):
  """The block backward on packed ``mask`` ids: ``(dq, dk, dv)``."""
  blk = block(mask, config, bnd)
  b, t, n, _ = q.shape
  s = k.shape[1]
  refs = (q, k, v, out, lse, dout, blk.q_ids, blk.kv_ids)
  ok, docs = blk.decide()

  def one(acc, cls, first, geometry, m):
    c = select(docs, cls, first, m, t, s)
    bi = jnp.arange(b)[:, None]
    stats = jnp.zeros((b, m, n, geometry.length), jnp.float32).at[
        bi, c.batch, :, c.row].set(lse.astype(jnp.float32), mode="drop")
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    args = (q, k, v, out, stats.reshape(b * m, n, -1), dout,
            *call_rows(c, q, k, v))
    at = ffi.attrs(config, blk.inner, False, m, geometry.length)
    if acc:
      grads = ffi.sdpa("jax_ring_sdpa_bwd_into", shapes, *args, *acc,
                       aliases={12: 0, 13: 1, 14: 2}, **at)
    else:  # the first call on fresh buffers (each_call's ``fresh``)
      grads = ffi.sdpa("jax_ring_sdpa_bwd", shapes, *args, **at)
    return vma.like(tuple(grads), *refs)

  init = () if blk.fresh else vma.like(
      (jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)), *refs)
  return each_call(docs, t, s, one, init, ok, lambda acc: vma.like(
      tuple(xla.backward(q, k, v, None, mask, out, lse, dout, None,
                         config)[:3]), *refs), blk.fresh)


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
