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
  gather = jax_ring.explain((1, 63, 8, 16), (1, 63, 2, 16), cp_size=4,
                            segment_ids=ids, context_parallel=
                            jax_ring.ContextParallel(strategy="all_gather"))
  assert set(gather.defaults["balance"][0]) == {"dual_chunk", "contiguous"}
  with pytest.raises(ValueError, match=re.escape(
      "segment_ids must be (B, T) = (1, 63) host ints; got int64 of shape "
      "(1, 62)")):
    jax_ring.explain((1, 63, 8, 16), (1, 63, 2, 16), cp_size=4,
                     segment_ids=ids[:, :62].astype(np.int64))


def test_explain_says_whether_cudnns_packed_path_serves_the_rows():
  """``cudnn_packed``: every id one run of tokens, the check the packed
  path makes at run time (``packed.layout``); otherwise it names the row
  and the id."""
  import jax.numpy as jnp
  from jax_ring._src.backends.cudnn import packed
  rng = np.random.default_rng(0)
  rows = [np.repeat(np.arange(4), [40, 8, 8, 8])[None],
          np.repeat([3, 0, 2, 1], 16)[None],  # one run each, unordered
          np.repeat([0, 1, 0, 2], 16)[None],  # id 0 twice (left padding)
          rng.integers(0, 3, (2, 64))]
  found = []
  for ids in rows:
    fits, why = jax_ring.explain((ids.shape[0], 64, 4, 16),
                                 (ids.shape[0], 64, 4, 16), cp_size=4,
                                 is_causal=True,
                                 segment_ids=ids).defaults["cudnn_packed"]
    ids32 = jnp.asarray(ids, jnp.int32)
    assert fits == bool(packed.layout(ids32, ids32, same=True)), (ids, why)
    if not fits:
      assert re.match(r"row \d: id \d is \d+ separate runs", why), why
    found.append(fits)
  assert found == [True, True, False, False]
  assert not jax_ring.explain(
      (1, 64, 4, 16), (1, 64, 4, 16), cp_size=4,
      segment_ids=rows[2]).defaults["cudnn_packed"][0]
