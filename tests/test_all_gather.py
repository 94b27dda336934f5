"""All-gather (Llama 3) attention on simulated CPU meshes against the float64
reference."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference as ref
from jax_ring._src.core import validate
from jax_ring._src.strategies import all_gather as ag
from helpers import (B, H, S, SPEC, check, coded_qkv, collectives,
                     layout_vjp, mesh, run_shard_map)

# coded_qkv: N = 8 query heads, S = 48 tokens, each of the 2 * cp chunks and
# each head shifted by its own constant (a misplaced chunk changes numbers).
# Compiling is what costs here (cp branches of up to two kernel calls, per
# pass), so the feature tests below run at cp = 4 or less (the packed rows
# at 2: half the branches).


run = functools.partial(run_shard_map, ag.all_gather_attention)


# MQA, with a soft cap and a scale, on 2 devices (heads need no more). GQA
# (K = 2) is the grid's (test_strategies.py), K = 4 in groups of 2 the
# kv_chunk_heads test.
def test_all_gather_mqa_and_soft_cap():
  cp = 2
  q, k, v, do = coded_qkv(20, cp, 1)
  got = run(q, k, v, do, cp, is_causal=True, logits_soft_cap=3.0, scale=0.3)
  check(got, q, k, v, do, ref.Case(0.3, is_causal=True, soft_cap=3.0))


def test_all_gather_packed_segments_cross_shard_boundaries():
  """Distinct q and kv ids, dual_chunk (the kv ids are gathered and put in
  natural order; the q ids are sliced per chunk). Contiguous shards with one
  id array: the 2-D mesh test."""
  cp, load_balance = 2, "dual_chunk"
  q, k, v, do = coded_qkv(30, cp, 2)
  q_ids = ref.random_segments(31, B, S, 5)  # 5 documents of random lengths
  kv_ids = ref.random_segments(32, B, S, 4)
  f = jax.shard_map(
      lambda q, k, v, qi, ki: ag.all_gather_attention(
          q, k, v, axis_name="cp", is_causal=True, load_balance=load_balance,
          segment_ids=(qi, ki), implementation="xla"),
      mesh=mesh(cp), in_specs=(SPEC,) * 5, out_specs=SPEC)
  got = layout_vjp(f, cp, load_balance, q, k, v, do, jnp.asarray(q_ids),
                   jnp.asarray(kv_ids))
  check(got, q, k, v, do, ref.Case(H**-0.5, is_causal=True,
                                   q_segment_ids=q_ids, kv_segment_ids=kv_ids))


# Padding that empties whole chunks: row 1 has 13 valid queries and 29 valid
# keys of 48, so at cp = 2 (C = 12) chunks 2 and 3 hold no valid query and
# chunk 3 no valid key (at cp = 4, C = 6: chunks 3 to 7 and 5 to 7).
Q_LENGTHS = np.array([41, 13], np.int32)
KV_LENGTHS = np.array([45, 29], np.int32)


# A causal window (7, 0) with lengths is in the kv_chunk_heads test (cp = 2);
# which kv rows each call reads, for causal and two-sided windows, in the
# static-calls test (cp = 4). The windows here on 2 devices: half the
# branches to compile, and chunks still emptied.
@pytest.mark.parametrize("cp, load_balance, causal, window", [
    (2, "dual_chunk", False, (5, 3)),
    (2, None, False, (2, 13)),
    (4, "dual_chunk", False, None)],
                         ids=["dual_full_w5_3", "contig_full_w2_13",
                              "dual_full_pad_only"])
@pytest.mark.sample(2)
def test_all_gather_windows_and_padding(cp, load_balance, causal, window):
  """Windows in global positions (kv sliced to each chunk's range) with
  padding lengths; without causal mask or window, the one call with no
  switch and a local prefix length."""
  q, k, v, do = coded_qkv(40, cp, 2)
  got = run(q, k, v, do, cp, is_causal=causal, load_balance=load_balance,
            local_window_size=window,
            query_seq_lengths=jnp.asarray(Q_LENGTHS),
            key_value_seq_lengths=jnp.asarray(KV_LENGTHS))
  check(got, q, k, v, do, ref.Case(H**-0.5, is_causal=causal, window=window,
                                   q_lengths=Q_LENGTHS, kv_lengths=KV_LENGTHS))


def _kernel_calls(jaxpr):
  """(primitive name, q rows, kv rows, q_offset, kv_offset) of every block
  kernel call in ``jaxpr`` and its sub-jaxprs (switch branches included);
  offsets must be static (primitive params), else the cuDNN band could not
  be built."""
  calls = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("jax_ring_attention_fwd",
                              "jax_ring_attention_bwd"):
      tree, static = eqn.params["mask_tree"], dict(eqn.params["mask_static"])
      probe = jax.tree.unflatten(tree, list(range(tree.num_leaves)))
      assert probe.q_offset in static and probe.kv_offset in static, eqn
      q, k = eqn.invars[0].aval, eqn.invars[1].aval
      calls.append((eqn.primitive.name[-3:], q.shape[1], k.shape[1],
                    static[probe.q_offset], static[probe.kv_offset]))
    for p in eqn.params.values():
      for sub in (p if isinstance(p, (tuple, list)) else [p]):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          calls += _kernel_calls(sub)
  return calls


# Causal with (5, 3): the right side is cut to 0 by the causal mask.
@pytest.mark.parametrize("causal, window", [
    (True, None), (True, (5, 3)), (False, (5, 3)), (False, None)],
                         ids=["causal", "causal_w5_3", "full_w5_3", "full"])
def test_kernel_calls_are_static_and_see_only_visible_kv(causal, window):
  """From the traced program (no compile): at cp = 4, dual_chunk, C = 6,
  query chunk g's forward and backward call has static offsets
  (6g, kv start) and reads exactly the kv rows its mask can reach."""
  cp, c = 4, S // 8
  q, k, v, do = coded_qkv(55, cp, 2)
  f = jax.shard_map(
      lambda q, k, v: ag.all_gather_attention(
          q, k, v, axis_name="cp", is_causal=causal, load_balance="dual_chunk",
          local_window_size=window, implementation="xla"),
      mesh=mesh(cp), in_specs=(SPEC,) * 3, out_specs=SPEC)
  jaxpr = jax.make_jaxpr(lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do))(
      q, k, v, do)
  calls = _kernel_calls(jaxpr.jaxpr)
  if not causal and window is None:  # one call, no switch
    want = [(S // cp, S, 0, 0)]
  else:
    left, right = window or (S, S)
    right = min(right, 0) if causal else right
    want = []
    for g in range(2 * cp):  # device d holds chunks d and 2cp - 1 - d
      lo, hi = max(0, g * c - left), min(S, (g + 1) * c + right)
      want.append((c, hi - lo, g * c, lo))
  for kind in ("fwd", "bwd"):
    got = sorted(x[1:] for x in calls if x[0] == kind)
    assert got == sorted(want), (kind, got)


@pytest.mark.parametrize("hv", [
    pytest.param(H, marks=pytest.mark.slow), H // 2], ids=["hv_h", "hv_half"])
def test_kv_chunk_heads_is_bitwise_no_chunking(hv):
  """Head groups are independent in the kernel (no cross-head reduction), so
  one group at a time gives the very same bits, outputs and grads; with a
  value head dim unlike the key's, K and V move as a pair."""
  cp = 2
  q, k, v, do = coded_qkv(50, cp, 4)
  v, do = v[..., :hv], do[..., :hv]
  ids = jnp.asarray(ref.random_segments(51, B, S, 3))
  kw = dict(is_causal=True, load_balance="dual_chunk",
            local_window_size=(7, 0), query_seq_lengths=jnp.asarray(Q_LENGTHS),
            key_value_seq_lengths=jnp.asarray(KV_LENGTHS))

  def go(kv_chunk_heads):
    f = jax.shard_map(
        lambda q, k, v, ids: ag.all_gather_attention(
            q, k, v, axis_name="cp", segment_ids=ids, implementation="xla",
            kv_chunk_heads=kv_chunk_heads, **kw),
        mesh=mesh(cp), in_specs=(SPEC,) * 4, out_specs=SPEC)
    return layout_vjp(f, cp, "dual_chunk", q, k, v, do, ids)

  whole = go(None)
  check(whole, q, k, v, do, ref.Case(
      H**-0.5, is_causal=True, window=(7, 0), q_lengths=Q_LENGTHS,
      kv_lengths=KV_LENGTHS, q_segment_ids=np.asarray(ids),
      kv_segment_ids=np.asarray(ids)))
  # Two groups of 2 kv heads, each with its 4 query heads.
  for a, b in zip(jax.tree.leaves(go(2)), jax.tree.leaves(whole)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_all_gather_16_bit():
  q, k, v, do = (x.astype(jnp.bfloat16) for x in coded_qkv(70, 2, 2))
  got = run(q, k, v, do, 2, is_causal=True)
  assert got[0].dtype == jnp.bfloat16 and got[1][1].dtype == jnp.bfloat16
  check(got, q, k, v, do, ref.Case(H**-0.5, is_causal=True))


# Collectives sit outside the per-device switch, so the mask does not change
# them: the causal case has the switch, the cheaper full one two head groups,
# whose gather, calls and reduce-scatter sit once in a loop of two trips.
# The causal one on 2 devices (half the switch's branches to compile), the
# full one on 4.
@pytest.mark.parametrize("kv_chunk_heads, causal, cp",
                         [(None, True, 2), (1, False, 4)],
                         ids=["whole_causal", "g1_full"])
def test_collectives_forward_gathers_backward_reduce_scatters(kv_chunk_heads,
                                                              causal, cp):
  q, k, v, do = coded_qkv(80, cp, 2)
  seg = jnp.asarray(ref.random_segments(81, B, S, 3))
  f = jax.shard_map(
      lambda q, k, v, seg: ag.all_gather_attention(
          q, k, v, axis_name="cp", is_causal=causal, segment_ids=seg,
          implementation="xla", kv_chunk_heads=kv_chunk_heads),
      mesh=mesh(cp), in_specs=(SPEC,) * 4, out_specs=SPEC)
  groups = 2 if kv_chunk_heads else 1
  kh = 2 // groups
  t = S // cp
  trips = lambda hlo: [int(n) for n in re.findall(
      r'"known_trip_count":\{"n":"(\d+)"', hlo)]
  # Forward: one all-gather of the stacked (k, v) (per head group, in the
  # loop), one of the kv segment ids; nothing else.
  hlo = jax.jit(f).lower(q, k, v, seg).compile().as_text()
  assert collectives(hlo) == {
      "all-gather": 2, "reduce-scatter": 0, "all-reduce": 0,
      "collective-permute": 0, "all-to-all": 0}, collectives(hlo)
  gathered = re.findall(rf"f32\[2,{B},{S},{kh},{H}\][^\n]*all-gather\(", hlo)
  assert len(gathered) == 1, hlo
  assert (groups in trips(hlo)) == (groups > 1), trips(hlo)
  # Backward: gathers again (k, v per group and the ids) and reduce-scatters
  # the float32 (dk, dv) per group. XLA:CPU keeps the reduce-scatter (no
  # all-reduce + slice), and merges the backward's gathers with the
  # forward's (same operands) when both are compiled together, unless they
  # sit in two loops.
  g = jax.jit(lambda q, k, v, do, seg: jax.vjp(
      lambda q, k, v: f(q, k, v, seg), q, k, v)[1](do))
  lowered = g.lower(q, k, v, do, seg)  # one lowering: emitted and compiled
  emitted = lowered.as_text()
  assert len(re.findall(r"stablehlo\.all_gather", emitted)) == 4
  assert len(re.findall(r"stablehlo\.reduce_scatter", emitted)) == 1
  hlo = lowered.compile().as_text()
  assert collectives(hlo) == {
      "all-gather": 2 if groups == 1 else 3, "reduce-scatter": 1,
      "all-reduce": 0,
      "collective-permute": 0, "all-to-all": 0}, collectives(hlo)
  assert trips(hlo).count(groups) == (2 if groups > 1 else 0), trips(hlo)
  scattered = re.findall(rf"f32\[2,{B},{t},{kh},{H}\][^\n]*reduce-scatter\(",
                         hlo)
  assert len(scattered) == 1, hlo


def test_errors():
  q = jnp.ones((1, 8, 4, 8))
  with pytest.raises(ValueError, match=re.escape(
      "axis_name 'cp' is not a mesh axis bound here")):
    ag.all_gather_attention(q, q, q, axis_name="cp")

  def call(q, k, **kw):
    f = jax.shard_map(
        lambda q, k: ag.all_gather_attention(q, k, k, axis_name="cp", **kw),
        mesh=mesh(4), in_specs=(SPEC,) * 2, out_specs=SPEC)
    return f(q, k)

  for bad in (3, 0, 2.0, True):
    with pytest.raises(ValueError, match=re.escape(
        "kv_chunk_heads must be None or a positive int dividing the "
        f"key/value heads (4); got {bad!r}")):
      call(q, q, kv_chunk_heads=bad)
  q12 = jnp.ones((1, 12, 4, 8))
  with pytest.raises(ValueError, match=re.escape(
      "load_balance='dual_chunk' needs the global sequence length (12) "
      "divisible by 2 * cp_size = 8; the local query length is 3")):
    call(q12, q12, load_balance="dual_chunk")
  with pytest.raises(ValueError, match=re.escape(
      "load_balance must be None, 'dual_chunk' or 'striped'; got 'zigzag'")):
    call(q, q, load_balance="zigzag")
  with pytest.raises(ValueError, match=re.escape(
      "strategy 'all_gather' does not support load_balance='striped'")):
    call(q, q, load_balance="striped")
  with pytest.raises(ValueError, match=re.escape(
      "query heads (4) must be divisible by key/value heads (3)")):
    call(q, jnp.ones((1, 8, 3, 8)))


def test_validate_kv_chunk_heads():
  for ok in (None, 1, 2, 4):
    validate.kv_chunk_heads(ok, 4)
  with pytest.raises(ValueError, match=re.escape(
      "kv_chunk_heads must be None or a positive int dividing the key/value "
      "heads (6); got 4")):
    validate.kv_chunk_heads(4, 6)
