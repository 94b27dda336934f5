"""A value head dim unlike the query/key head dim (multi-head latent
attention: ``v (B, S, K, Hv)``, Hv != H): the block kernel with each mask
family, the public call eagerly and under jit, the ring's scan and window
paths on the pair of K/V it sends, and what travels; every result against
the float64 reference, output and gradients. The strategies' other paths
with Hv != H (with sinks) are in ``test_sinks.py``; bad shapes in
``test_errors.py``."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ring
import reference as ref
from helpers import check, check_kernel, collectives, mesh, run_shard_map

B, T, S, N, K, H, HV = 2, 37, 29, 4, 2, 16, 8
SEGMENTS = ref.random_segments(7, B, T, 3), ref.random_segments(8, B, S, 3)
KERNEL_CASES = {
    "segments_padding": ref.Case(0.3, q_segment_ids=SEGMENTS[0],
                                 kv_segment_ids=SEGMENTS[1],
                                 kv_lengths=np.array([22, 0], np.int32)),
    "causal_window_offset": ref.Case(0.3, is_causal=True, window=(7, 0),
                                     q_offset=20, kv_offset=13),
    "soft_cap_dense": ref.Case(2.4, soft_cap=3.0, dense=np.random.default_rng(
        3).random((1, N, T, S)) > 0.4),
}


# Hv's path is one for every mask: segments_padding by default; the other
# masks at Hv = H in test_kernel.py: test_lse_cotangent,
# test_mask_cases_match_reference[soft_cap] and [dense].
@pytest.mark.parametrize("name", list(KERNEL_CASES))
@pytest.mark.sample(1)
def test_kernel_matches_reference(name):
  """Output (B, T, N, Hv), lse, dq, dk and dv: fully masked rows (row 1
  sees no key) included."""
  q, k, v, do = ref.random_qkv(len(name), B, T, S, N, K, H, hv=HV)
  out, _ = check_kernel(q, k, v, do, KERNEL_CASES[name])
  assert out.shape == (B, T, N, HV)


def test_api_eager_equals_jit_and_reference_with_sinks_and_bias():
  """T != S, GQA, a bias and sinks: eagerly and under jit, bit for bit."""
  q, k, v, do = ref.random_qkv(4, B, T, S, N, K, H, hv=HV)
  bias = jax.random.normal(jax.random.key(5), (1, N, T, S))
  sinks = jax.random.normal(jax.random.key(6), (N,)) + 1.0
  f = lambda q, k, v, bias, s: jax_ring.dot_product_attention(
      q, k, v, bias, is_causal=True, sinks=s)
  eager = f(q, k, v, bias, sinks)
  out, vjp = jax.vjp(jax.jit(f), q, k, v, bias, sinks)
  np.testing.assert_array_equal(np.asarray(eager), np.asarray(out))
  r_out, _, r_g = ref.attention(q, k, v, ref.Case(H**-0.5, is_causal=True),
                                bias=bias, dout=do, sinks=sinks)
  ref.assert_close(out, r_out, jnp.float32, "out")
  for got, what in zip(vjp(do), ("q", "k", "v", "bias", "sinks")):
    ref.assert_close(got, r_g[what], jnp.float32, "d" + what)


CP, CP_S = 4, 32


# The window's chunk pairs compile one band per chunk distance and pair:
# on 2 devices (chunks of 8, a window of 6: distances 0 and 1) rather than
# 4, every pair of a step still summed and joined (the scan needs 3 steps
# or more to run its body: 4 devices).
@pytest.mark.parametrize("cp, kw", [
    (CP, dict(load_balance="dual_chunk", loop="scan", kv_sends="neighbour")),
    (2, dict(load_balance="dual_chunk", local_window_size=(6, 0))),
], ids=["scan_neighbour", "window_gather"])
def test_ring_moves_k_and_v_apart(cp, kw):
  """The ring on the (k, v) pair: running dK/dV sums carried through a
  scan and sent around (neighbour), and window pairs summed and joined;
  rank-coded shards, output and gradients."""
  q, k, v, do = ref.random_qkv(9, B, CP_S, CP_S, N, K, H, hv=HV)
  code = ref.shard_code(CP_S, cp, "dual_chunk")
  q, k, v = q + code, k - code, v + code
  got = run_shard_map(jax_ring.ring_attention, q, k, v, do, cp,
                      is_causal=True, **kw)
  check(got, q, k, v, do, ref.Case(H**-0.5, is_causal=True,
                                   window=kw.get("local_window_size")))


def test_each_permute_moves_k_or_v_at_its_own_width():
  """No K/V buffer padded to the wider head dim: the forward's sends are
  K (B, T, K, H) and V (B, T, K, Hv), one each per step but the last, and
  nothing stacked."""
  q, k, v, _ = ref.random_qkv(10, B, CP_S, CP_S, N, K, H, hv=HV)
  spec = P(None, "cp")
  f = jax.jit(jax.shard_map(
      lambda q, k, v: jax_ring.ring_attention(
          q, k, v, axis_name="cp", is_causal=True, kv_sends="neighbour",
          implementation="xla"),
      mesh=mesh(CP), in_specs=(spec,) * 3, out_specs=spec))
  hlo = f.lower(q, k, v).compile().as_text()
  t = CP_S // CP
  assert collectives(hlo)["collective-permute"] == 2 * (CP - 1)
  for width in (H, HV):
    sends = re.findall(rf"f32\[{B},{t},{K},{width}\][^\n]*"
                       r"collective-permute(?:-start)?\(", hlo)
    assert len(sends) == CP - 1, (width, sends)
  assert not re.search(rf"f32\[2,{B},{t},[^\n]*collective-permute", hlo)


def test_explain_counts_v_at_its_own_width():
  """The K/V size rule reads K (H = 192) and V (Hv = 128): 1 x 2^20
  tokens x 8 kv heads x (192 + 128) x 2 bytes = 5120 MiB, not 6144."""
  s = 2**20
  choice = jax_ring.explain((1, s, 32, 192), (1, s, 8, 192), cp_size=8,
                            value_shape=(1, s, 8, 128), is_causal=True)
  assert "the gathered K/V, 5120 MiB" in str(choice)
