"""The packed pass's dense band tiles (rows of short documents), on the
CPU against the float64 reference: the pass's switch takes the tiles
where every document fits one, and the handler otherwise. The handler and
the pass's fallback (the ``xla`` backend) are replaced by ones that
return NaN, so an exact result shows the tiles ran, and a NaN one that
the handler did."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ring._src.backends import cudnn
from jax_ring._src.backends.cudnn import ffi, passes, tiles, tiles_pallas
from jax_ring._src.backends.cudnn.band import band
from jax_ring._src.core.mask import BlockMask
from helpers import check, cudnn_blocks_on_the_cpu, lowering_for_gpus
import reference as ref


def short_ids(seed, b, t, most):
  """``(B, T)`` sorted ids of documents of 1 to ``most`` tokens; each
  row's first holds exactly ``most``."""
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(b):
    lens = [most]
    while sum(lens) < t:
      lens.append(int(rng.integers(1, most + 1)))
    rows.append(np.repeat(np.arange(len(lens)), lens)[:t])
  return np.stack(rows).astype(np.int32)


def nan_like(*xs):
  return tuple(jnp.full(x.shape, jnp.nan, x.dtype) for x in xs)


def poisoned(name, results, *args, **kw):
  """Stands in for the handler: NaN in every result."""
  return nan_like(*results)


@pytest.fixture
def small_tiles(monkeypatch):
  monkeypatch.setattr(tiles, "SIZES", (4, 8))
  monkeypatch.setattr(ffi, "sdpa_pass", poisoned)
  monkeypatch.setattr(passes, "xla", types.SimpleNamespace(
      forward=lambda q, k, v, *_: nan_like(
          jnp.zeros(q.shape[:3] + v.shape[3:], q.dtype),
          jnp.zeros(q.shape[:3], jnp.float32)),
      backward=lambda q, k, v, *_: nan_like(q, k, v) + (None,)))


@pytest.mark.parametrize("most, kw", [
    (8, dict(is_causal=True)),
    (4, dict(is_causal=True, window=(3, 0))),
    (8, {}),
    (5, dict(window=(2, 6))),
], ids=["causal", "causal_window_size4", "full", "window_ahead"])
@pytest.mark.sample(2)
def test_short_documents_take_band_tiles(most, kw, small_tiles):
  """Rows of 61 tokens whose documents hold at most ``most`` tokens run as
  tiles of the first size holding them (the last tile part padding), GQA
  with a value head dim unlike the key's: out, lse and every gradient
  equal the reference's."""
  ids = short_ids(most, 2, 61, most)
  b, t = ids.shape
  q, k, v, do = ref.random_qkv(3, b, t, t, 4, 2, 8, hv=16)
  case = ref.Case(0.3, q_segment_ids=ids, kv_segment_ids=ids, **kw)
  cfg = ref.config(case)
  bnd = band(cfg, 0, 0, t, t)

  @jax.jit
  def f(q, k, v, ids):
    mask = BlockMask(q_segment_ids=ids)
    out, lse = passes.forward(q, k, v, mask, cfg, bnd)
    return out, lse, passes.backward(q, k, v, mask, out, lse, do, cfg, bnd)

  out, lse, grads = f(q, k, v, jnp.asarray(ids))
  check((out, grads), q, k, v, do, case, lse)


def test_tiles_propagate_nan_as_jax_nn(small_tiles):
  """A NaN in one query and in one key: the tiles' NaN rows are exactly
  jax.nn's (causal, the documents as a boolean mask), the others equal
  it."""
  ids = short_ids(8, 2, 61, 8)
  q, k, v, _ = ref.random_qkv(5, 2, 61, 61, 4, 2, 8)
  q, k = q.at[0, 5, 1, 3].set(jnp.nan), k.at[1, 20, 0, 2].set(jnp.nan)
  cfg = ref.config(ref.Case(0.3, is_causal=True))
  out, _ = jax.jit(lambda q, k, v, ids: passes.forward(
      q, k, v, BlockMask(q_segment_ids=ids), cfg, band(cfg, 0, 0, 61, 61)))(
          q, k, v, jnp.asarray(ids))
  same = ids[:, None, :, None] == ids[:, None, None, :]
  want = jax.nn.dot_product_attention(q, k, v, mask=jnp.asarray(same),
                                      is_causal=True, scale=0.3)
  out, want = np.asarray(out), np.asarray(want)
  np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
  assert np.isnan(want).any() and not np.isnan(want).all()
  fine = ~np.isnan(want)
  np.testing.assert_allclose(out[fine], want[fine], atol=2e-5)


def test_a_longer_document_takes_the_handler(small_tiles):
  """One document of 9 tokens, past the largest tile (8): the pass runs
  the handler (here NaN), in both directions."""
  ids = short_ids(9, 2, 40, 9)
  q, k, v, do = ref.random_qkv(4, 2, 40, 40, 4, 2, 8)
  cfg = ref.config(ref.Case(0.3, is_causal=True))
  bnd = band(cfg, 0, 0, 40, 40)

  @jax.jit  # one program (op by op, most of the time)
  def run(q, k, v, ids):
    mask = BlockMask(q_segment_ids=ids)
    out, lse = passes.forward(q, k, v, mask, cfg, bnd)
    # Finite out and lse, so that only the handler can make dq NaN.
    dq, _, _ = passes.backward(q, k, v, mask, jnp.ones_like(out),
                               jnp.zeros_like(lse), do, cfg, bnd)
    return out, dq

  out, dq = run(q, k, v, jnp.asarray(ids))
  assert np.isnan(np.asarray(out)).all() and np.isnan(np.asarray(dq)).all()


def test_tiles_serve_one_id_array_within_their_logit_bound():
  """Tiles serve a block of one id array at equal offsets whose float32
  logits at the largest size fit ``MAX_LOGIT_BYTES``: a 32k row of 16
  heads (256 MiB causal), not a 128k row of 64 heads, nor two arrays."""
  rows = lambda t, n: jax.ShapeDtypeStruct((1, t, n, 128), jnp.bfloat16)
  ids = jnp.zeros((1, 32768), jnp.int32)
  causal = ref.config(ref.Case(0.1, is_causal=True))
  one = BlockMask(q_segment_ids=ids)
  assert tiles.serves(rows(32768, 16), rows(32768, 8), one, causal)
  assert not tiles.serves(rows(131072, 64), rows(131072, 8),
                          BlockMask(q_segment_ids=jnp.zeros((1, 131072))),
                          causal)
  two = BlockMask(q_segment_ids=ids, kv_segment_ids=ids + 0)
  assert not tiles.serves(rows(32768, 16), rows(32768, 8), two, causal)


@pytest.mark.slow  # as test_cudnn_band.py::test_packed_calls_inside_shard_map
def test_tiles_inside_shard_map(small_tiles, monkeypatch):
  """The ring's diagonal blocks of short documents on 2 simulated devices
  (contiguous shards; the handler NaN on a block of one id array, the
  replayed one on the off-diagonal block of two): output and gradients
  equal the reference's."""
  import jax_ring
  import ragged_cudnn
  from jax.sharding import PartitionSpec as P
  from helpers import layout_vjp, mesh
  monkeypatch.setattr(ffi, "sdpa", ragged_cudnn.sdpa)

  def diagonal_poisoned(name, results, *args, aliases=None, **kw):
    if aliases is None:  # fresh buffers: one id array
      return poisoned(name, results)
    return ragged_cudnn.sdpa_pass(name, results, *args, aliases=aliases, **kw)

  monkeypatch.setattr(ffi, "sdpa_pass", diagonal_poisoned)
  cudnn_blocks_on_the_cpu(monkeypatch)
  cp, t = 2, 84
  ids = short_ids(11, 2, t, 8)
  q, k, v, do = ref.random_qkv(12, 2, t, t, 4, 2, 8)
  spec = P(None, "cp")
  f = jax.shard_map(
      lambda q, k, v, ids: jax_ring.ring_attention(
          q, k, v, axis_name="cp", implementation="cudnn", is_causal=True,
          segment_ids=ids),
      mesh=mesh(cp), in_specs=(spec,) * 4, out_specs=spec)
  check(layout_vjp(f, cp, None, q, k, v, do, jnp.asarray(ids)), q, k, v, do,
        ref.Case(8**-0.5, is_causal=True, q_segment_ids=ids,
                 kv_segment_ids=ids))


# By default window_ahead; causal blocks of documents longer than a tile
# run on these kernels in test_pallas_tiles_take_a_ring_steps_block (ids in
# any layout: ranges that test_pallas_tiles_read_the_tiles_... equates).
@pytest.mark.parametrize("most, t, kw", [
    (9, 61, dict(window=(2, 6))),
    (16, 61, dict(is_causal=True)),
    (40, 97, dict(is_causal=True, window=(9, 0))),
    (70, 97, {}),
    (None, 61, dict(is_causal=True)),
], ids=["window_ahead", "causal", "long_causal_window", "long_full",
        "any_layout_causal"])
@pytest.mark.sample(1)
def test_pallas_tiles_interpreted(most, t, kw):
  """The tiles' Pallas kernels (interpreted on the CPU) in tiles of 16 on
  rows of 61 and 97 tokens (a padded last tile), documents shorter and
  longer than a tile, GQA, a value head dim unlike the key's, bfloat16:
  out, lse and every gradient equal the float64 reference's. ``most``
  None: ids in many runs each (``one_run=False``, as ``tiles.DIRECT``
  runs them)."""
  one_run = most is not None
  ids = short_ids(most, 2, t, most) if one_run else np.stack(
      [np.arange(t) // 5 % 4, np.arange(t) // 3 % 5]).astype(np.int32)
  q, k, v, do = (x.astype(jnp.bfloat16) for x in ref.random_qkv(
      7, 2, t, t, 4, 2, 16, hv=32))
  case = ref.Case(0.3, q_segment_ids=ids, kv_segment_ids=ids, **kw)
  check_interpreted(q, k, v, do, case, one_run=one_run)


def check_interpreted(q, k, v, do, case, **kernels):
  """The Pallas tiles of 16, interpreted, on ``case``'s ids: out, lse and
  every gradient against the float64 reference's."""
  cfg = ref.config(case)

  @jax.jit
  def run(q, k, v, ids):
    out, lse = tiles_pallas.forward(q, k, v, ids, cfg, 16, interpret=True,
                                    **kernels)
    return out, lse, tiles_pallas.backward(
        q, k, v, ids, out, lse, do, cfg, 16, interpret=True, **kernels)

  out, lse, grads = run(q, k, v, jnp.asarray(case.q_segment_ids))
  check((out, grads), q, k, v, do, case, lse)


def _ring_ids(name):
  """(q ids, kv ids, reference options) of a ring step's block."""
  g = short_ids(13, 2, 122, 20)
  if name == "earlier_shard":  # keys 0-44, queries 45-105, causal
    return g[:, 45:106], g[:, :45], dict(is_causal=True, q_offset=45)
  if name == "striped":  # queries 2i, keys 2j + 1 (kv_offset 1)
    return g[:, 0::2], g[:, 1::2][:, :45], dict(is_causal=True,
                                                 kv_offset=1)
  # keys 20 ahead, a window reaching both ways, ids in many runs
  ids = np.stack([np.arange(122) // 7 % 3, np.arange(122) // 4 % 5])
  return ids[:, :61], ids[:, 20:65], dict(window=(3, 30), kv_offset=20)


def direct_tiles(monkeypatch):
  """``tiles.DIRECT`` on the CPU: the cudnn backend's blocks take the
  Pallas tiles of 16 (interpreted) with no switch, every cuDNN handler
  NaN (so an exact result shows that the tiles ran)."""
  for name in ("sdpa", "sdpa_pass"):
    monkeypatch.setattr(ffi, name, poisoned)
  for name, value in (("DIRECT", True), ("SIZES", (16,)),
                      ("KERNEL", "pallas")):
    monkeypatch.setattr(tiles, name, value)
  monkeypatch.setattr(tiles_pallas, "INTERPRET", True)
  monkeypatch.setattr(cudnn, "unsupported", lambda *_: None)  # as on a GPU
  return cudnn


@pytest.mark.parametrize("name", ["earlier_shard", "striped",
                                  "window_any_layout"])
@pytest.mark.sample(2)
def test_pallas_tiles_take_a_ring_steps_block(name, monkeypatch):
  """The Pallas tiles on a block of two id arrays (61 queries, 45 keys:
  both padded in tiles of 16) at offsets, as a ring step holds them
  (``tiles.DIRECT``, through the cudnn backend's forward and backward,
  every handler NaN): a document across the two shards, documents only
  one side holds, striped offsets, ids in many runs; interpreted on the
  CPU, out, lse and every gradient equal the float64 reference's."""
  cudnn = direct_tiles(monkeypatch)
  q_ids, kv_ids, kw = _ring_ids(name)
  q_ids, kv_ids = q_ids.astype(np.int32), kv_ids.astype(np.int32)
  q, k, v, do = (x.astype(jnp.bfloat16) for x in ref.random_qkv(
      9, 2, 61, 45, 4, 2, 16, hv=32))
  case = ref.Case(0.3, q_segment_ids=q_ids, kv_segment_ids=kv_ids, **kw)
  cfg = ref.config(case)

  @jax.jit
  def run(q, k, v, q_ids, kv_ids):
    mask = BlockMask(q_offset=case.q_offset, kv_offset=case.kv_offset,
                     q_segment_ids=q_ids, kv_segment_ids=kv_ids)
    assert tiles.direct(q, k, v, mask, cfg)
    out, lse = cudnn.forward(q, k, v, None, mask, cfg)
    return out, lse, cudnn.backward(q, k, v, None, mask, out, lse, do, None,
                                    cfg)[:3]

  out, lse, grads = run(q, k, v, jnp.asarray(q_ids), jnp.asarray(kv_ids))
  check((out, grads), q, k, v, do, case, lse)


# Slow (about 7 s to compile): each block's tiles through the backend are
# test_pallas_tiles_take_a_ring_steps_block's; on GPUs,
# test_cudnn.py::test_packed_documents_through_ragged_offsets (tiles_direct).
@pytest.mark.slow
@pytest.mark.parametrize("load_balance", [None, "dual_chunk"],
                         ids=["contiguous", "dual_chunk"])
def test_direct_tiles_take_every_ring_block(load_balance, monkeypatch):
  """``tiles.DIRECT``: every packed block of the ring on 2 simulated
  devices (the diagonal's one id array; the other steps' two, at their
  offsets, documents across the shards) runs the Pallas tiles of 16
  (interpreted), every cuDNN handler NaN: output and gradients equal the
  reference's."""
  import jax_ring
  from jax.sharding import PartitionSpec as P
  from helpers import layout_vjp, mesh
  direct_tiles(monkeypatch)
  cudnn_blocks_on_the_cpu(monkeypatch)
  cp, t = 2, 88
  ids = short_ids(17, 2, t, 30)
  q, k, v, do = (x.astype(jnp.bfloat16) for x in ref.random_qkv(
      18, 2, t, t, 4, 2, 16))
  spec = P(None, "cp")
  f = jax.shard_map(
      lambda q, k, v, ids: jax_ring.ring_attention(
          q, k, v, axis_name="cp", implementation="cudnn", is_causal=True,
          segment_ids=ids, load_balance=load_balance),
      mesh=mesh(cp), in_specs=(spec,) * 4, out_specs=spec,
      # Pallas' interpreter slices its blocks with unvarying indices; the
      # kernels compiled for a GPU run with the check (test_cudnn.py).
      check_vma=False)
  check(layout_vjp(f, cp, load_balance, q, k, v, do, jnp.asarray(ids)),
        q, k, v, do, ref.Case(16**-0.5, is_causal=True, q_segment_ids=ids,
                              kv_segment_ids=ids))


def test_pallas_tiles_read_the_tiles_their_documents_reach():
  """Eight documents of 64 tokens in tiles of 32: causal, a query tile
  reads its own tile and, for a document's second tile, the first (24
  pairs of 136 causal ones); unmasked, both of its document's tiles (32);
  a window of 8 keys back, the tile before only where the window reaches
  it."""
  ids = np.repeat(np.arange(8, dtype=np.int32), 64)[None]
  split = np.where(np.arange(512) < 480, ids, 0)  # id 0 at tiles 0-1 and 15
  reaches = ((None, 0), (None, None), (8, 0))  # causal, full, window

  @jax.jit  # one program (op by op, most of the time)
  def every_range(ids, split):
    return [(tiles_pallas.ranges(ids, 32, reach),
             tiles_pallas.ranges(ids, 32, reach, one_run=False))
            for reach in reaches], tiles_pallas.ranges(split, 32,
                                                       (None, None), False)

  runs, split = jax.tree.map(np.asarray, every_range(ids, split))
  (causal, _), (full, _), (window, _) = runs
  pairs = lambda lo, hi: int(np.sum(hi - lo + 1))
  q_lo, q_hi, k_lo, k_hi = causal
  assert pairs(q_lo, q_hi) == pairs(k_lo, k_hi) == 24
  q_lo, q_hi, k_lo, k_hi = full
  assert pairs(q_lo, q_hi) == pairs(k_lo, k_hi) == 32
  q_lo, q_hi, _, _ = window
  np.testing.assert_array_equal(q_hi - q_lo, np.tile([0, 1], 8)[None])
  # The same ids found in any layout give the same ranges; an id in two
  # runs reaches from its first token's tile to its last's.
  for one_run, any_layout in runs:
    for a, b in zip(one_run, any_layout):
      np.testing.assert_array_equal(a, b)
  q_lo, q_hi, _, _ = split
  assert (q_lo[0, 0], q_hi[0, 0], q_lo[0, 15], q_hi[0, 15]) == (0, 15, 0, 15)


def test_pallas_tiles_propagate_nan_as_the_xla_form():
  """A NaN in one query and in one key: the Pallas forward's NaN rows are
  the XLA form's (which test_tiles_propagate_nan_as_jax_nn holds to
  jax.nn's), and every other row's value is the XLA form's to bfloat16's
  rounding (its running max rounds the probabilities against other
  maxima)."""
  ids = jnp.asarray(short_ids(8, 2, 61, 8))
  q, k, v, _ = (x.astype(jnp.bfloat16) for x in ref.random_qkv(
      5, 2, 61, 61, 4, 2, 16))
  q, k = q.at[0, 5, 1, 3].set(jnp.nan), k.at[1, 20, 0, 2].set(jnp.nan)
  cfg = ref.config(ref.Case(0.3, is_causal=True))
  out, lse, x_out, x_lse = jax.jit(  # one program for both forms
      lambda q, k, v, ids: tiles_pallas.forward(
          q, k, v, ids, cfg, 16, interpret=True) + tiles.forward(
              q, k, v, ids, cfg, 16))(q, k, v, ids)
  out, x_out = np.asarray(out, np.float32), np.asarray(x_out, np.float32)
  np.testing.assert_array_equal(np.isnan(out), np.isnan(x_out))
  np.testing.assert_array_equal(np.isnan(lse), np.isnan(x_lse))
  assert np.isnan(x_out).any() and not np.isnan(x_out).all()
  fine = ~np.isnan(x_out)
  np.testing.assert_allclose(out[fine], x_out[fine], atol=2 ** -7)


@pytest.mark.parametrize("causal, p", [(True, 32), (False, 128)],
                         ids=["causal_32", "full_128"])
def test_pallas_tiles_lower_for_nvidia_gpus(causal, p):
  """The Pallas tiles lower to Triton for CUDA without a GPU (every
  operation they use has a Triton lowering), forward and backward, at
  the shapes the packed benchmark times."""
  cfg = ref.config(ref.Case(128**-0.5, is_causal=causal))
  sds = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)
  q, k, ids = sds(1, 1024, 16, 128), sds(1, 1024, 8, 128), sds(
      1, 1024, dt=jnp.int32)
  lse = sds(1, 1024, 16, dt=jnp.float32)
  fwd = jax.jit(lambda q, k, v, ids: tiles_pallas.forward(
      q, k, v, ids, cfg, p)), (q, k, k, ids)
  bwd = jax.jit(lambda q, k, v, ids, o, lse, do: tiles_pallas.backward(
      q, k, v, ids, o, lse, do, cfg, p)), (q, k, k, ids, q, lse, q)
  for (f, args), kernels in ((fwd, 1), (bwd, 2)):
    with lowering_for_gpus():
      text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("jax_ring_band_tiles") >= kernels, text[:2000]
