"""Hybrid Ulysses x ring attention on simulated 2-D CPU meshes (U x R)
against the float64 reference."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jax_ring
import reference as ref
from jax_ring._src.strategies import hybrid as hyb, ring
from jax_ring._src.core.config import ShardPlan
from jax_ring._src.core.mask import TokenMask
from helpers import B, H, S, check, coded_qkv, layout_vjp

# N = 8 query heads, S = 48: 2 R U coded chunks of 3 or more tokens for
# meshes of U x R in 2 x 2, 2 x 4, 4 x 2 (ids u2_r2, u2_r4, u4_r2).
AXES = ("ulysses", "ring")
SPEC = P(None, ("ring", "ulysses"))  # ring-major: ring shard = U sub-shards


def mesh2d(u, r):
  """U x R devices, the ulysses axis minor (as the GPUs of one node)."""
  if len(jax.devices()) < u * r:
    pytest.skip(f"needs {u * r} devices")
  return Mesh(np.array(jax.devices()[:u * r]).reshape(r, u),
              ("ring", "ulysses"))


def run(q, k, v, do, u, r, *ids, **kw):
  """Global natural-order inputs -> hybrid_attention on a U x R mesh ->
  global natural-order output and grads. ``ids``: segment ids (one array,
  passed once, or a q/kv pair), sharded like the tokens; lengths in ``kw``
  are closed over (replicated). dual_chunk is applied with cp_size = R."""

  def attn(q, k, v, *ids):
    seg = None if not ids else ids[0] if len(ids) == 1 else ids
    return hyb.hybrid_attention(q, k, v, axis_name=AXES, segment_ids=seg,
                                implementation="xla", **kw)

  f = jax.shard_map(attn, mesh=mesh2d(u, r),
                    in_specs=(SPEC,) * (3 + len(ids)), out_specs=SPEC)
  return layout_vjp(f, r, kw.get("load_balance"), q, k, v, do,
                    *(jnp.asarray(x) for x in ids))


# kv heads against U: K = 2 over U = 2 (one each), K = 8 over U = 2 (four
# each), K = 2 over U = 4 (each repeated twice) and MQA over U = 4 (repeated
# four times). K = 2 over U = 2 runs causal and dual-chunk in the default run
# in the loop test (at R = 4); K = 8 over U = 2 at R = 2 (the heads' point
# needs no longer ring; R = 4, with -m slow).
@pytest.mark.parametrize("ur, causal, load_balance, kv_heads", [
    pytest.param((2, 2), True, "dual_chunk", 2, marks=pytest.mark.slow),
    pytest.param((2, 4), True, None, 2, marks=pytest.mark.slow),
    ((2, 2), False, "dual_chunk", 8),
    pytest.param((2, 4), False, "dual_chunk", 8, marks=pytest.mark.slow),
    pytest.param((4, 2), True, "dual_chunk", 2, marks=pytest.mark.slow),
    ((4, 2), True, None, 1)],
                         ids=["u2_r2_causal_dual_chunk",
                              "u2_r4_causal_contiguous",
                              "u2_r2_full_dual_chunk_k8",
                              "u2_r4_full_dual_chunk_k8",
                              "u4_r2_causal_dual_chunk",
                              "u4_r2_causal_contiguous_mqa"])
def test_hybrid_matches_reference(ur, causal, load_balance, kv_heads):
  u, r = ur
  q, k, v, do = coded_qkv(u * 10 + r, u * r, kv_heads)
  got = run(q, k, v, do, u, r, is_causal=causal, load_balance=load_balance)
  check(got, q, k, v, do, ref.Case(H**-0.5, is_causal=causal))


# At R = 2 in the default run (documents cross sub-shards and ring shards
# alike); R = 4 and the pair with -m slow: the ring's steps over packed
# rows are test_ring.py's, a pair of ids Ulysses' and all-gather's.
@pytest.mark.parametrize("ur, load_balance, pair", [
    ((2, 2), "dual_chunk", False), ((2, 4), "dual_chunk", False),
    ((4, 2), None, True)],
                         ids=["u2_r2_dual_chunk", "u2_r4_dual_chunk",
                              "u4_r2_contiguous_pair"])
@pytest.mark.sample(1)
def test_hybrid_packed_segments_cross_shard_boundaries(monkeypatch, ur,
                                                       load_balance, pair):
  """5 (or 4) documents of random lengths, crossing sub-shard and ring-shard
  boundaries. With one id array the ring is told the ids are the same
  (kv ids None), forward and backward, which cuDNN keys on; with a pair it
  gets two arrays."""
  seen = []
  for name in ("forward", "backward"):
    orig = getattr(ring, name)

    def spy(q, k, v, tm, *rest, orig=orig, name=name):
      seen.append((name, tm.same_ids))
      return orig(q, k, v, tm, *rest)

    monkeypatch.setattr(ring, name, spy)
  u, r = ur
  q, k, v, do = coded_qkv(30, u * r, 2)
  q_ids = ref.random_segments(31, B, S, 5)
  kv_ids = ref.random_segments(32, B, S, 4) if pair else q_ids
  ids = (q_ids, kv_ids) if pair else (q_ids,)
  got = run(q, k, v, do, u, r, *ids, is_causal=True,
            load_balance=load_balance)
  check(got, q, k, v, do, ref.Case(H**-0.5, is_causal=True,
                                   q_segment_ids=q_ids, kv_segment_ids=kv_ids))
  assert sorted(seen) == [("backward", not pair), ("forward", not pair)]


# The contiguous case, with the soft cap, in the default run; the dual-chunk
# window (4 chunk pairs a step, a slow compile) with -m slow: the ring's
# dual-chunk window is test_value_head_dim.py's window_gather, the hybrid's
# dual-chunk ring test_loop_forms_agree_bitwise_and_env_var_selects_scan.
@pytest.mark.parametrize("ur, causal, window, load_balance, soft_cap", [
    ((4, 2), False, (5, 3), None, 3.0),
    ((2, 2), True, (7, 0), "dual_chunk", None)],
                         ids=["u4_r2_window_5_3_contiguous_soft_cap",
                              "u2_r2_causal_window_7_dual_chunk"])
@pytest.mark.sample(1)
def test_hybrid_window_padding_and_soft_cap(ur, causal, window, load_balance,
                                            soft_cap):
  """A window and per-row padding lengths in global positions (the second
  row's leave whole chunks empty), a soft cap and a scale."""
  u, r = ur
  q, k, v, do = coded_qkv(40, u * r, 2)
  q_len, kv_len = np.array([41, 13], np.int32), np.array([37, 29], np.int32)
  got = run(q, k, v, do, u, r, is_causal=causal, load_balance=load_balance,
            local_window_size=window, query_seq_lengths=jnp.asarray(q_len),
            key_value_seq_lengths=jnp.asarray(kv_len), scale=0.3,
            logits_soft_cap=soft_cap)
  check(got, q, k, v, do, ref.Case(0.3, is_causal=causal, window=window,
                                   soft_cap=soft_cap, q_lengths=q_len,
                                   kv_lengths=kv_len))


def test_loop_forms_agree_bitwise_and_env_var_selects_scan(monkeypatch):
  u, r = 2, 4
  q, k, v, do = coded_qkv(50, u * r, 2)
  kw = dict(is_causal=True, load_balance="dual_chunk", kv_sends="neighbour")
  scan = run(q, k, v, do, u, r, loop="scan", **kw)
  unrolled = run(q, k, v, do, u, r, loop="unrolled", **kw)
  for a, b in zip(jax.tree.leaves(scan), jax.tree.leaves(unrolled)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  check(scan, q, k, v, do, ref.Case(H**-0.5, is_causal=True))
  # loop=None: the ring's loop form comes from the environment (traced
  # only). The forward's KV permutes: one per step but the last unrolled
  # (R - 1), the first step's and the scan body's one under scan (2). A
  # fresh function each time: jax caches traces by function, not by env.
  for env, permutes in (("1", 2), ("0", r - 1)):
    monkeypatch.setenv("NVTE_FUSED_RING_ATTENTION_USE_SCAN", env)
    f = jax.shard_map(
        lambda q, k, v: hyb.hybrid_attention(q, k, v, axis_name=AXES, **kw),
        mesh=mesh2d(u, r), in_specs=(SPEC,) * 3, out_specs=SPEC)
    jaxpr = str(jax.make_jaxpr(f)(q, k, v))
    assert jaxpr.count("ppermute[") == permutes, env


def test_forward_lse_comes_back_sequence_sharded():
  """``forward``'s lse (the backward's residual) in the shards' layout."""
  u, r = 2, 2
  q, k, v, _ = coded_qkv(60, u * r, 2)
  case = ref.Case(H**-0.5, is_causal=True)
  plans = (ShardPlan("ulysses", u), ShardPlan("ring", r, "dual_chunk"))
  f = jax.jit(jax.shard_map(
      lambda q, k, v: hyb.forward(q, k, v, TokenMask(), ref.config(case),
                                  plans),
      mesh=mesh2d(u, r), in_specs=(SPEC,) * 3, out_specs=(SPEC, SPEC)))
  to = lambda x: jax_ring.reorder_for_load_balance(x, r)
  out, lse = f(to(q), to(k), to(v))
  r_out, r_lse = ref.attention(q, k, v, case)
  ref.assert_close(out, to(r_out), q.dtype, "out")
  ref.assert_close(lse, to(r_lse), q.dtype, "lse")


def _collectives(hlo):
  """{op: [result shape, one per op]} of a compiled module, no layouts."""
  return {op: [re.sub(r"\{[0-9,]*\}", "", shape) for shape in re.findall(
      rf"= (\([^)]*\)|\S+) {op}(?:-start)?\(", hlo)]
          for op in ("all-to-all", "all-gather", "collective-permute")}


def test_forward_all_to_all_on_u_permutes_on_r_no_kv_gather():
  u, r = 2, 4
  q, k, v, _ = coded_qkv(70, u * r, 2)
  seg = jnp.asarray(ref.random_segments(71, B, S, 3))
  f = jax.jit(jax.shard_map(
      lambda q, k, v, seg: hyb.hybrid_attention(
          q, k, v, axis_name=AXES, is_causal=True, load_balance="dual_chunk",
          segment_ids=seg, loop="unrolled", kv_sends="neighbour",
          implementation="xla"),
      mesh=mesh2d(u, r), in_specs=(SPEC,) * 4, out_specs=SPEC))
  ops = _collectives(f.lower(q, k, v, seg).compile().as_text())
  # q; stacked (k, v); out (the lse's is dead without a backward). XLA:CPU
  # splits each into one piece per device of the group: the stacked KV
  # sends (2, B, T, 1, H) to each (K = 2 over U = 2).
  t = S // (u * r)
  assert len(ops["all-to-all"]) == 3, ops
  kv_piece = f"f32[2,{B},{t},1,{H}]"
  assert f"({kv_piece}, {kv_piece})" in ops["all-to-all"], ops
  # The ids, once, over U: int32, (B, T U); never K or V.
  assert ops["all-gather"] == [f"s32[{B},{t * u}]"], ops
  # The ring shard's stacked KV, (2, B, T U, 1, H) (K = 2 over U = 2), one
  # permute per ring step but the last, with its kv ids (maybe combined).
  kv = f"f32[2,{B},{t * u},1,{H}]"
  permuted = " ".join(ops["collective-permute"])
  assert permuted.count(kv) == r - 1, ops
  assert permuted.count(f"s32[{B},{t * u}]") == r - 1, ops


def test_axis_pair_errors():
  q = jnp.ones((1, 8, 8, 8))
  for bad in ("cp", ("ulysses", "ulysses"), ("a", "b", "c"), ("a", 1)):
    with pytest.raises(ValueError, match=re.escape(
        "hybrid_attention needs axis_name = (ulysses_axis, ring_axis), two "
        f"distinct mesh axis names; got {bad!r}")):
      hyb.hybrid_attention(q, q, q, axis_name=bad)
  with pytest.raises(ValueError, match=re.escape(
      "axis_name 'ulysses' is not a mesh axis bound here")):
    hyb.hybrid_attention(q, q, q, axis_name=AXES)


def test_shape_errors():
  def call(q, k, u, r, **kw):
    f = jax.shard_map(
        lambda q, k: hyb.hybrid_attention(q, k, k, axis_name=AXES, **kw),
        mesh=mesh2d(u, r), in_specs=(SPEC,) * 2, out_specs=SPEC)
    return f(q, k)

  q6 = jnp.ones((1, 16, 6, 8))
  with pytest.raises(ValueError, match=re.escape(
      "ulysses_attention splits query heads over axis 'ulysses': query heads "
      "(6) must be divisible by its size (4)")):
    call(q6, q6, 4, 2)
  # U = 1, R = 2: the ring's T U = 3 local tokens cannot split in two.
  q8 = jnp.ones((1, 6, 8, 8))
  with pytest.raises(ValueError, match=re.escape(
      "load_balance='dual_chunk' needs the global sequence length (6) "
      "divisible by 2 * cp_size = 4; the local query length is 3")):
    call(q8, q8, 1, 2, load_balance="dual_chunk")
  with pytest.raises(ValueError, match=re.escape(
      "loop must be None, 'scan' or 'unrolled'; got 'while'")):
    call(q6[:, :, :4], q6[:, :, :4], 2, 2, loop="while")
