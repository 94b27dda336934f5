"""jax_ring.flax.attention_fn inside flax's own attention modules: outputs
and gradients equal flax's own attention with the same weights, on one
device and context-parallel on 8 simulated devices; and the adapter's
validators."""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_ring
import reference as ref
from jax_ring import flax as jrf

B, T, E, N, H = 3, 13, 32, 4, 8  # one device: odd batch and length
CP, DP, CP_B, CP_T = 4, 2, 2, 24  # 24 = 8 chunks of 3 for dual_chunk, cp=4
F32 = jnp.float32


def nnx_apply(attention_fn=None, **call_kw):
  """(apply(params, x, mask), params) of flax's nnx.MultiHeadAttention;
  with flax's attention when ``attention_fn`` is None. The weights depend
  only on the seed, and the tests pass one module's params to both."""
  kw = {} if attention_fn is None else dict(attention_fn=attention_fn)
  layer = nnx.MultiHeadAttention(num_heads=N, in_features=E,
                                 qkv_features=N * H, decode=False,
                                 rngs=nnx.Rngs(0), **kw)
  graphdef, params = nnx.split(layer)
  return (lambda p, x, mask: nnx.merge(graphdef, p)(x, mask=mask, **call_kw),
          params)


def linen_apply(attention_fn=None):
  """As :func:`nnx_apply`, for linen's MultiHeadDotProductAttention."""
  make = functools.partial(nn.MultiHeadDotProductAttention, num_heads=N,
                           qkv_features=N * H)
  module = make() if attention_fn is None else make(attention_fn=attention_fn)
  # Initialised with flax's attention: a context-parallel one needs a mesh.
  params = make().init(jax.random.key(0), jnp.ones((1, 8, E), F32))
  return lambda p, x, mask: module.apply(p, x, mask=mask), params


MODULES = {"nnx": nnx_apply, "linen": linen_apply}


def out_and_grads(apply, params, x, mask, dy):
  """The output and the gradients (params, x) for the cotangent ``dy``."""
  out, vjp = jax.vjp(lambda p, x: apply(p, x, mask), params, x)
  return out, vjp(dy)


def assert_all_close(got, want):
  """Every leaf of two (out, (dparams, dx)) trees, at the float32 tolerance
  of tests/reference."""
  got_leaves = jax.tree_util.tree_leaves_with_path(got)
  want_leaves = jax.tree.leaves(want)
  assert len(got_leaves) == len(want_leaves)
  for (path, g), w in zip(got_leaves, want_leaves):
    ref.assert_close(g, w, F32, jax.tree_util.keystr(path))


def inputs(seed, shape):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return (jax.random.normal(k1, shape, F32),
          jax.random.normal(k2, shape, F32))


def padded_causal_mask(batch, t, seed):
  """flax's causal mask ``(batch..., 1, T, T)`` and, per batch row, a random
  number of padded keys (at least one key stays, so that no query row is
  fully masked: there jax.nn gives the mean of V and jax_ring 0)."""
  valid = jax.random.randint(jax.random.key(seed), batch, 1, t + 1)
  keys = jnp.arange(t) < valid[..., None]
  return nnx.combine_masks(nnx.make_causal_mask(keys),
                           nnx.make_attention_mask(jnp.ones_like(keys), keys))


# name: (module, adapter options, call options, mask, x shape). "causal":
# flax's own module gets nnx.make_causal_mask and the adapted one none;
# "padded": both get padded_causal_mask; None: neither (the call options
# carry flax's is_causal to both).
CASES = {
    "nnx_call_is_causal": ("nnx", {}, dict(is_causal=True), None,
                           (B, T, E)),
    "nnx_two_batch_dims_mask": ("nnx", {}, {}, "padded", (2, B, T, E)),
    "linen_causal_option": ("linen", dict(is_causal=True), {}, "causal",
                            (B, T, E)),
    "nnx_causal_option": ("nnx", dict(is_causal=True), {}, "causal",
                          (B, T, E)),
    "nnx_mask_passed": ("nnx", {}, {}, "padded", (B, T, E)),
    "linen_mask_passed": ("linen", {}, {}, "padded", (B, T, E)),
}


# The first three in the default run, the others with -m slow: nnx's
# is_causal option is test_context_parallel_equals_flax_attention[nnx]'s,
# its padded mask nnx_two_batch_dims_mask's, linen's call of the adapter
# linen_causal_option's.
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.sample(3)
def test_adapter_equals_flax_attention_with_the_same_weights(case):
  module, options, call_kw, mask_kind, shape = CASES[case]
  x, dy = inputs(1, shape)
  mask = {None: None, "causal": nnx.make_causal_mask(x[..., 0]),
          "padded": padded_causal_mask(shape[:-2], shape[-2], 2)}[mask_kind]
  plain, params = MODULES[module](**call_kw)
  adapted, _ = MODULES[module](jrf.attention_fn(implementation="xla",
                                                **options), **call_kw)
  want = jax.jit(functools.partial(out_and_grads, plain))(params, x, mask, dy)
  got = jax.jit(functools.partial(out_and_grads, adapted))(
      params, x, mask if mask_kind == "padded" else None, dy)
  assert_all_close(got, want)


# nnx in the default run: the adapter under context parallelism is the same
# for both modules; linen's call of it: test_adapter_equals_flax_attention_
# with_the_same_weights[linen_causal_option].
@pytest.mark.parametrize("module", [
    "nnx", pytest.param("linen", marks=pytest.mark.slow)])
def test_context_parallel_equals_flax_attention(module):
  """data=2 x cp=4: inputs in the dual-chunk layout, sharded P(data, cp),
  give flax's causal-mask output and gradients in natural order."""
  if len(jax.devices()) < DP * CP:
    pytest.skip(f"needs {DP * CP} devices")
  mesh = jax.make_mesh((DP, CP), ("data", "cp"))
  x, dy = inputs(3, (CP_B, CP_T, E))
  mask = nnx.make_causal_mask(x[..., 0])
  plain, params = MODULES[module]()
  want = jax.jit(functools.partial(out_and_grads, plain))(params, x, mask, dy)

  # kv_sends="neighbour", so that the ring shows in the program as
  # collective-permutes (which attention on a gathered sequence never has).
  cpc = jax_ring.ContextParallel(axis="cp", kv_sends="neighbour",
                                 inputs="load_balanced")
  adapted, _ = MODULES[module](jrf.attention_fn(
      is_causal=True, context_parallel=cpc, implementation="xla"))
  tok = NamedSharding(mesh, P("data", "cp"))
  xs, dys = (jax.device_put(jax_ring.reorder_for_load_balance(a, CP), tok)
             for a in (x, dy))
  with jax.set_mesh(mesh):
    compiled = jax.jit(functools.partial(out_and_grads, adapted)).lower(
        params, xs, None, dys).compile()
    out, (dparams, dx) = compiled(params, xs, None, dys)
  assert "collective-permute" in compiled.as_text()
  assert out.sharding.spec[:2] == ("data", "cp")
  natural = lambda a: jax_ring.reorder_from_load_balance(np.asarray(a), CP)
  assert_all_close((natural(out), (dparams, natural(dx))), want)


def test_dtype_is_flax_computation_dtype():
  """q, k, v are promoted as flax promotes them: to ``dtype`` if given,
  else to their common float type; the output has that dtype."""
  q, k = inputs(4, (B, T, N, H))
  v = k[::-1].astype(jnp.bfloat16)
  fn = jrf.attention_fn(is_causal=True, implementation="xla")
  attend = functools.partial(jax_ring.dot_product_attention, is_causal=True,
                             implementation="xla")
  for dtype, want_dtype in ((None, F32), (jnp.bfloat16, jnp.bfloat16)):
    got = fn(q, k, v, dtype=dtype)
    flax_dtype = jax.eval_shape(functools.partial(
        nnx.dot_product_attention, dtype=dtype), q, k, v).dtype
    assert got.dtype == flax_dtype == want_dtype
    np.testing.assert_array_equal(
        got, attend(*(a.astype(want_dtype) for a in (q, k, v))))


def test_bias_and_a_low_rank_float_mask_as_flax_takes_them():
  """A bias, and a float mask (T, S) of fewer dims than flax allows: the
  same as nnx.dot_product_attention."""
  q, k = inputs(9, (B, T, N, H))
  bias = jax.random.normal(jax.random.key(10), (B, 1, T, T), F32)
  mask = jnp.tril(jnp.ones((T, T), F32))  # float, as nnx.make_*_mask gives
  # Each side one compiled program (eagerly, every op is one).
  got = jax.jit(jrf.attention_fn(implementation="xla"))(q, k, k[::-1], bias,
                                                         mask)
  want = jax.jit(nnx.dot_product_attention)(q, k, k[::-1], bias, mask)
  ref.assert_close(got, want, F32, "out")


def test_sinks_pass_through_with_their_gradient():
  """``sinks=`` at call time (a module of one's own holds them): the float64
  reference's output and sinks gradient, three batch dims flattened and
  restored."""
  q, k = inputs(11, (2, 1, 3, T, N, H))
  sinks = jax.random.normal(jax.random.key(12), (N,), F32)
  fn = jrf.attention_fn(is_causal=True, implementation="xla")
  do = jax.random.normal(jax.random.key(13), q.shape, F32)

  @jax.jit  # one compiled program (eagerly, every op is one)
  def out_and_dsinks(q, k, sinks, do):
    out, vjp = jax.vjp(lambda s: fn(q, k, k[::-1], sinks=s), sinks)
    return out, vjp(do)[0]

  out, dsinks = out_and_dsinks(q, k, sinks, do)
  q, k, do = map(np.asarray, (q, k, do))
  flat = lambda x: x.reshape((-1,) + x.shape[-3:])
  r_out, _, r_g = ref.attention(flat(q), flat(k), flat(k[::-1]),
                                ref.Case(H**-0.5, is_causal=True),
                                dout=flat(do), sinks=np.asarray(sinks))
  ref.assert_close(flat(np.asarray(out)), r_out, F32, "out")
  ref.assert_close(dsinks, r_g["sinks"], F32, "dsinks")


def test_ignored_arguments_change_nothing():
  """dropout_rng and a dropout rate with deterministic=True: the same
  output, bit for bit. A module (flax's way to sow the attention weights)
  is refused."""
  q, k = inputs(5, (B, T, N, H))
  fn = jrf.attention_fn(implementation="xla")
  np.testing.assert_array_equal(
      fn(q, k, k, dropout_rate=0.5, deterministic=True,
         dropout_rng=jax.random.key(0), force_fp32_for_softmax=True),
      fn(q, k, k))
  with pytest.raises(ValueError, match=re.escape(
      "module is given, i.e. the layer was built with sow_weights=True")):
    fn(q, k, k, module=object())


# -- validators ---------------------------------------------------------


def test_mask_under_context_parallel_names_it_and_its_shape():
  fn = jrf.attention_fn(context_parallel=jax_ring.ContextParallel(axis="cp"))
  apply, params = nnx_apply(fn)
  x, _ = inputs(6, (2, 8, E))
  mask = nnx.make_causal_mask(x[..., 0])
  message = (
      "jax_ring.flax.attention_fn: mask of shape (2, 1, 8, 8) cannot be "
      "served under context_parallel (a dense mask is not sharded along the "
      "sequence); call the module without mask= and pass is_causal=True or "
      "local_window_size= to attention_fn instead")
  with pytest.raises(ValueError, match=re.escape(message)):
    apply(params, x, mask)
  q = jnp.ones((2, 8, N, H))
  with pytest.raises(ValueError, match=re.escape(
      "jax_ring.flax.attention_fn: bias of shape (1, 1, 8, 8) cannot be ")):
    fn(q, q, q, bias=jnp.zeros((1, 1, 8, 8)))


def test_dropout_needs_rate_zero_or_deterministic():
  layer = nnx.MultiHeadAttention(
      num_heads=N, in_features=E, qkv_features=N * H, decode=False,
      dropout_rate=0.1, rngs=nnx.Rngs(0),
      attention_fn=jrf.attention_fn(implementation="xla"))
  x, _ = inputs(7, (2, 8, E))
  message = ("jax_ring.flax.attention_fn has no attention dropout: "
             "dropout_rate must be 0 (or deterministic=True); got "
             "dropout_rate=0.1 with deterministic=False")
  with pytest.raises(ValueError, match=re.escape(message)):
    layer(x, deterministic=False, rngs=nnx.Rngs(dropout=1))
  assert layer(x, deterministic=True).shape == x.shape


def test_precision_must_be_none():
  layer = nnx.MultiHeadAttention(
      num_heads=N, in_features=E, qkv_features=N * H, decode=False,
      precision=jax.lax.Precision.HIGHEST, rngs=nnx.Rngs(0),
      attention_fn=jrf.attention_fn(implementation="xla"))
  message = ("jax_ring.flax.attention_fn: precision must be None (jax_ring "
             "picks the matmul precision: HIGHEST for float32); got "
             f"{jax.lax.Precision.HIGHEST!r}")
  with pytest.raises(ValueError, match=re.escape(message)):
    layer(inputs(8, (2, 8, E))[0])


def test_einsum_replacements_and_unknown_arguments_raise():
  fn = jrf.attention_fn()
  q = jnp.ones((1, 8, N, H))
  with pytest.raises(ValueError, match=re.escape(
      "jax_ring.flax.attention_fn: qk_attn_weights_einsum must be None "
      "(jax_ring's kernels do their own matmuls); got <built-in")):
    fn(q, q, q, qk_attn_weights_einsum=print, attn_weights_value_einsum=print)
  with pytest.raises(TypeError, match=re.escape(
      "jax_ring.flax.attention_fn got unknown argument(s) ['sink']; it "
      "serves flax's ('query', 'key',")):
    fn(q, q, q, sink=jnp.zeros(N))


def test_context_parallel_option_is_checked_when_built():
  with pytest.raises(ValueError, match=re.escape(
      "context_parallel must be a jax_ring.ContextParallel; got 'cp'")):
    jrf.attention_fn(context_parallel="cp")
