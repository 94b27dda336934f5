"""Attention sinks: ``sinks=`` equals the float64 reference (output,
logsumexp and every gradient, the sinks' included) on one device with each
mask family, under every strategy in shard_map and under jit with
context parallelism; bad sinks are refused by name. The context-parallel
cases run with a value head dim unlike the key's (``HV``, multi-head
latent attention: K and V then travel apart) except where marked, so that
both of K/V's moving forms meet the sinks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ring
import reference as ref

B, T, N, K, H = 2, 13, 4, 2, 8
HV = 4  # the context-parallel cases' value head dim, unless hv=H
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


# plain and causal_window by default (causal's path: causal_window's, and
# every strategy's test below); the rest with -m slow.
@pytest.mark.parametrize("name", ["plain", "causal_window", "causal",
                                  "packed", "padding", "soft_cap"])
@pytest.mark.sample(2)
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


def test_an_infinite_or_nan_sink_makes_its_heads_nan_as_jax_nn_would():
  """A sink is one more logit: +inf or NaN there makes the head's rows NaN
  (jax.nn's softmax of a row holding one), and its gradients; -inf is a
  sink that takes nothing."""
  q, k, v, _ = ref.random_qkv(23, B, T, T, N, K, H)
  sinks = random_sinks(24).at[1].set(jnp.inf).at[2].set(jnp.nan).at[3].set(
      -jnp.inf)
  f = lambda q, s: jax_ring.dot_product_attention(q, k, v, sinks=s,
                                                  is_causal=True)
  out = np.asarray(f(q, sinks))
  assert np.isnan(out[:, :, 1:3]).all() and np.isfinite(out[:, :, [0, 3]]).all()
  np.testing.assert_array_equal(out[:, :, 3], np.asarray(
      f(q, sinks.at[3].set(-1e30)))[:, :, 3])
  dq, ds = jax.grad(lambda q, s: f(q, s).sum(), (0, 1))(q, sinks)
  ds = np.asarray(ds)
  assert np.isnan(ds[1:3]).all() and np.isfinite(ds[[0, 3]]).all()
  assert np.isnan(np.asarray(dq)[:, :, 1:3]).all()


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


def cp_vjp(f, cp, load_balance, q, k, v, do, sinks, ids):
  """``out, (dq, dk, dv, dsinks)`` of ``f(q, k, v, sinks, ids)`` for global
  inputs in natural order, put in the load-balance layout and back."""
  to = lambda x: (jax_ring.reorder_for_load_balance(
      x, cp, layout=load_balance) if load_balance else x)
  back = lambda x: (jax_ring.reorder_from_load_balance(
      x, cp, layout=load_balance) if load_balance else x)

  @jax.jit
  def go(q, k, v, do, sinks, ids):
    out, vjp = jax.vjp(lambda q, k, v, s: f(q, k, v, s, to(ids)),
                       to(q), to(k), to(v), sinks)
    dq, dk, dv, ds = vjp(to(do))
    return back(out), (back(dq), back(dk), back(dv), ds)

  return go(q, k, v, do, sinks, ids)


CP_S = 16
CP_IDS = ref.random_segments(61, B, CP_S, 3)
SHARD_MAP = {  # name -> (entry, mesh shape, axis_name, options)
    "ring_dual": (jax_ring.ring_attention, (4,), "cp",
                  dict(load_balance="dual_chunk")),
    # A window's chunk pairs compile slowly: -m slow.
    "ring_dual_window": (jax_ring.ring_attention, (4,), "cp",
                         dict(load_balance="dual_chunk",
                              local_window_size=(5, 0))),
    "ring_striped_packed": (jax_ring.ring_attention, (4,), "cp",
                            dict(load_balance="striped", packed=True, hv=H)),
    # On 2 devices: the all-gather compiles a branch per device.
    "all_gather_packed": (jax_ring.all_gather_attention, (2,), "cp",
                          dict(load_balance="dual_chunk", packed=True)),
    "ulysses": (jax_ring.ulysses_attention, (4,), "cp",
                dict(load_balance="dual_chunk")),
    "hybrid": (jax_ring.hybrid_attention, (2, 2), ("ulysses", "ring"),
               dict(load_balance="dual_chunk")),
}


# ring_dual's path (dual-chunk, Hv != H) by default through jit:
# test_sinks_under_jit_with_context_parallel[ring-4].
@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.slow)
    if n in ("ring_dual", "ring_dual_window") else n for n in SHARD_MAP])
def test_sinks_enter_each_row_once_under_every_strategy(name):
  """Inside shard_map, with causal masks: output and every gradient equal
  the float64 reference; the sinks' gradient sums over the devices."""
  attention, shape, axis, kw = SHARD_MAP[name]
  kw = dict(kw)
  packed = kw.pop("packed", False)
  hv = kw.pop("hv", HV)
  window = kw.get("local_window_size")
  devices = int(np.prod(shape))
  if len(jax.devices()) < devices:
    pytest.skip(f"needs {devices} devices")
  names = axis if isinstance(axis, tuple) else (axis,)
  m = jax.sharding.Mesh(np.array(jax.devices()[:devices]).reshape(shape),
                        names)
  seq = names[::-1] if len(names) == 2 else names[0]  # ring-major
  spec = jax.sharding.PartitionSpec(None, seq)
  f = jax.shard_map(
      lambda q, k, v, s, ids: attention(
          q, k, v, axis_name=axis, is_causal=True, sinks=s,
          segment_ids=ids if packed else None, implementation="xla", **kw),
      mesh=m, in_specs=(spec, spec, spec, jax.sharding.PartitionSpec(), spec),
      out_specs=spec)
  ring_cp = shape[-1] if len(shape) == 2 else devices
  q, k, v, do = ref.random_qkv(62, B, CP_S, CP_S, N, K, H, hv=hv)
  sinks = random_sinks(63)
  out, grads = cp_vjp(f, ring_cp, kw.get("load_balance"), q, k, v, do, sinks,
                      jnp.asarray(CP_IDS))
  case = ref.Case(H**-0.5, is_causal=True, window=window,
                  **(dict(q_segment_ids=CP_IDS, kv_segment_ids=CP_IDS)
                     if packed else {}))
  r_out, _, r_g = ref.attention(q, k, v, case, dout=do, sinks=sinks)
  ref.assert_close(out, r_out, jnp.float32, "out")
  for got, what in zip(grads, ("q", "k", "v", "sinks")):
    ref.assert_close(got, r_g[what], jnp.float32, "d" + what)


@pytest.mark.parametrize("strategy, hv", [("ring", HV), ("auto", H)])
def test_sinks_under_jit_with_context_parallel(strategy, hv):
  """The automatic path folds the sinks into the merged global result."""
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices")
  m = jax.make_mesh((2, 4), ("data", "cp"),
                    axis_types=(jax.sharding.AxisType.Auto,) * 2)
  cpc = jax_ring.ContextParallel(axis="cp", strategy=strategy,
                                 inputs="load_balanced")
  f = lambda q, k, v, s, ids: jax_ring.dot_product_attention(
      q, k, v, is_causal=True, segment_ids=ids, sinks=s,
      implementation="xla", context_parallel=cpc)
  q, k, v, do = ref.random_qkv(64, B, CP_S, CP_S, N, K, H, hv=hv)
  sinks = random_sinks(65)
  with jax.set_mesh(m):
    out, grads = cp_vjp(f, 4, "dual_chunk", q, k, v, do, sinks,
                        jnp.asarray(CP_IDS))
  case = ref.Case(H**-0.5, is_causal=True, q_segment_ids=CP_IDS,
                  kv_segment_ids=CP_IDS)
  r_out, _, r_g = ref.attention(q, k, v, case, dout=do, sinks=sinks)
  ref.assert_close(out, r_out, jnp.float32, "out")
  for got, what in zip(grads, ("q", "k", "v", "sinks")):
    ref.assert_close(got, r_g[what], jnp.float32, "d" + what)


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
