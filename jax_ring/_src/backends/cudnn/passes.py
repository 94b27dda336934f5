"""A packed block's pass as one handler (``jax_ring_sdpa_{fwd,bwd}_pass``,
``csrc/pass.cc``): the length classes of :mod:`packed`, but every call of
every class launched by one handler that reads the classes' counts from
the device itself, in place of :func:`packed.each_call`'s ``lax.switch``
and loop (each of whose tests the host waits for on a GPU).

**Tables.** Class ``c`` holds ``P_c`` entries a row: as many of its
documents as a row can hold (rounded up to its calls' most virtual
batches ``M_c``: a row's worth of query tiles, a multiple of 4), by rank,
empty ones (no rows) at the row's end. ``lens (2, B, P)``: the entries'
query and key counts; ``offs (4, B, W)``: their element offsets into q,
k, v and out from the row's start, in chunks of ``M_c`` entries each
followed by the row's end (and 3 more, so that every chunk is 16-byte
aligned). A call over ranks
``[first, first + M)`` of one row reads a contiguous slice of ``lens`` and
the chunk of ``first`` in ``offs``, whose entry ``M`` is the row's end, as
in a call's own table (entries past a row's documents hold the end).
``stats (B, R)``: each class's ``(P_c, N, L_c)`` float32 stats a row,
gathered to the tokens' lse after the forward and scattered from them
before the backward (cuDNN 9.19's backward reads no ragged stats) into a
buffer nothing else writes: cuDNN reads no stats past a document's rows.

**Menus.** A call's virtual batches ``M`` come from its class's menu,
``1, RATIO, RATIO**2, ...`` below ``M_c``, then ``M_c``: a class's calls
hold ``M_c`` each while more remain, and its last call the smallest
entry that holds the rest. So grids, stats and cuDNN's passes over the
virtual batches' rows follow the documents present, not the class's
most. Every call starts at a multiple of ``M_c`` (a multiple of 4): its
slices stay aligned whatever its ``M``.

**Branches.** One ``lax.switch`` a pass, on the documents: ids that do
not fit the calls take the ``xla`` backend; a block of one id array
whose longest document a size of ``tiles.SIZES`` takes
(:func:`tiles.limits`) takes that size's tiles (:mod:`tiles`); the rest
the handler. Whether the ids fit is read from their table
(:func:`fits.by_table`), with no sort, where it can place them; ids
spread over more values than the block has tokens are sorted instead
(:meth:`packed.Block.decide`). The tables and the branch index are built
before the switch (:func:`prepare`), or given by a caller that branches
before the block (the ring's own block): ``mask.prepared``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import layout as xla_layout

from jax_ring._src.backends import xla
from jax_ring._src.backends.cudnn import ffi, packed, tiles
from jax_ring._src.core import vma
from jax_ring._src.core.mask import MASK_VALUE

# Whether the packed blocks run as one handler a pass where it serves them
# (:func:`serves`; else the calls' switch and loop, packed.each_call).
ENABLED = True
# Whether every class picks its last call's virtual batches from its menu
# (else classes past 0 always hold ``M_c`` a call, class 0 its menu of
# packed.geometries).
MENUS = True


@dataclasses.dataclass(frozen=True)
class Layout:
  """A pass's static layout: each class's length ``L_c``, entries a row
  ``P_c``, virtual batches a call ``M_c`` and menu (ascending, ending at
  ``M_c``)."""

  lengths: tuple[int, ...]
  slots: tuple[int, ...]
  batches: tuple[int, ...]
  menus: tuple[tuple[int, ...], ...]

  def attrs(self) -> dict:
    """The handler's attributes; the menus as one array, class by class,
    and each class's end in it (``menu_ends``)."""
    out = {f: np.asarray(getattr(self, f), np.int64)
           for f in ("lengths", "slots", "batches")}
    out["menu"] = np.asarray(sum(self.menus, ()), np.int64)
    out["menu_ends"] = np.cumsum([len(m) for m in self.menus],
                                 dtype=np.int64)
    return out

  def base(self) -> np.ndarray:
    return np.cumsum((0,) + self.slots[:-1])

  def chunks(self) -> tuple[int, ...]:
    """Each class's ``offs`` entries: ``P_c / M_c`` chunks of ``M_c + 4``."""
    return tuple(p // m * (m + 4) for p, m in zip(self.slots, self.batches))

  def offs_base(self) -> np.ndarray:
    return np.cumsum((0,) + self.chunks()[:-1])

  def stats_base(self, n: int) -> np.ndarray:
    return np.cumsum((0,) + tuple(p * n * L for p, L in zip(
        self.slots[:-1], self.lengths[:-1])))

  def stats_size(self, n: int) -> int:
    return sum(p * n * L for p, L in zip(self.slots, self.lengths))


def layout(t: int, s: int, b: int, same: bool) -> Layout:
  """The classes of a ``b``-row block of ``t`` queries and ``s`` keys.
  ``same``: one id array (a document's keys are its queries). A document
  of class ``c > 0`` has more than ``L_(c-1)`` queries or keys, each id one
  run of queries and one range of keys: at most ``t // (L_(c-1) + 1)`` (+
  ``s // (L_(c-1) + 1)`` for two arrays) a row; class 0's at most ``min(t,
  s)``."""
  geo = packed.geometries(t, s, b)
  lengths = tuple(g.length for g in geo)
  slots, batches, menus = [], [], []
  cap = packed.MAX_BATCHES // b // 4 * 4
  fours = lambda m: min(-(-m // 4) * 4, cap)  # aligned slices of the tables
  for c, g in enumerate(geo):
    m = fours(g.batches[-1])
    if c == 0:
      most = min(t, s)
    else:
      most = t // (lengths[c - 1] + 1) + (
          0 if same else s // (lengths[c - 1] + 1))
    slots.append(max(1, -(-most // m)) * m)
    batches.append(m)
    if MENUS:
      menus.append(tuple(packed.RATIO**i for i in range(m.bit_length())
                         if packed.RATIO**i < m) + (m,))
    else:
      menus.append(tuple(sorted({fours(x) for x in g.batches})))
  return Layout(lengths, tuple(slots), tuple(batches), tuple(menus))


# The most bytes a pass's stats may take (every class's entries at once);
# above, the calls' loop, whose stats are one call's.
MAX_STATS_BYTES = 256 << 20


def serves(q, k, same: bool) -> bool:
  """Whether a pass serves q (B, T, N, H), k (B, S, K, H): its float32
  stats within ``MAX_STATS_BYTES`` and twice q's bytes."""
  b, t, n, _ = q.shape
  r = layout(t, k.shape[1], b, same).stats_size(n)
  return 4 * b * r <= min(MAX_STATS_BYTES, 2 * q.size * q.dtype.itemsize)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tables:
  """A pass's operands: ``counts (C,)``, ``lens (2, B, P)``, ``offs (4, B,
  W)``; per query token and head, its stats' index in ``(B, R)`` (``R``
  where it is no call's) as ``at (B, T, N)``."""

  counts: jax.Array
  lens: jax.Array
  offs: jax.Array
  at: jax.Array


def tables(docs: packed.Docs, lay: Layout, q, k, v) -> Tables:
  """:class:`Tables` of ``docs`` for q (B, T, N, H), k (B, S, K, H), v (B,
  S, K, Hv)."""
  b, t, n, h = q.shape
  s, kh, hv = k.shape[1], k.shape[2], v.shape[3]
  classes, p = len(lay.lengths), sum(lay.slots)
  bi = jnp.arange(b)[:, None]
  cls = jnp.maximum(docs.cls, 0)
  slot = jnp.where(docs.cls >= 0, jnp.asarray(lay.base(), jnp.int32)[cls]
                   + docs.rank, p)
  m = jnp.asarray(lay.batches, jnp.int32)[cls]
  entry = jnp.where(docs.cls >= 0, jnp.asarray(lay.offs_base(), jnp.int32)[
      cls] + docs.rank // m * (m + 4) + docs.rank % m, sum(lay.chunks()))

  def put(width, at, xs, fills):  # (len(xs), B, width): one scatter
    init = jnp.broadcast_to(jnp.asarray(fills, jnp.int32)[:, None, None],
                            (len(xs), b, width))
    return init.at[:, bi, at].set(jnp.stack(xs), mode="drop")

  lens = put(p, slot, (docs.q_len, docs.kv_len), (0, 0))
  starts = (docs.q_start * (n * h), docs.kv_start * (kh * h),
            docs.kv_start * (kh * hv), docs.q_start * (n * hv))
  ends = (t * n * h, s * kh * h, s * kh * hv, t * n * hv)
  offs = put(sum(lay.chunks()), entry, starts, ends)
  # Each query token's call entry and row in it (one gather).
  run_cls, rank, first, size = jnp.take_along_axis(jnp.stack(
      [docs.cls, docs.rank, docs.q_start, docs.q_len]), docs.run[None], 2)
  row = jnp.arange(t, dtype=jnp.int32)[None] - first
  inside = (run_cls >= 0) & (row >= 0) & (row < size)
  c = jnp.maximum(run_cls, 0)
  length = jnp.asarray(lay.lengths, jnp.int32)[c]
  base = jnp.asarray(lay.stats_base(n), jnp.int32)[c]
  heads = jnp.arange(n, dtype=jnp.int32)
  at = (base + rank * (n * length) + row)[..., None] + (
      heads * length[..., None])
  at = jnp.where(inside[..., None], at, lay.stats_size(n))
  counts = packed.class_counts(docs, classes)
  return Tables(counts, lens, offs, at)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prepared:
  """What a pass computes before its branch: the branch ``index`` (``()``
  int32, :func:`_index`), the :class:`Tables` and, for the backward, the
  calls' ``stats (B, R)``; given ahead by a caller that branches first
  (``mask.prepared``, :func:`prepare`)."""

  index: jax.Array
  tables: Tables
  stats: jax.Array | None = None


def prepare(q, k, v, mask, config, bnd, lse=None) -> Prepared:
  """:class:`Prepared` of a pass over q (B, T, N, H), k (B, S, K, H), v
  (B, S, K, Hv); with ``lse (B, T, N)``, the backward's. The calls' stats
  hold ``lse`` at the rows they read (each document's); the rest of each
  virtual batch, which cuDNN does not read, is left undefined."""
  blk = packed.block(mask, config, bnd)
  b, t, n, _ = q.shape
  lay = layout(t, k.shape[1], b, mask.same_ids)
  ok, docs = blk.decide()
  tab = tables(docs, lay, q, k, v)
  index = _index(ok, docs, len(_tile_sizes(q, k, v, mask, config)),
                 tiles.limits(q, k, v))
  if lse is None:
    return Prepared(index, tab)
  bi = jnp.arange(b)[:, None, None]
  stats = ffi.uninitialized((b, lay.stats_size(n)), jnp.float32).at[
      bi, tab.at].set(lse.astype(jnp.float32), mode="drop")
  return Prepared(index, tab, stats)


def _given(q, k, v, mask, config, bnd, lse=None) -> Prepared:
  """``mask.prepared``, checked against the pass's layout; where None,
  :func:`prepare`'s behind an optimization barrier, so that the tables
  are done before the switch: on a GPU the host waits for the device at
  the switch, and again when the handler reads the counts, and nothing
  then runs between the two waits."""
  b, t, n, _ = q.shape
  lay = layout(t, k.shape[1], b, mask.same_ids)
  prepared = mask.prepared
  if prepared is None:
    return jax.lax.optimization_barrier(
        prepare(q, k, v, mask, config, bnd, lse))
  want = ((2, b, sum(lay.slots)), (4, b, sum(lay.chunks())))
  got = (prepared.tables.lens.shape, prepared.tables.offs.shape)
  if got != want or (prepared.stats is None) != (lse is None):
    raise ValueError(f"mask.prepared holds tables {got}, this pass's are "
                     f"{want}: give a block the prepare of its own mask")
  return prepared


def _pass_attrs(config, blk: packed.Block, lay: Layout) -> dict:
  return dict(scale=np.float32(config.scale),
              right_bound=blk.inner.right_bound,
              left_bound=blk.inner.left_bound, **lay.attrs())


def _row_major(xs):
  """``xs`` (a tuple of arrays) held in row-major layouts. The fallback
  branch's results pass through this: a conditional's results take one
  layout for both branches, and the ``xla`` backend's would otherwise
  leave a transposed one to the handler's branch, which then copies its
  results into it."""
  row_major = lambda x: xla_layout.Layout(tuple(range(x.ndim)))
  return tuple(xla_layout.with_layout_constraint(x, row_major(x))
               for x in xs)


def _tile_sizes(q, k, v, mask, config) -> tuple[int, ...]:
  """The tile sizes a pass branches to (none where tiles do not serve)."""
  return tiles.SIZES if tiles.serves(q, k, mask, config, v) else ()


def _index(ok, docs: packed.Docs, sizes: int, most: tuple[int, ...]):
  """``()`` int32, the pass's branch: 0, the fallback, where the ids do
  not fit (``ok``); else ``1 + i``, the first of the ``sizes`` tile sizes
  that takes the longest document (its limit in ``most``,
  :func:`tiles.limits`), ``1 + sizes`` (the handler) where none does."""
  pick = tiles.size_index(docs.q_len.max(), most) if sizes else 0
  return jnp.where(ok, 1 + pick, 0).astype(jnp.int32)


def _graphs(config, blk: packed.Block, lay: Layout) -> list[dict]:
  """Each one-row call the pass may run (its attributes)."""
  return [ffi.attrs(config, blk.inner, False, m, length)
          for menu, length in zip(lay.menus, lay.lengths) for m in menu]


def forward(q, k, v, mask, config, bnd):
  """:func:`packed.forward` as one handler a pass: ``(out, lse)``, with
  ``mask.prepared`` this block's :func:`prepare` where given."""
  blk = packed.block(mask, config, bnd)
  b, t, n, _ = q.shape
  lay = layout(t, k.shape[1], b, mask.same_ids)
  ready = _given(q, k, v, mask, config, bnd)
  tab, r = ready.tables, lay.stats_size(n)
  refs = (q, k, v, blk.q_ids, blk.kv_ids)

  def run(_):
    shapes = (jax.ShapeDtypeStruct((b, t, n, v.shape[3]), q.dtype),
              jax.ShapeDtypeStruct((b, r), jnp.float32))
    args = (q, k, v, tab.counts, tab.lens, tab.offs)
    into = {} if blk.fresh else dict(aliases={6: 0})
    if not blk.fresh:
      args += (vma.like(jnp.zeros(shapes[0].shape, q.dtype), *refs),)
    out, stats = ffi.sdpa_pass(
        "jax_ring_sdpa_fwd_pass", shapes, *args,
        calls=_graphs(config, blk, lay), **into,
        **_pass_attrs(config, blk, lay))
    bi = jnp.arange(b)[:, None, None]
    lse = jnp.where(tab.at < r, stats[bi, jnp.minimum(tab.at, r - 1)],
                    MASK_VALUE)
    return vma.like((out, lse), *refs)

  others = [lambda _: xla.forward(q, k, v, None, mask, config)] + [
      lambda _, p=p: tiles.forward(q, k, v, blk.q_ids, config, p)
      for p in _tile_sizes(q, k, v, mask, config)]
  return jax.lax.switch(ready.index, [
      lambda _, f=f: vma.like(_row_major(f(_)), *refs) for f in others] +
                        [run], None)


def backward(q, k, v, mask, out, lse, dout, config, bnd):
  """:func:`packed.backward` as one handler a pass: ``(dq, dk, dv)``,
  with ``mask.prepared`` this block's :func:`prepare` given ``lse`` where
  given."""
  blk = packed.block(mask, config, bnd)
  b, t, n, _ = q.shape
  lay = layout(t, k.shape[1], b, mask.same_ids)
  ready = _given(q, k, v, mask, config, bnd, lse)
  tab, stats = ready.tables, ready.stats
  refs = (q, k, v, out, lse, dout, blk.q_ids, blk.kv_ids)

  def run(_):
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    args = (q, k, v, out, stats, dout, tab.counts, tab.lens, tab.offs)
    into = {} if blk.fresh else dict(aliases={9: 0, 10: 1, 11: 2})
    if not blk.fresh:
      args += tuple(vma.like(tuple(map(jnp.zeros_like, (q, k, v))), *refs))
    return vma.like(tuple(ffi.sdpa_pass(
        "jax_ring_sdpa_bwd_pass", shapes, *args,
        calls=_graphs(config, blk, lay), **into,
        **_pass_attrs(config, blk, lay))), *refs)

  others = [lambda _: xla.backward(q, k, v, None, mask, out, lse, dout, None,
                                   config)[:3]] + [
      lambda _, p=p: tiles.backward(q, k, v, blk.q_ids, out, lse, dout,
                                    config, p)
      for p in _tile_sizes(q, k, v, mask, config)]
  return jax.lax.switch(ready.index, [
      lambda _, f=f: vma.like(_row_major(f(_)), *refs) for f in others] +
                        [run], None)
