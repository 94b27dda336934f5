"""Ulysses (all-to-all) attention on simulated CPU meshes against the float64
reference."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference as ref
from jax_ring._src.strategies import ulysses as uly
from helpers import (B, H, S, SPEC, check, coded_qkv, collectives,
                     layout_vjp, mesh, run_shard_map)

# coded_qkv (helpers.py): N = 8 query heads split over cp in 2, 4, 8; S
# divisible by 2 * cp.


run = functools.partial(run_shard_map, uly.ulysses_attention)


# At cp = 4: K = 8 (two kv heads per device), K = 1 (MQA, repeated 4x), and
# K = 6 with N = 12 (neither divides the other: each of the 6 heads sent
# twice, 3 per device). K = 2 (repeated) and K = cp are in the grid
# (test_strategies.py). MQA and N = 12 with -m slow: a repeated kv head is
# the grid's default cases' (K = 2, repeated twice).
@pytest.mark.parametrize("n, kv_heads", [(8, 8), (8, 1), (12, 6)],
                         ids=["k8", "mqa", "n12_k6"])
@pytest.mark.sample(1)
def test_ulysses_kv_heads_and_soft_cap(n, kv_heads):
  q, k, v, do = coded_qkv(20 + kv_heads, 4, kv_heads, n)
  got = run(q, k, v, do, 4, is_causal=True, load_balance="dual_chunk",
            logits_soft_cap=3.0, scale=0.3)
  check(got, q, k, v, do, ref.Case(0.3, is_causal=True, soft_cap=3.0))


# Contiguous shards and the dual-chunk layout with a pair in the default
# run; dual-chunk with one id array is test_strategies.py's
# test_2d_mesh_data_by_cp_packed[ulysses].
@pytest.mark.parametrize("load_balance, pair", [
    (None, False), ("dual_chunk", True), ("dual_chunk", False),
    ("striped", False)],
                         ids=["contiguous", "dual_chunk_pair", "dual_chunk",
                              "striped"])
@pytest.mark.sample(2)
def test_ulysses_packed_segments_cross_shard_boundaries(load_balance, pair):
  cp = 4
  q, k, v, do = coded_qkv(30, cp, 2)
  q_ids = ref.random_segments(31, B, S, 5)  # 5 documents of random lengths
  kv_ids = ref.random_segments(32, B, S, 4) if pair else q_ids
  f = jax.shard_map(
      lambda q, k, v, qi, ki: uly.ulysses_attention(
          q, k, v, axis_name="cp", is_causal=True, load_balance=load_balance,
          segment_ids=(qi, ki), implementation="xla"),
      mesh=mesh(cp), in_specs=(SPEC,) * 5, out_specs=SPEC)
  got = layout_vjp(f, cp, load_balance, q, k, v, do, jnp.asarray(q_ids),
                   jnp.asarray(kv_ids))
  check(got, q, k, v, do, ref.Case(H**-0.5, is_causal=True,
                                   q_segment_ids=q_ids, kv_segment_ids=kv_ids))


# The two-sided window in the default run; the causal one with -m slow
# (Ulysses hands either, whole, to one local call: the same path).
@pytest.mark.parametrize("causal, window", [(False, (5, 3)), (True, (7, 0))],
                         ids=["window_5_3", "causal_window_7"])
@pytest.mark.sample(1)
def test_ulysses_window_and_padding_lengths(causal, window):
  """A window in global positions and padding past per-row lengths, under
  dual_chunk: both are exact only once the order is natural again."""
  cp = 4
  q, k, v, do = coded_qkv(40, cp, 2)
  q_len, kv_len = np.array([41, 29], np.int32), np.array([37, 48], np.int32)
  got = run(q, k, v, do, cp, is_causal=causal, load_balance="dual_chunk",
            local_window_size=window, query_seq_lengths=jnp.asarray(q_len),
            key_value_seq_lengths=jnp.asarray(kv_len))
  check(got, q, k, v, do, ref.Case(H**-0.5, is_causal=causal, window=window,
                                   q_lengths=q_len, kv_lengths=kv_len))


def test_ulysses_16_bit():
  q, k, v, do = (x.astype(jnp.bfloat16) for x in coded_qkv(60, 4, 2))
  got = run(q, k, v, do, 4, is_causal=True, load_balance="dual_chunk")
  assert got[0].dtype == jnp.bfloat16
  check(got, q, k, v, do, ref.Case(H**-0.5, is_causal=True))


def test_forward_is_all_to_all_only():
  cp = 4
  q, k, v, _ = coded_qkv(70, cp, 2)
  seg = jnp.asarray(ref.random_segments(71, B, S, 3))
  f = jax.jit(jax.shard_map(
      lambda q, k, v, seg: uly.ulysses_attention(
          q, k, v, axis_name="cp", is_causal=True, load_balance="dual_chunk",
          segment_ids=seg, implementation="xla"),
      mesh=mesh(cp), in_specs=(SPEC,) * 4, out_specs=SPEC))
  hlo = f.lower(q, k, v, seg).compile().as_text()
  # q; stacked (k, v); out (the lse's is dead without a backward). Segment
  # ids: one all-gather of the stacked (q ids, kv ids).
  assert collectives(hlo) == {
      "all-to-all": 3, "all-gather": 1, "reduce-scatter": 0, "all-reduce": 0,
      "collective-permute": 0}, collectives(hlo)
  # XLA:CPU splits each all-to-all into one piece per device: the stacked KV
  # (2 heads, each repeated cp / 2 times) sends (2, B, T, 1, H) to each.
  t = S // cp
  kv_piece = rf"f32\[2,{B},{t},1,{H}\]"
  assert re.search(rf"= \(({kv_piece}{{[0-9,]+}}(, )?){{{cp}}}\) all-to-all\(",
                   hlo), hlo


def test_backward_all_to_alls():
  cp = 4
  q, k, v, do = coded_qkv(72, cp, 2)
  f = jax.shard_map(
      lambda q, k, v: uly.ulysses_attention(q, k, v, axis_name="cp",
                                            is_causal=True,
                                            implementation="xla"),
      mesh=mesh(cp), in_specs=(SPEC,) * 3, out_specs=SPEC)
  g = jax.jit(lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do))
  # Emitted: forward q, (k, v), out, lse; backward (q, out, dout), (k, v),
  # lse in and dq, (dk, dv) out.
  emitted = g.lower(q, k, v, do).as_text()
  assert len(re.findall(r"stablehlo\.all_to_all", emitted)) == 9
  # Compiled, XLA may merge the backward's (k, v) all-to-all with the
  # forward's (same operands), as XLA:CPU does.
  counts = collectives(g.lower(q, k, v, do).compile().as_text())
  assert counts["all-to-all"] in (8, 9), counts
  assert counts["all-gather"] == counts["collective-permute"] == 0, counts


def test_errors():
  q = jnp.ones((1, 8, 6, 8))
  with pytest.raises(ValueError, match=re.escape(
      "axis_name 'cp' is not a mesh axis bound here")):
    uly.ulysses_attention(q, q, q, axis_name="cp")

  def call(q, k, **kw):
    f = jax.shard_map(
        lambda q, k: uly.ulysses_attention(q, k, k, axis_name="cp", **kw),
        mesh=mesh(4), in_specs=(SPEC,) * 2, out_specs=SPEC)
    return f(q, k)

  with pytest.raises(ValueError, match=re.escape(
      "ulysses_attention splits query heads over axis 'cp': query heads (6) "
      "must be divisible by its size (4)")):
    call(q, q)
  q8 = jnp.ones((1, 12, 8, 8))
  with pytest.raises(ValueError, match=re.escape(
      "load_balance='dual_chunk' needs the global sequence length (12) "
      "divisible by 2 * cp_size = 8; the local query length is 3")):
    call(q8, q8, load_balance="dual_chunk")
  with pytest.raises(ValueError, match=re.escape(
      "query heads (8) must be divisible by key/value heads (3)")):
    call(q8, jnp.ones((1, 12, 3, 8)))
  with pytest.raises(ValueError, match=re.escape(
      "query_seq_lengths must be an int array of shape (B,) = (1,)")):
    call(q8, q8, query_seq_lengths=jnp.ones((2,), jnp.int32))


def test_kv_repeat():
  assert [uly.kv_repeat(k, 4) for k in (1, 2, 4, 8, 6, 3)] == [4, 2, 1, 1, 2, 4]
