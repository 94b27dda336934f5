"""Attention sinks on one device: ``dot_product_attention(sinks=)`` equals
the float64 reference (output, logsumexp and every gradient, the sinks'
included) with each mask family, and bad sinks are refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ring
import reference as ref

B, T, N, K, H = 2, 13, 4, 2, 8
IDS = ref.random_segments(5, B, T, 3)
Q_LENGTHS = np.array([T - 4, T], np.int32)
KV_LENGTHS = np.array([T - 2, 0], np.int32)  # row 1 sees no key but the sink
CASES = {
    "plain": ({}, {}),
    "causal": (dict(is_causal=True), dict(is_causal=True)),
    "causal_window": (dict(is_causal=True, local_window_size=(3, 0)),
                      dict(is_causal=True, window=(3, 0))),
    "packed": (dict(is_causal=True, segment_ids=IDS),
               dict(is_causal=True, q_segment_ids=IDS, kv_segment_ids=IDS)),
    "padding": (dict(query_seq_lengths=Q_LENGTHS,
                     key_value_seq_lengths=KV_LENGTHS),
                dict(q_lengths=Q_LENGTHS, kv_lengths=KV_LENGTHS)),
    "soft_cap": (dict(logits_soft_cap=2.0), dict(soft_cap=2.0)),
}


def random_sinks(seed):
  # Around the logits' scale, so that the sink takes a real share.
  return jax.random.normal(jax.random.key(seed), (N,), jnp.float32) + 1.0


@pytest.mark.parametrize("name", list(CASES))
def test_sinks_match_reference(name):
  kw, case_kw = CASES[name]
  q, k, v, do = ref.random_qkv(11, B, T, T, N, K, H)
  sinks = random_sinks(12)
  dlse = jax.random.normal(jax.random.key(13), (B, T, N), jnp.float32)
  f = lambda q, k, v, s: jax_ring.dot_product_attention(
      q, k, v, sinks=s, return_residual=True, implementation="xla", **kw)
  (out, lse), vjp = jax.vjp(jax.jit(f), q, k, v, sinks)
  dq, dk, dv, ds = vjp((do, dlse))
  case = ref.Case(H**-0.5, **case_kw)
  r_out, r_lse, grads = ref.attention(q, k, v, case, dout=do, dlse=dlse,
                                      sinks=sinks)
  for got, want, what in ((out, r_out, "out"), (lse, r_lse, "lse"),
                          (dq, grads["q"], "dq"), (dk, grads["k"], "dk"),
                          (dv, grads["v"], "dv"),
                          (ds, grads["sinks"], "dsinks")):
    ref.assert_close(got, want, jnp.float32, what)


def test_a_row_that_sees_no_key_gives_its_weight_to_the_sink():
  """Zero output, lse = the sink, and the sink's gradient from dlse alone;
  also with no keys at all (S = 0)."""
  q, k, v, _ = ref.random_qkv(21, B, T, T, N, K, H)
  sinks = random_sinks(22)
  out, lse = jax_ring.dot_product_attention(
      q, k, v, sinks=sinks, return_residual=True,
      key_value_seq_lengths=jnp.array([T, 0]))
  np.testing.assert_array_equal(np.asarray(out[1]), 0.0)
  np.testing.assert_allclose(np.asarray(lse[1]),
                             np.broadcast_to(sinks, (T, N)), rtol=1e-6)
  grad = jax.grad(lambda s: jax_ring.dot_product_attention(
      q, k[:, :0], v[:, :0], sinks=s, return_residual=True)[1].sum())(sinks)
  np.testing.assert_allclose(np.asarray(grad), B * T, rtol=1e-6)


@pytest.mark.parametrize("sinks, message", [
    (np.zeros((N + 1,), np.float32), r"sinks must be a float array of shape "
     r"\(N,\) = \(4,\).*got float32 \(5,\)"),
    (np.zeros((1, N), np.float32), r"got float32 \(1, 4\)"),
    (np.zeros((N,), np.int32), r"got int32 \(4,\)"),
])
def test_bad_sinks_are_refused_by_name(sinks, message):
  q, k, v, _ = ref.random_qkv(31, B, T, T, N, K, H)
  with pytest.raises(ValueError, match=message):
    jax_ring.dot_product_attention(q, k, v, sinks=sinks)


def test_context_parallel_refuses_sinks_for_now():
  if len(jax.devices()) < 2:
    pytest.skip("needs 2 devices")
  q, k, v, _ = ref.random_qkv(41, B, 16, 16, N, K, H)
  mesh = jax.make_mesh((2,), ("cp",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  with jax.set_mesh(mesh), pytest.raises(
      ValueError, match=r"context_parallel does not serve sinks yet.*"
                        r"sinks \(4,\) with query \(2, 16, 4, 8\)"):
    jax_ring.dot_product_attention(
        q, k, v, sinks=random_sinks(42),
        context_parallel=jax_ring.ContextParallel(axis="cp"))


def test_reference_sink_is_a_key_whose_value_is_zero():
  """The reference's own check: a sink equals one more key, with logit s
  and a zero value, that every query sees."""
  q, k, v, _ = ref.random_qkv(51, 1, 5, 5, 2, 2, 4)
  sinks = np.array([0.3, -0.7])
  case = ref.Case(4**-0.5)
  out, lse = ref.attention(q, k, v, case, sinks=sinks)
  # A key with q . k_s * scale = s for every query: one extra dimension.
  q64 = np.asarray(q, np.float64)
  q_ext = np.concatenate([q64, np.ones((1, 5, 2, 1))], -1)
  k_ext = np.concatenate([np.asarray(k, np.float64), np.zeros((1, 5, 2, 1))],
                         -1)
  k_sink = np.zeros((1, 1, 2, 5))
  k_sink[..., -1] = sinks / 4**-0.5
  k_all = np.concatenate([k_ext, k_sink], 1)
  v_all = np.concatenate([np.asarray(v, np.float64), np.zeros((1, 1, 2, 4))],
                         1)
  want_out, want_lse = ref.attention(q_ext, k_all, v_all, case)
  # (the reference rounds its inputs to float32, the sink key's too)
  np.testing.assert_allclose(out, want_out, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(lse, want_lse, rtol=1e-6)
