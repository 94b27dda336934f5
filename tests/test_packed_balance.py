"""The attention work's balance over the devices of each load-balance layout
(``work_balance``, reported by ``explain(segment_ids=...)`` and
``benchmarks/packed_balance.py``), against a direct count of the visible
(query, key) pairs of the float64 reference's mask."""

import re

import jax_ring
import numpy as np
import pytest

import reference as ref
from jax_ring._src.strategies.layout import work_balance


def _counted(ids, cp, layout, causal=True):
  """Most-loaded device's visible pairs over the mean, counted from the
  reference's visibility with each token placed by the layout."""
  b, s = ids.shape
  vis = ref.visibility(ref.Case(1.0, is_causal=causal, q_segment_ids=ids,
                                kv_segment_ids=ids), b, 1, s, s)
  pairs = vis[:, 0].sum(-1).sum(0)  # (S,) keys each query sees, all rows
  owner = np.arange(s) // (s // cp)  # device of each slot in the layout
  if layout is not None:
    slots = np.asarray(jax_ring.reorder_for_load_balance(
        np.arange(s)[None], cp, layout=layout))[0]  # token in each slot
    owner = owner[np.argsort(slots)]
  work = np.bincount(owner, weights=pairs, minlength=cp)
  return work.max() / work.mean()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", ["dual_chunk", "striped", None])
def test_balance_is_the_count_of_visible_pairs(layout, causal):
  rng = np.random.default_rng(0)
  ids = np.stack([np.repeat(np.arange(6), np.diff(np.r_[0, np.sort(
      rng.choice(np.arange(1, 96), 5, replace=False)), 96]))
                  for _ in range(2)])
  assert work_balance(ids, 4, layout, causal) == pytest.approx(
      _counted(ids, 4, layout, causal), rel=1e-6)


def test_one_document_and_a_long_tailed_row():
  one = np.zeros((1, 64), np.int32)
  assert work_balance(one, 4, "dual_chunk") == pytest.approx(1.0)
  last = sum(range(49, 65)) / (sum(range(1, 65)) / 4)  # tokens 48-63
  assert work_balance(one, 4, None) == pytest.approx(last)
  tailed = np.repeat(np.arange(4), [40, 8, 8, 8])[None]
  assert work_balance(tailed, 4, "dual_chunk") > 2.0
  assert work_balance(tailed, 4, "striped") < 1.15


def test_explain_reports_the_balance_of_given_rows():
  ids = np.repeat(np.arange(4), [40, 8, 8, 7])[None]  # 63 tokens: padded
  choice = jax_ring.explain((1, 63, 8, 16), (1, 63, 2, 16), cp_size=4,
                            is_causal=True, segment_ids=ids)
  found, why = choice.defaults["balance"]
  assert set(found) == {"dual_chunk", "striped", "contiguous"}
  assert found["striped"] < found["dual_chunk"], found
  assert "most-loaded of 4 ring devices" in why
  assert why.endswith("load_balance='striped' evens these rows best"), why
  # Unpadded rows: what balance_documents' order would give them.
  whole = jax_ring.explain((1, 64, 8, 16), (1, 64, 2, 16), cp_size=4,
                           is_causal=True, segment_ids=np.repeat(
                               np.arange(4), [40, 8, 8, 8])[None])
  assert re.search(r"in jax_ring.balance_documents' order, contiguous shards "
                   r"give \d\.\d{3}$", whole.defaults["balance"][1])
  gather = jax_ring.explain((1, 63, 8, 16), (1, 63, 2, 16), cp_size=4,
                            segment_ids=ids, context_parallel=
                            jax_ring.ContextParallel(strategy="all_gather"))
  assert set(gather.defaults["balance"][0]) == {"dual_chunk", "contiguous"}
  with pytest.raises(ValueError, match=re.escape(
      "segment_ids must be (B, T) = (1, 63) host ints; got int64 of shape "
      "(1, 62)")):
    jax_ring.explain((1, 63, 8, 16), (1, 63, 2, 16), cp_size=4,
                     segment_ids=ids[:, :62].astype(np.int64))


def test_explain_reports_the_rows_work_against_one_document():
  """``work``: the pairs each id's tokens make (causal: a key at or before
  its query), over the row's as one document, averaged over rows; an id
  in two runs counts once; under SHORT_WORK it suggests sharding the
  batch instead of the sequence."""
  from jax_ring._src import auto
  short = np.repeat(np.arange(64), 16)[None]  # 64 documents of 16 tokens
  split = np.repeat([0, 1, 0, 2], 256)[None]  # id 0: 512 tokens in two runs
  for ids, causal, pairs in (
      (short, True, 64 * 16 * 17 / 2), (short, False, 64 * 16 * 16),
      (split, True, (512 * 513 + 2 * 256 * 257) / 2),
      (np.zeros((1, 1024), np.int32), True, 1024 * 1025 / 2)):
    share, why = jax_ring.explain(
        (1, 1024, 8, 16), (1, 1024, 2, 16), cp_size=4, is_causal=causal,
        segment_ids=ids).defaults["work"]
    whole = 1024 * 1025 / 2 if causal else 1024 * 1024
    assert share == pytest.approx(pairs / whole, abs=1e-4), (ids, share)
    assert f"{100 * pairs / whole:.1f}% of each row's" in why, why
    assert ("shard the batch" in why) == (pairs / whole < auto.SHORT_WORK)


def test_explain_says_whether_cudnns_packed_path_serves_the_rows():
  """``cudnn_packed``: every id one run of tokens, the check the packed
  path makes at run time (``packed.layout``); otherwise it names the row
  and the id."""
  import jax
  import jax.numpy as jnp
  from jax_ring._src.backends.cudnn import packed
  rng = np.random.default_rng(0)
  rows = [np.repeat(np.arange(4), [40, 8, 8, 8])[None],
          np.repeat([3, 0, 2, 1], 16)[None],  # one run each, unordered
          np.repeat([0, 1, 0, 2], 16)[None],  # id 0 twice (left padding)
          rng.integers(0, 3, (2, 64))]
  # The run-time check on each row, all in one program (a block fits where
  # each of its rows does; op by op, most of this test's time).
  each_row = jax.jit(jax.vmap(lambda x: packed.layout(x[None], x[None],
                                                      same=True)))
  row_fits = np.asarray(each_row(jnp.asarray(np.concatenate(rows),
                                             jnp.int32)))
  ends = np.cumsum([len(ids) for ids in rows])
  found = []
  for ids, end in zip(rows, ends):
    fits, why = jax_ring.explain((ids.shape[0], 64, 4, 16),
                                 (ids.shape[0], 64, 4, 16), cp_size=4,
                                 is_causal=True,
                                 segment_ids=ids).defaults["cudnn_packed"]
    assert fits == row_fits[end - len(ids):end].all(), (ids, why)
    if not fits:
      assert re.match(r"row \d: id \d is \d+ separate runs", why), why
    found.append(fits)
  assert found == [True, True, False, False]
  assert not jax_ring.explain(
      (1, 64, 4, 16), (1, 64, 4, 16), cp_size=4,
      segment_ids=rows[2]).defaults["cudnn_packed"][0]


def test_balance_documents_keeps_each_document_whole_and_evens_the_work():
  """``balance_documents``' order moves whole documents, each in its own
  order, never leaves a row less even than it came, and on a long-tailed
  mix (lognormal lengths, median 300, sigma 1, capped at 2,048: no
  document holds a device's share of the work, which no order of whole
  documents could even out) of 64k rows over 4 contiguous shards brings
  the most-loaded device within 5% of the mean. The attention of the
  ordered row is the user's, reordered: documents attend only within
  themselves."""
  rng = np.random.default_rng(3)
  s, cp = 65536, 4
  rows = []
  for _ in range(5):
    lengths = np.clip(rng.lognormal(np.log(300), 1.0, 2000).astype(int), 1,
                      2048)
    n = np.searchsorted(np.cumsum(lengths), s)  # the last one cut to fit
    lengths = np.append(lengths[:n], s - lengths[:n].sum())
    rows.append(np.repeat(np.arange(lengths.size), lengths))
  ids = np.stack(rows).astype(np.int32)
  order = jax_ring.balance_documents(ids, cp)
  new = np.take_along_axis(ids, order, 1)
  before, after = [], []
  for row, o, n in zip(ids, order, new):
    assert sorted(o) == list(range(s))
    for doc in np.unique(row):  # whole, in its own order, one run
      at = o[n == doc]
      assert (at == np.flatnonzero(row == doc)).all()
      assert np.all(np.diff(np.flatnonzero(n == doc)) == 1)
    before.append(work_balance(row[None], cp, None))
    after.append(work_balance(n[None], cp, None))
  assert all(a <= b * (1 + 1e-6) for a, b in zip(after, before))
  assert max(before) > 1.1 and max(after) < 1.05, (before, after)


def test_balance_documents_refuses_an_id_in_two_runs():
  ids = np.asarray([[5, 5, 3, 3, 7, 7, 3, 3]])
  with pytest.raises(ValueError, match="segment_ids: id 3 is two runs"):
    jax_ring.balance_documents(ids, 2)
  even = np.asarray([[1, 1, 1, 2, 3, 3]])  # already even: left as it is
  np.testing.assert_array_equal(jax_ring.balance_documents(even, 1),
                                [np.arange(6)])
  with pytest.raises(ValueError, match="cp_size=3 must divide the row's 8"):
    jax_ring.balance_documents(ids[:, [0, 2, 6, 6, 6, 6, 6, 6]], 3)


def test_explain_says_which_ring_steps_the_rows_run():
  """``ring_steps``: on contiguous shards (4 of 12 tokens) the branch the
  ring's reach test takes for the given rows, as the call computes it:
  none, step 1 on the last 3 rows of a shard (its one tail, a quarter),
  or every step to the last reached, naming ids spread too wide to number;
  and, where the ring runs every step (dual-chunk, a named K/V source),
  that it does."""
  docs = lambda lengths: np.repeat(np.arange(len(lengths)), lengths)[None]
  contiguous = jax_ring.ContextParallel(strategy="ring", load_balance=None)
  say = lambda ids, cpc=contiguous, causal=True: jax_ring.explain(
      (1, 48, 8, 16), (1, 48, 2, 16), cp_size=4, is_causal=causal,
      segment_ids=ids, context_parallel=cpc).defaults["ring_steps"]
  got, why = say(docs((6,) * 8))
  assert (got["last"], got["rows"]) == (0, 0) and "no step after" in why
  assert "spread" not in why
  # Ids spread wider than a row's tokens: the test merges ids 1-7, says so.
  got, why = say(docs((6,) * 8) * 1_000_003)
  assert got["last"] == 3 and why.endswith("to let it skip"), why
  got, why = say(docs((11, 2, 10, 1, 1, 10, 1, 1, 11)))
  assert (got["rows"], got["size"]) == (1, 3), got
  assert why == ("the ring runs one step, on the last 3 of each shard's 12 "
                 "rows: documents cross shard boundaries by at most 1 rows")
  assert say(docs((10, 3, 10, 3, 10, 3, 9)))[0]["size"] == 3
  got, why = say(docs((48,)))
  assert (got["last"], got["size"]) == (3, None)
  assert "steps 1 to 3, each sending a whole shard's K/V" in why
  # auto on contiguous shards, whose model picks Ulysses for these shapes:
  # the ring's own block and reach test first, Ulysses past the tails.
  auto = jax_ring.ContextParallel(strategy="auto", load_balance=None)
  assert jax_ring.explain((1, 48, 8, 16), (1, 48, 2, 16), cp_size=4,
                          is_causal=True).forward == "ulysses"
  assert say(docs((6,) * 8), auto)[1].startswith("the ring runs no step")
  got, why = say(docs((48,)), auto)
  assert got["beyond"] and why.startswith(
      "each device's own block and the reach test, then Ulysses"), why
  assert not say(docs((10, 3, 10, 3, 10, 3, 9)), auto)[0]["beyond"]
  dual = jax_ring.ContextParallel(strategy="auto")  # dual-chunk: no reach
  assert say(docs((6,) * 8), dual)[1].startswith("if the ring runs, ")
  for cpc in (jax_ring.ContextParallel(strategy="ring"),
              jax_ring.ContextParallel(strategy="ring", load_balance=None,
                                       kv_sends="gather")):
    got, why = say(docs((6,) * 8), cpc)
    assert got == {} and why.startswith("every ring step runs"), why
  assert "ring_steps" not in jax_ring.explain(
      (1, 48, 8, 16), (1, 48, 2, 16), cp_size=4, segment_ids=docs((48,)),
      context_parallel=jax_ring.ContextParallel(
          strategy="ulysses")).defaults


def test_subset_sum_finds_an_exact_fill_or_says_there_is_none():
  """``documents.exact_subset`` against every subset of small random pools."""
  import itertools
  from jax_ring._src.strategies import documents
  rng = np.random.default_rng(0)
  for _ in range(40):
    lengths = rng.integers(1, 20, 9)
    pool, room = list(range(9)), int(rng.integers(0, 60))
    fill = documents.exact_subset(pool, lengths, room)
    sums = {sum(lengths[list(c)]) for k in range(10)
            for c in itertools.combinations(pool, k)}
    assert (fill is not None) == (room in sums), (lengths, room, fill)
    if fill is not None:
      assert len(set(fill)) == len(fill) and lengths[fill].sum() == room


def test_balance_documents_puts_the_cuts_between_documents_where_it_can():
  """Where an order of whole documents can end every shard on a document's
  end within ALIGNED_SLACK of the evenest order's most-loaded shard, no
  document crosses a shard (the ring then runs no step after each
  device's own block, ``explain``'s ``ring_steps``); where it cannot (a
  document longer than a shard), the evenest order stays."""
  from jax_ring._src.strategies import documents
  rng = np.random.default_rng(0)
  lengths = np.clip(rng.lognormal(np.log(300), 1.0, 400).astype(int), 1,
                    2048)
  n = np.searchsorted(np.cumsum(lengths), 65536)  # 137 documents
  lengths = np.append(lengths[:n], 65536 - lengths[:n].sum())
  ids = np.repeat(np.arange(lengths.size), lengths)[None].astype(np.int32)
  new = np.take_along_axis(ids, jax_ring.balance_documents(ids, 4), 1)
  ends = np.flatnonzero(np.diff(new[0])) + 1  # where each document ends
  assert set(range(16384, 65536, 16384)) <= set(ends.tolist())
  assert work_balance(new, 4, None) < 1.02
  steps = jax_ring.explain(
      (1, 65536, 8, 16), (1, 65536, 2, 16), cp_size=4, is_causal=True,
      segment_ids=new, context_parallel=jax_ring.ContextParallel(
          strategy="ring", load_balance=None)).defaults["ring_steps"]
  assert steps[0]["last"] == 0, steps
  assert jax_ring.explain(
      (1, 65536, 8, 16), (1, 65536, 2, 16), cp_size=4, is_causal=True,
      segment_ids=ids).defaults["balance"][1].endswith(
          "and no document crosses a shard")
  # A document longer than a shard crosses in any order: the evenest stays.
  long = np.repeat(np.arange(3), [3000, 96, 1000])[None].astype(np.int32)
  order = jax_ring.balance_documents(long, 2)
  assert work_balance(np.take_along_axis(long, order, 1), 2, None) == min(
      work_balance(long[:, o], 2, None) for o in (
          np.arange(4096), np.r_[3096:4096, 0:3096],
          np.r_[3000:3096, 0:3000, 3096:4096]))
