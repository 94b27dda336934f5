"""The cuDNN mask mapping, checked on the CPU against the reference mask.

cuDNN's band semantics (top-left diagonal, ``i' - left < j' <= i' + right``
after skipping ``row_start`` rows and ``col_start`` keys) are replayed in
NumPy, so every causal/window/offset combination is covered without a GPU.
"""

import collections
import functools
import itertools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ring._src.backends import cudnn
from jax_ring._src.backends.cudnn import ffi, packed, passes, tiles
# The band module's names (the package's ``band`` is the function, which
# hides the module of that name).
from jax_ring._src.backends.cudnn.band import (band, row_valid,
                                               rows_may_be_empty,
                                               window_lengths)
from helpers import check, cudnn_blocks_on_the_cpu, prepared_passes
import reference as ref


@pytest.fixture(autouse=True)
def no_tiles(monkeypatch):
  """The pass's handler on every row here, short documents included (the
  tiles' branch: test_cudnn_tiles.py)."""
  monkeypatch.setattr(tiles, "SIZES", ())


def cudnn_visibility(bnd, t, s):
  i = np.arange(t)[:, None] - bnd.row_start
  j = np.arange(s)[None, :] - bnd.col_start
  vis = (i >= 0) & (j >= 0)
  if bnd.right_bound >= 0:
    vis &= j <= i + bnd.right_bound
  if bnd.left_bound >= 1:
    vis &= j > i - bnd.left_bound
  return vis & (not bnd.empty)


def test_band_reproduces_every_causal_window_offset_mask(monkeypatch):
  # row_valid's arithmetic on NumPy arrays: op by op in jax, its 471 bands
  # were most of the time (traced, on GPUs: test_cudnn.py::test_mask_cases).
  monkeypatch.setattr(sys.modules[row_valid.__module__], "jnp", np)
  checked = 0
  for t, s in ((5, 5), (3, 7), (8, 4)):
    for causal, window, d in itertools.product(
        (False, True), (None, (0, 0), (2, 0), (1, 3), (0, 6), (9, 9)),
        range(-9, 10)):
      case = ref.Case(1.0, is_causal=causal, window=window,
                      q_offset=max(d, 0), kv_offset=max(-d, 0))
      bnd = band(ref.config(case), case.q_offset, case.kv_offset, t, s)
      want = ref.visibility(case, 1, 1, t, s)[0, 0]
      np.testing.assert_array_equal(cudnn_visibility(bnd, t, s), want,
                                    err_msg=f"{case} {t}x{s} -> {bnd}")
      if not bnd.empty:
        # cuDNN's own limits: right_bound >= 0 (or none: -1), left >= 1.
        assert bnd.right_bound >= -1 and bnd.left_bound >= 0
        valid = row_valid(bnd, np.asarray([t - bnd.row_start]),
                          np.asarray([s - bnd.col_start]), t)[0]
        np.testing.assert_array_equal(valid, want.any(-1))
        if not rows_may_be_empty(bnd, False, t, s):
          assert valid.all()
      checked += 1
  assert checked == 3 * 2 * 6 * 19


def test_padding_lengths_follow_the_shifted_window():
  case = ref.Case(1.0, is_causal=True, q_offset=6, kv_offset=0)
  mask = ref.block_mask(ref.Case(1.0, q_offset=6, kv_offset=0,
                                 q_lengths=np.array([9, 20], np.int32),
                                 kv_lengths=np.array([3, 20], np.int32)))
  bnd = band(ref.config(case), 6, 0, 8, 8)
  seq_q, seq_kv, padding = window_lengths(mask, bnd, 2, 8, 8)
  assert padding
  np.testing.assert_array_equal(np.asarray(seq_q), [3, 8])
  np.testing.assert_array_equal(np.asarray(seq_kv), [3, 8])


def ragged_visibility(docs, b, t, s, causal=False):
  """(T, S) per row: i sees j iff some document that a call takes (class
  >= 0) holds query i and key j (and, ``causal``, j's place in its keys
  is at most i's in its queries: cuDNN's top-left diagonal)."""
  d = {f: np.asarray(getattr(docs, f))[b] for f in
       ("q_start", "q_len", "kv_start", "kv_len", "cls")}
  i, j = np.arange(t)[:, None], np.arange(s)[None, :]
  vis = np.zeros((t, s), bool)
  for qs, ql, ks, kl, c in zip(*(d[f] for f in ("q_start", "q_len",
                                                "kv_start", "kv_len",
                                                "cls"))):
    if c < 0:
      continue
    inside = (i >= qs) & (i < qs + ql) & (j >= ks) & (j < ks + kl)
    if causal:
      inside &= j - ks <= i - qs
    vis |= inside
  return vis


def covered_rows(docs, b, t):
  """(T,): the queries some call writes (their document is taken, and they
  lie at or after its first query)."""
  run = np.asarray(docs.run)[b]
  q_start, cls = np.asarray(docs.q_start)[b], np.asarray(docs.cls)[b]
  return (cls[run] >= 0) & (np.arange(t) >= q_start[run])


def test_packed_documents_become_ragged_batches_that_reproduce_the_mask():
  """Runs of query ids -> documents; each one's key range is its id's keys;
  a call's virtual batches start at their documents' first elements."""
  b, t, m = 3, 40, 16
  same = ref.random_segments(5, b, t, 7)
  other = np.stack([same[0], np.roll(same[1], 3), same[2][::-1]])  # unsorted

  # One program for each value of ``same`` (op by op, most of the time).
  @functools.partial(jax.jit, static_argnums=2)
  def laid_out(q_ids, kv_ids, same):
    docs = packed.documents(q_ids, kv_ids, same=same)
    # Offsets of each virtual batch's first element, in BSHD buffers of 2
    # heads x 8 (q, k) and 2 heads x 24 (v, out).
    s = kv_ids.shape[1]
    call = packed.select(docs, 0, 0, m, t, s)
    rows = packed.call_rows(call, jnp.zeros((b, t, 2, 8)),
                            jnp.zeros((b, s, 2, 8)),
                            jnp.zeros((b, s, 2, 24)))[2:]
    return (docs, packed.layout(q_ids, kv_ids), (call.q_start,
                                                  call.kv_start), rows)

  for q_ids, kv_ids in ((same, same), (same, np.sort(other, axis=1)),
                        (same[:, :t], same[:, ::2].repeat(2, 1))):
    docs, fits, (q_start, kv_start), (rq, rk, rv, ro) = laid_out(
        jnp.asarray(q_ids), jnp.asarray(kv_ids), q_ids is kv_ids)
    assert bool(fits)
    for row in range(b):
      want = q_ids[row][:, None] == kv_ids[row][None, :]
      got = ragged_visibility(docs, row, t, kv_ids.shape[1])
      np.testing.assert_array_equal(got, want)
    s = kv_ids.shape[1]
    assert rq.shape == (b * m + 1,) and rq[-1] == b * t * 16
    assert ro[-1] == b * t * 48 and rk[-1] == b * s * 16
    for offsets, per_token, start, rows in ((rq, 16, q_start, t),
                                            (ro, 48, q_start, t),
                                            (rk, 16, kv_start, s),
                                            (rv, 48, kv_start, s)):
      np.testing.assert_array_equal(
          np.asarray(offsets[:-1]).reshape(b, -1),
          (np.arange(b)[:, None] * rows + np.asarray(start)) * per_token)


def test_striped_ring_blocks_of_packed_documents_become_causal_slots():
  """Every striped ring step (device r's queries, device src's keys, cp in
  2..5) with packed documents: the virtual batches that start each
  document's queries at its first key's diagonal, under cuDNN's top-left
  causal mask, see exactly the pairs of the global causal same-document
  mask."""
  from jax_ring._src.strategies.ring import striped as ring_striped
  from jax_ring._src.core.mask import BlockMask
  cfg = ref.config(ref.Case(1.0, is_causal=True))

  # One program a pair of offsets (the blocks' ids are of one shape):
  # 162 blocks op by op took most of this test's time.
  @functools.partial(jax.jit, static_argnums=(2, 3))
  def block(q_ids, kv_ids, q_offset, kv_offset):
    mask = BlockMask(q_offset=q_offset, kv_offset=kv_offset,
                     q_segment_ids=q_ids, kv_segment_ids=kv_ids)
    shift = packed.diagonal_shift(cfg, mask)
    return (packed.documents(mask.q_segment_ids, mask.kv_ids(), shift),
            packed.layout(mask.q_segment_ids, mask.kv_ids(), shift))

  checked = 0
  for cp, seed in itertools.product((2, 3, 4, 5), range(3)):
    t = 11
    ids = ref.random_segments(seed, 1, t * cp, 9)  # some shorter than cp
    pos = np.arange(t * cp)
    for r, src in itertools.product(range(cp), range(cp)):
      bnd = ring_striped.striped_band(cfg, cp, t, r - src)
      q_ids, kv_ids = ids[:, r::cp], ids[:, src::cp]
      assert bnd.is_causal and bnd.window is None, bnd  # lo in {0, 1}
      shift = packed.diagonal_shift(cfg, BlockMask(
          q_offset=bnd.q_offset, kv_offset=bnd.kv_offset,
          q_segment_ids=q_ids, kv_segment_ids=kv_ids))
      docs, fits = block(jnp.asarray(q_ids), jnp.asarray(kv_ids),
                         bnd.q_offset, bnd.kv_offset)
      assert bool(fits) and shift == bnd.kv_offset - bnd.q_offset
      want = ((q_ids[0][:, None] == kv_ids[0][None, :])
              & (pos[src::cp][None, :] <= pos[r::cp][:, None]))
      got = ragged_visibility(docs, 0, t, t, causal=True)
      np.testing.assert_array_equal(got, want, err_msg=f"cp {cp} {r}<-{src}")
      np.testing.assert_array_equal(covered_rows(docs, 0, t), want.any(-1))
      checked += 1
  assert checked == 3 * (4 + 9 + 16 + 25)


def test_length_classes_size_each_call_by_its_documents():
  """A block's classes grow by RATIO from SMALLEST to the row; class 0's
  menu of virtual batches (one tile each) reaches T (documents of one
  token), the others take a dense row's tiles a call."""
  geo = packed.geometries(32768, 32768)
  assert [(g.length, g.batches) for g in geo] == [
      (32, (256, 1024, 4096, 16384, 32768)), (128, (256,)), (512, (64,)),
      (2048, (16,)), (8192, (4,)), (32768, (1,))]
  assert [(g.length, g.batches) for g in packed.geometries(61, 61)] == [
      (32, (1, 4, 16, 61)), (61, (1,))]
  assert [(g.length, g.batches) for g in packed.geometries(300, 200)] == [
      (32, (3, 12, 48, 192, 300)), (128, (3,)), (300, (1,))]
  # 4 rows: at most 65535 // 4 virtual batches a row in one call.
  assert packed.geometries(32768, 32768, 4)[0].batches == (
      256, 1024, 4096, 16383)


def test_packed_layout_counts_the_calls_and_flags_what_does_not_fit(
    monkeypatch):
  """Calls follow the documents' classes, not their number (SMALLEST = 4
  here, so a row of 40 has classes 4, 16, 40); an id in two query runs, or whose
  keys are split, or (striped) a first key before its first query's
  diagonal does not fit."""
  import ragged_cudnn
  monkeypatch.setattr(packed, "SMALLEST", 4)
  t = 40
  # Each check a block of 2 rows (a row alone twice); the blocks of one set
  # of static options in one program (vmapped): a program each was most of
  # the time. Made after the constants they read are set.
  two = lambda ids: np.concatenate([ids] * (2 // len(ids)))
  calls_of = jax.jit(jax.vmap(lambda ids: packed.calls(
      packed.documents(ids, ids, same=True), t, t)))

  @functools.partial(jax.jit, static_argnums=(2, 3))
  def layout(q_ids, kv_ids, shift, same):
    return jax.vmap(lambda q, kv: packed.layout(q, kv, shift, same))(q_ids,
                                                                     kv_ids)

  many = np.arange(t, dtype=np.int32)[None] // 2  # 20 documents of 2
  eights = np.arange(t, dtype=np.int32)[None] // 8  # 5 of 8: class 16, 3 a call
  mixed = np.array([[0] * 17 + list(range(1, 24))], np.int32)
  split = np.array([[1] * 10 + [2] * 10 + [1] * 20], np.int32)  # id 1 twice
  ones = np.ones((1, t), np.int32)
  other = np.array([[7] * 5 + [1] * 35], np.int32)  # keys of no query: fine
  counted = ((many, 1), (eights, 2), (ones, 1), (mixed, 2),
             (np.concatenate([many, eights]), 3))
  got = calls_of(jnp.asarray(np.stack([two(ids) for ids, _ in counted])))
  for (ids, want), n in zip(counted, np.asarray(got)):
    assert n == want == ragged_cudnn.expected_calls(ids, 4, t), (ids, n)
  # (q ids, kv ids, shift, same, whether they fit), by (shift, same).
  checks = collections.defaultdict(list)
  for q_ids, kv_ids, shift, want in (
      (ones, other, None, True), (split, split, None, False),
      (ones, split, None, False), (ones, ones, 0, True),
      (np.array([[0] * 3 + [1] * 37], np.int32), ones, 1, False),
      (np.array([[1] * 37 + [2] * 3], np.int32), ones, 1, True)):
    checks[shift, False].append((two(q_ids), two(kv_ids), want))
  # One id array: the one-sort check agrees with the general one.
  shuffled = np.array([[3] * 9 + [0] * 11 + [2] * 20], np.int32)
  for ids, want in ((many, True), (eights, True), (mixed, True),
                    (ones, True), (shuffled, True), (split, False),
                    (np.concatenate([many, split]), False)):
    for shift, same in itertools.product((None, 2), (False, True)):
      checks[shift, same].append((two(ids), two(ids), want))
  for (shift, same), blocks in checks.items():
    q_ids, kv_ids, want = map(np.stack, zip(*blocks))
    fits = layout(jnp.asarray(q_ids), jnp.asarray(kv_ids), shift, same)
    np.testing.assert_array_equal(np.asarray(fits), want,
                                  err_msg=f"shift {shift}, same {same}")
  # Past MAX_BATCHES virtual batches a call, class 0 loops as well: 20
  # documents, menu (1, 4, 8).
  monkeypatch.setattr(packed, "MAX_BATCHES", 8)
  calls_of = jax.jit(lambda ids: packed.calls(
      packed.documents(ids, ids, same=True), t, t))  # traced anew
  assert int(calls_of(jnp.asarray(many))) == 3


def _id_rows(seed, count, t):
  """``count`` rows of ``t`` ids: documents of random lengths under ids
  drawn from a small pool (so that some id is in two runs), in a random
  order, some ending in padding id 0, some spread far apart."""
  rng = np.random.default_rng(seed)
  rows = []
  for i in range(count):
    docs = rng.integers(2, t // 2)
    row = ref.random_segments(int(rng.integers(1 << 30)), 1, t, docs)[0]
    pool = rng.permutation(t)[:docs] if i % 3 else rng.integers(0, docs, docs)
    row = pool[row]
    if i % 4 == 1:
      row[-rng.integers(1, 6):] = 0
    rows.append(ref.spread(row) if i % 5 == 4 else row)
  return np.asarray(rows, np.int32)


def test_the_ids_table_decides_as_the_sort_does_where_it_knows():
  """fits.by_table, with no sort, gives fits.by_sort's answer on every row
  it knows (ids within as many values as the row has tokens: packing's
  0, 1, 2, ... in any order, padding 0 included), and knows no row whose
  ids spread wider; for two id arrays (and a causal shift) the documents
  it finds equal the sort's wherever the ids fit."""
  from jax_ring._src.backends.cudnn import fits
  t = 24
  q = _id_rows(0, 120, t)
  kv = np.where(np.arange(120)[:, None] % 2 == 0, q, _id_rows(1, 120, t))
  kv[::6] = np.sort(q[::6], axis=1)  # each id's keys one range

  def both(q, kv, shift, same):
    one = lambda f, *a: jax.vmap(lambda x, y: f(x[None], y[None], *a))(q, kv)
    known, table = one(fits.by_table, shift, same)
    docs = [one(lambda x, y, by: packed.documents(x, y, shift, same, by),
                by) for by in (True, False)]
    return known, table, one(fits.by_sort, shift, same), docs

  for same, shift in ((True, None), (False, None), (False, 1)):
    kv_ids = q if same else kv
    known, table, sort, (d_table, d_sort) = map(
        lambda x: jax.tree.map(np.asarray, x),
        jax.jit(both, static_argnums=(2, 3))(q, kv_ids, shift, same))
    both_ids = np.concatenate([q, kv_ids], 1).astype(np.int64)
    span = both_ids.max(1) - both_ids.min(1)
    np.testing.assert_array_equal(known, span < (t if same else 2 * t))
    assert 15 <= (~known).sum() and 80 <= known.sum(), known.sum()
    np.testing.assert_array_equal(table[known], sort[known])
    assert sort[known].any() and not sort[known].all(), (same, shift)
    agree = known & sort
    for name in ("kv_start", "kv_len"):
      np.testing.assert_array_equal(getattr(d_table, name)[agree],
                                    getattr(d_sort, name)[agree], name)
  # Narrow integer ids are widened; a span past int32's range is not known.
  from jax_ring._src.core import idtable
  assert bool(idtable.slots(jnp.asarray([np.arange(t) % 7], jnp.int8))[1])
  assert not bool(idtable.slots(jnp.asarray(
      [[-2**31, 2**31 - 1] + [0] * (t - 2)], jnp.int32))[1])


# name: (q ids, kv ids or None = the same array, case kwargs); 2 rows of 61
# tokens, many documents in one row (9 in "few"), 5 or fewer in the other.
def _many(seed, docs, length=61):
  return np.concatenate([ref.random_segments(seed, 1, length, docs),
                         ref.random_segments(seed + 1, 1, length, 5)])


def _split(ids):
  """Row 0's last document also takes its first 3 tokens: in two runs."""
  ids = ids.copy()
  ids[0, :3] = ids[0, -1]
  return ids


def _striped_many(seed, r, src, cp=2):
  ids = _many(seed, 45, 61 * cp)
  return ids[:, r::cp], ids[:, src::cp]


MANY = {
    "same_causal": (_many(1, 40), None, dict(is_causal=True)),
    "same_causal_few": (_many(8, 9), None, dict(is_causal=True)),
    # Ids spread far apart: decided by the sort (passes._decide).
    "same_window": (ref.spread(_many(2, 36)), None,
                    dict(is_causal=True, window=(3, 0))),
    "different_full": (ref.spread(_many(3, 40)), ref.spread(_many(4, 30)),
                       {}),
    "striped_next": (*_striped_many(5, 0, 1), dict(is_causal=True,
                                                   kv_offset=1)),
    "not_contiguous": (_split(_many(6, 40)), None, dict(is_causal=True)),
}


# The default run: SMALLEST = 4 (classes, menus and loops), the causal
# one-array row as one handler a pass, the two-array row as the calls' loop
# (kept where a pass's stats would be too large). The rest (the library's
# classes, the window, offset and split-id rows, the other path of each
# row) under -m slow.
_DEFAULT_RUN = {(True, 4, "same_causal"), (False, 4, "different_full")}


@pytest.mark.parametrize("name, smallest, one_handler", [
    pytest.param(name, smallest, one_handler, marks=() if (
        one_handler, smallest, name) in _DEFAULT_RUN else pytest.mark.slow)
    for one_handler in (False, True) for smallest in (4, 32) for name in MANY])
def test_packed_calls_match_the_reference(name, smallest, one_handler,
                                          monkeypatch):
  """The packed forward and backward on cuDNN's ragged semantics (replayed in
  jnp, tests/ragged_cudnn.py): the calls of each length class writing into
  one buffer (SMALLEST = 4: classes 4, 16 and 61, class 0's menu, loops of
  calls; 32: classes 32 and 61), or the xla backend where the layout does
  not fit, equal the float64 reference in out, lse and every gradient;
  as the calls' switch and loop, and as one handler a pass (the handler's
  tables replayed class by class)."""
  import ragged_cudnn
  from jax_ring._src.core.mask import BlockMask
  monkeypatch.setattr(ffi, "sdpa", ragged_cudnn.sdpa)
  monkeypatch.setattr(ffi, "sdpa_pass", ragged_cudnn.sdpa_pass)
  path = passes if one_handler else packed
  monkeypatch.setattr(packed, "SMALLEST", smallest)
  q_ids, kv_ids, kw = MANY[name]
  same = kv_ids is None
  kv_ids = q_ids if same else kv_ids
  b, t, s = 2, q_ids.shape[1], kv_ids.shape[1]
  q, k, v, do = ref.random_qkv(7, b, t, s, 4, 2, 8)
  case = ref.Case(0.3, q_segment_ids=q_ids, kv_segment_ids=kv_ids, **kw)
  cfg = ref.config(case)
  bnd = band(cfg, case.q_offset, case.kv_offset, t, s)

  def f(q, k, v, q_ids, kv_ids):
    mask = BlockMask(q_offset=case.q_offset, kv_offset=case.kv_offset,
                     q_segment_ids=q_ids,
                     kv_segment_ids=None if same else kv_ids)
    out, lse = path.forward(q, k, v, mask, cfg, bnd)
    grads = path.backward(q, k, v, mask, out, lse, do, cfg, bnd)
    shift = packed.diagonal_shift(cfg, mask)
    docs = packed.documents(q_ids, mask.kv_ids(), shift, same=same)
    return out, lse, grads, (packed.layout(q_ids, mask.kv_ids(), shift),
                             packed.calls(docs, t, s))

  out, lse, grads, (fits, calls) = jax.jit(f)(q, k, v, jnp.asarray(q_ids),
                                             jnp.asarray(kv_ids))
  assert bool(fits) == (name != "not_contiguous")
  if same and fits and not kw.get("kv_offset"):
    assert int(calls) == ragged_cudnn.expected_calls(q_ids, smallest, t), (
        int(calls))
  check((out, grads), q, k, v, do, case, lse)


def test_a_pass_serves_shapes_whose_stats_fit_its_bound():
  """A packed block runs as one handler a pass where every class's stats
  fit ``passes.MAX_STATS_BYTES`` and twice q's bytes (a 32k row of 16
  heads: 104 MiB), else as the calls' loop (64k of 32 heads: 704 MiB);
  every table slice a call reads is 16-byte aligned (every call starts at
  a multiple of its class's ``M_c``), and each class's menu ascends to
  ``M_c``."""
  rows = lambda t, n: jax.ShapeDtypeStruct((1, t, n, 128), jnp.bfloat16)
  assert passes.serves(rows(32768, 16), rows(32768, 8), True)
  assert not passes.serves(rows(65536, 32), rows(65536, 8), True)
  for t, s, same in ((32768, 32768, True), (1000, 1000, True),
                     (61, 45, False)):
    lay = passes.layout(t, s, 1, same)
    assert all(x % 4 == 0 for x in lay.slots + lay.batches), lay
    assert all(p % m == 0 for p, m in zip(lay.slots, lay.batches)), lay
    assert lay.slots[0] >= min(t, s)
    for menu, m in zip(lay.menus, lay.batches):
      assert menu[0] == 1 and menu[-1] == m and list(menu) == sorted(
          set(menu)), lay
  # Every chunk of offsets a call reads ends on the row's end, as a call's
  # own table does, and holds the documents of its ranks in order; past
  # them, the row's end and no rows (a call of its class's menu that holds
  # the rest reads the row's end at its last entry).
  ids = jnp.asarray(_many(1, 40))
  b, t, n, kh, h = 2, ids.shape[1], 4, 2, 8
  q = jnp.zeros((b, t, n, h), jnp.bfloat16)
  kv = jnp.zeros((b, t, kh, h), jnp.bfloat16)
  lay = passes.layout(t, t, b, True)
  @jax.jit
  def tables(ids):  # one program, not an op at a time
    docs = packed.documents(ids, ids, same=True)
    return docs, passes.tables(docs, lay, q, kv, kv)

  docs, tab = tables(ids)
  offs, cls, rank = map(np.asarray, (tab.offs, docs.cls, docs.rank))
  for c, (base, m) in enumerate(zip(lay.offs_base(), lay.batches)):
    for j in range(lay.slots[c] // m):
      chunk = offs[:, :, base + j * (m + 4):base + j * (m + 4) + m + 1]
      assert (chunk[0, :, m] == t * n * h).all(), (c, j)
      for row in range(b):
        mine = np.flatnonzero((cls[row] == c) & (rank[row] // m == j))
        starts = np.asarray(docs.q_start)[row, mine] * n * h
        np.testing.assert_array_equal(
            chunk[0, row, rank[row, mine] % m], starts)
        assert (chunk[:, row, mine.size:] == np.asarray(
            [t * n * h, t * kh * h, t * kh * h, t * n * h])[:, None]).all()
        lens = np.asarray(tab.lens)[:, row, lay.base()[c] + j * m:][:, :m]
        assert (lens[:, mine.size:] == 0).all(), (c, j)


def _replayed_passes(monkeypatch):
  """The cuDNN backend on the CPU with its handlers replayed in jnp
  (``ragged_cudnn``), small length classes (SMALLEST = 4, MAX_BATCHES =
  8: class 0 loops too), tiles of 4 tokens (their branch traced, the
  longer documents taking the handler) and one step-1 tail size (the last
  quarter of a shard, or the whole of it)."""
  import ragged_cudnn
  from jax_ring._src.strategies.ring import reach
  monkeypatch.setattr(ffi, "sdpa", ragged_cudnn.sdpa)
  monkeypatch.setattr(ffi, "sdpa_pass", ragged_cudnn.sdpa_pass)
  monkeypatch.setattr(packed, "SMALLEST", 4)
  monkeypatch.setattr(packed, "MAX_BATCHES", 8)
  monkeypatch.setattr(tiles, "SIZES", (4,))
  monkeypatch.setattr(reach, "TAIL_DIVISORS", (4,))
  cudnn_blocks_on_the_cpu(monkeypatch)


# The slowest test to compile here (about 50 s): -m slow and the GPU lane,
# whose ring runs the real handlers in shard_map.
@pytest.mark.slow
@pytest.mark.parametrize("load_balance", [None, "dual_chunk", "striped"],
                         ids=["contiguous", "dual_chunk", "striped"])
def test_packed_calls_inside_shard_map(load_balance, monkeypatch):
  """The ring's packed blocks on cuDNN's ragged semantics (replayed in jnp)
  inside shard_map, on 2 simulated devices, rows of many documents in
  several length classes (SMALLEST = 4; and MAX_BATCHES = 8, so class 0
  loops too): the loops' carries vary over the mesh axis as their calls'
  results do, and the output and gradients equal the reference's. On
  contiguous shards the second row's document 0 crosses the shards, so
  the ring's reached step runs (``reached.reached_loop``)."""
  import jax_ring
  from jax.sharding import PartitionSpec as P
  from helpers import layout_vjp, mesh
  _replayed_passes(monkeypatch)
  cp, t = 2, 84
  ids = _many(14, 70, t)
  q, k, v, do = ref.random_qkv(15, 2, t, t, 4, 2, 8)
  spec = P(None, "cp")
  f = jax.shard_map(
      lambda q, k, v, ids: jax_ring.ring_attention(
          q, k, v, axis_name="cp", implementation="cudnn", is_causal=True,
          segment_ids=ids, load_balance=load_balance),
      mesh=mesh(cp), in_specs=(spec,) * 4, out_specs=spec)
  check(layout_vjp(f, cp, load_balance, q, k, v, do, jnp.asarray(ids)),
        q, k, v, do, ref.Case(8**-0.5, is_causal=True, q_segment_ids=ids,
                              kv_segment_ids=ids))


# On GPUs: test_cudnn.py::test_ring_prepares_the_own_packed_pass.
@pytest.mark.slow
def test_ring_prepares_the_own_pass_of_two_id_arrays(monkeypatch):
  """The ring on contiguous shards (2 simulated devices), its packed
  blocks on cuDNN's semantics replayed in jnp, the ids given as a (query,
  key) pair (document 3's keys renamed: its queries see none): the own
  block's pass gets its tables and branch index computed before the reach
  test's branch (``mask.prepared``, built from the block's two arrays),
  and out and gradients equal the float64 reference's."""
  import jax_ring
  from jax.sharding import PartitionSpec as P
  from helpers import layout_vjp, mesh
  _replayed_passes(monkeypatch)
  monkeypatch.setattr(tiles, "SIZES", ())  # no tiles: fewer branches to compile
  seen = prepared_passes(monkeypatch)
  ids = np.repeat(np.arange(7), [9, 16, 8, 12, 7, 6, 6])[None]
  kv_ids = np.where(ids == 3, 9, ids)
  q, k, v, do = ref.random_qkv(22, 1, 64, 64, 4, 2, 8)
  seg = (jnp.asarray(ids), jnp.asarray(kv_ids))
  f = jax.shard_map(
      lambda q, k, v, s: jax_ring.ring_attention(
          q, k, v, axis_name="cp", is_causal=True, segment_ids=s,
          implementation="cudnn"), mesh=mesh(2),
      in_specs=(P(None, "cp"),) * 3 + ((P(None, "cp"),) * 2,),
      out_specs=P(None, "cp"))
  got = layout_vjp(f, 2, None, q, k, v, do, seg)
  assert set(seen) == {"forward", "backward"}, seen
  check(got, q, k, v, do, ref.Case(8**-0.5, is_causal=True,
                                   q_segment_ids=ids, kv_segment_ids=kv_ids))


def test_recording_notes_each_traced_call_with_its_graph_key(monkeypatch):
  """``recording()`` collects every cuDNN call traced inside, with what
  ``workspace_bytes`` needs to rebuild its graph: a causal block's forward
  and backward, and a packed block (slots); nothing outside the block. The
  call's workspace is one of its results, of the size that graph needs."""
  import jax_ring
  from jax_ring._src.core.mask import BlockMask

  monkeypatch.setattr(cudnn, "unsupported", lambda *_: None)  # as on a GPU
  # Sizing a call's workspace builds its graph on the GPU; here, 256 bytes.
  monkeypatch.setattr(ffi, "workspace_bytes", lambda call: 256)
  b, t, n, k, h = 2, 8, 4, 2, 16
  q = jnp.ones((b, t, n, h), jnp.bfloat16)
  kv = jnp.ones((b, t, k, h), jnp.bfloat16)
  lse = jnp.zeros((b, t, n), jnp.float32)
  cfg = jax_ring.AttentionConfig(0.25, is_causal=True)
  ids = jnp.asarray(ref.random_segments(3, b, t, 2))
  with cudnn.recording() as calls:
    fwd = jax.make_jaxpr(lambda q, kv: cudnn.forward(
        q, kv, kv, None, BlockMask(), cfg))(q, kv)
    jax.make_jaxpr(lambda q, kv: cudnn.backward(
        q, kv, kv, None, BlockMask(), q, lse, q, None, cfg))(q, kv)
    jax.make_jaxpr(lambda q, kv: cudnn.forward(
        q, kv, kv, None, BlockMask(q_segment_ids=ids), cfg))(q, kv)
  assert ffi.RECORD is None
  assert "u8[256]" in str(fwd)  # the workspace: one more result of the call
  # A packed block of 8 tokens: one class of length 8, whose menu of
  # virtual batches a call (1, 4, then M_c = 8) are the graphs its pass
  # may run, each on one row.
  assert [(c["backward"], c["slots"], c["ragged_len"]) for c in calls] == [
      (False, 0, 0), (True, 0, 0), (False, 1, 8), (False, 4, 8),
      (False, 8, 8)]
  assert {c["q"] for c in calls[2:]} == {(1, t, n, h)}
  assert calls[0] == dict(backward=False, q=(b, t, n, h), k=(b, t, k, h),
                          v=(b, t, k, h), dtype="bfloat16", scale=0.25,
                          row_start=0, col_start=0, right_bound=0,
                          left_bound=0, padding=False, softcap=0.0, slots=0,
                          ragged_len=0)


def test_a_value_head_dim_unlike_the_keys_reaches_the_calls(monkeypatch):
  """v (B, S, K, Hv) with Hv != H: the forward's out is (B, T, N, Hv), also
  for a block that sees no key, each call records v's shape, and the
  stacked dK/dV backward refuses."""
  import jax_ring
  from jax_ring._src.core.mask import BlockMask

  monkeypatch.setattr(cudnn, "unsupported", lambda *_: None)  # as on a GPU
  monkeypatch.setattr(ffi, "workspace_bytes", lambda call: 256)
  b, t, n, k, h, hv = 2, 8, 4, 2, 24, 16
  q = jnp.ones((b, t, n, h), jnp.bfloat16)
  kk = jnp.ones((b, t, k, h), jnp.bfloat16)
  v = jnp.ones((b, t, k, hv), jnp.bfloat16)
  out = jnp.ones((b, t, n, hv), jnp.bfloat16)
  lse = jnp.zeros((b, t, n), jnp.float32)
  cfg = jax_ring.AttentionConfig(0.25, is_causal=True)
  ids = jnp.asarray(ref.random_segments(3, b, t, 2))
  args = lambda mask: (q, kk, v, None, mask)
  with cudnn.recording() as calls:
    for mask in (BlockMask(), BlockMask(q_segment_ids=ids),
                 BlockMask(kv_offset=t)):  # the last sees no key
      fwd = jax.eval_shape(lambda: cudnn.forward(*args(mask), cfg))
      assert fwd[0].shape == (b, t, n, hv), fwd
      grads = jax.eval_shape(lambda: cudnn.backward(
          *args(mask), out, lse, out, None, cfg))
      assert [g.shape for g in grads[:3]] == [q.shape, kk.shape, v.shape]
  # packed: the pass's 3 graphs a direction (its menu 1, 4, 8), each on
  # one row
  assert [c["v"] for c in calls] == [v.shape] * 2 + [(1,) + v.shape[1:]] * 6
  with pytest.raises(ValueError, match="stacked dK/dV need key and value of "
                     "one shape"):
    cudnn.backward_dkv(*args(BlockMask()), out, lse, out, None, cfg)


@pytest.mark.parametrize("h, hv, why", [
    (192, 128, None), (128, 64, None), (256, 256, None), (72, 136, None),
    (192, 132, "query/key head dim 192 with value head dim 132 (cuDNN needs "
               "each a multiple of 8, at most 256)"),
    (264, 128, "query/key head dim 264 with value head dim 128 (cuDNN needs "
               "each a multiple of 8, at most 256)"),
])
def test_cudnn_head_dims(h, hv, why):
  assert cudnn.unsupported_head_dims(h, hv) == why
