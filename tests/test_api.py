"""jax_ring.dot_product_attention: parity with jax.nn on the options both
have, the float64 reference on the rest (default tiles)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ring
import reference as ref


def _grads(fn, q, k, v, do, bias=None):
  """Forward and (dq, dk, dv[, dbias]) of sum(fn(...) * do), jitted."""
  args = (q, k, v) if bias is None else (q, k, v, bias)
  out, vjp = jax.jit(lambda *a: jax.vjp(fn, *a))(*args)
  return out, vjp(do)


B, T, S, N, K, H = 2, 19, 23, 4, 2, 32
RNG = np.random.default_rng(0)
SHARED = {
    "plain": {},
    "causal": dict(is_causal=True),
    "scale": dict(scale=0.7),
    "bias": dict(bias=RNG.normal(size=(1, N, T, S)).astype(np.float32)),
    "mask": dict(mask=(RNG.random((B, 1, T, S)) > 0.3) |
                 (np.arange(S) == 0)),  # key 0 kept: no fully masked row
    "lengths": dict(query_seq_lengths=np.array([11, 19], np.int32),
                    key_value_seq_lengths=np.array([7, 23], np.int32)),
    "window": dict(local_window_size=(4, 2)),
    "window_causal": dict(local_window_size=3, is_causal=True),
}


# With -m slow only: "causal" (window_causal is causal too, and
# test_dtypes_and_head_dims checks causal calls against the reference) and
# "scale" (test_logits_soft_cap and test_several_default_tiles pass scale).
@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.slow) if n in ("causal", "scale")
    else n for n in SHARED])
def test_matches_jax_nn_xla(name):
  kw = SHARED[name]
  q, k, v, do = ref.random_qkv(21, B, T, S, N, K, H)
  bias = kw.get("bias")
  rest = {a: b for a, b in kw.items() if a != "bias"}

  def ours(q, k, v, *bias):
    return jax_ring.dot_product_attention(q, k, v, *bias, **rest)

  def theirs(q, k, v, *bias):
    return jax.nn.dot_product_attention(q, k, v, *bias, implementation="xla",
                                        **rest)

  @jax.jit
  def both(*args):  # one program: each call's output and gradients
    outs = []
    for fn in (ours, theirs):
      out, vjp = jax.vjp(fn, *args)
      outs.append((out, vjp(do)))
    return outs

  (out, g), (r_out, r_g) = both(*((q, k, v) if bias is None else
                                  (q, k, v, bias)))
  ref.assert_close(out, r_out, q.dtype, "out")
  for name_, a, b in zip("qkvb", g, r_g):
    ref.assert_close(a, b, q.dtype, "d" + name_)


def test_return_residual_matches_jax_nn():
  q, k, v, _ = ref.random_qkv(22, B, T, S, N, K, H)
  _, lse = jax_ring.dot_product_attention(q, k, v, is_causal=True,
                                          return_residual=True)
  _, r_lse = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, return_residual=True))(q, k, v)  # one program
  chex.assert_shape([lse, r_lse], (B, T, N))
  chex.assert_type(lse, jnp.float32)
  ref.assert_close(lse, r_lse, q.dtype, "lse")


def _check_reference(q, k, v, do, case, **kw):
  out, g = _grads(lambda q, k, v: jax_ring.dot_product_attention(q, k, v, **kw),
                  q, k, v, do)
  r_out, _, r_g = ref.attention(q, k, v, case, dout=do)
  dt = q.dtype
  ref.assert_close(out, r_out, dt, "out")
  for n_, a in zip("qkv", g):
    ref.assert_close(a, r_g[n_], dt, "d" + n_)


@pytest.mark.parametrize("pair", [False, True], ids=["ids", "pair"])
def test_segment_ids(pair):
  t = s = 31
  q, k, v, do = ref.random_qkv(23, B, t, s, N, K, H)
  ids = ref.random_segments(24, B, t, 4)
  case = ref.Case(H**-0.5, is_causal=True, q_segment_ids=ids,
                  kv_segment_ids=ids)
  seg = (jnp.asarray(ids), jnp.asarray(ids)) if pair else jnp.asarray(ids)
  _check_reference(q, k, v, do, case, segment_ids=seg, is_causal=True)


def test_logits_soft_cap():
  q, k, v, do = ref.random_qkv(25, B, T, S, N, K, H)
  case = ref.Case(1.0, soft_cap=5.0)
  _check_reference(q, k, v, do, case, scale=1.0, logits_soft_cap=5.0)


# Each dtype and each head dim in the default run; every pair with -m slow.
@pytest.mark.parametrize("dtype, head_dim", [
    pytest.param(d, h, marks=() if i == j else pytest.mark.slow)
    for i, d in enumerate([jnp.float32, jnp.bfloat16, jnp.float16])
    for j, h in enumerate([64, 128, 256])])
def test_dtypes_and_head_dims(dtype, head_dim):
  q, k, v, do = ref.random_qkv(26, 1, 21, 21, 2, 1, head_dim, dtype)
  case = ref.Case(head_dim**-0.5, is_causal=True)
  _check_reference(q, k, v, do, case, is_causal=True)


def test_several_default_tiles():
  """600 > 512 rows: two default tiles on both axes, partial last ones."""
  q, k, v, do = ref.random_qkv(27, 1, 600, 700, 2, 1, 16)
  case = ref.Case(0.25, is_causal=True, window=(300, 0))
  _check_reference(q, k, v, do, case, scale=0.25, is_causal=True,
                   local_window_size=(300, 0))


# Slow: unbatched q, k, v against jax.nn in the default run are
# test_never_silent.py::test_inputs_jax_nn_accepts[unbatched_bias_4d] (and
# test_edge_inputs.py::test_unbatched_query_takes_unbatched_segment_ids).
@pytest.mark.slow
def test_unbatched_inputs():
  q, k, v, _ = ref.random_qkv(28, 1, T, S, N, K, H)
  out = jax_ring.dot_product_attention(q[0], k[0], v[0], is_causal=True)
  r_out = jax.nn.dot_product_attention(q[0], k[0], v[0], is_causal=True)
  assert out.shape == (T, N, H)
  ref.assert_close(out, r_out, q.dtype, "out")


def test_fully_masked_rows_through_the_api():
  q, k, v, do = ref.random_qkv(29, B, T, S, N, K, H)
  lengths = np.array([0, 5], np.int32)  # batch 0 sees no key at all
  out, (dq, dk, dv) = _grads(
      lambda q, k, v: jax_ring.dot_product_attention(
          q, k, v, key_value_seq_lengths=lengths), q, k, v, do)
  assert np.all(np.asarray(out[0]) == 0)
  assert np.all(np.asarray(dq[0]) == 0)
  for g in (dq, dk, dv):
    assert np.all(np.isfinite(np.asarray(g)))
