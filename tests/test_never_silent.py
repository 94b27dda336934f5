"""Exact or a clear error: the inputs a new user tries first.

Each call either equals the float64 reference (``jax.nn`` where it takes
the call), eagerly and under ``jax.jit``, or raises ``ValueError`` /
``TypeError`` at trace time naming the argument. Compiled programs are
few and small (a 4-device mesh, 16 tokens): most cases only trace.
"""

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_ring
import reference as ref

B, T, N, K, H = 2, 16, 4, 2, 8
CP = 4
SEQ = P(None, "cp")


def cp_mesh(kind=AxisType.Auto, shape=(CP,), names=("cp",)):
  if len(jax.devices()) < np.prod(shape):
    pytest.skip(f"needs {np.prod(shape)} devices")
  return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape))


def placed(mesh, *xs, layout="dual_chunk", spec=SEQ):
  """Natural-order arrays in ``layout`` for the mesh's cp axis, placed."""
  cp = mesh.shape["cp"]
  to = lambda x: (jax_ring.reorder_for_load_balance(x, cp, layout=layout)
                  if layout else x)
  return [jax.device_put(to(x), NamedSharding(mesh, spec)) for x in xs]


def natural(x, cp, layout="dual_chunk"):
  return np.asarray(jax_ring.reorder_from_load_balance(
      np.asarray(x), cp, layout=layout) if layout else x)


def qkv(seed=0, t=T, s=T, n=N, k=K):
  """Random normal q, k, v (NumPy: no compile per shape)."""
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.normal(size=shape), jnp.float32)
               for shape in ((B, t, n, H), (B, s, k, H), (B, s, k, H)))


# --- the automatic path: eager equals jit equals the reference -------------

# Auto axes with -m slow: eagerly there, test_eager_autodiff_uses_the_layout
# [ring-vjp] (the same packed dual-chunk call, its forward and gradients);
# under jit, test_plain_arrays_under_set_mesh_and_jit.
@pytest.mark.parametrize("kind", [
    pytest.param(AxisType.Auto, marks=pytest.mark.slow), AxisType.Explicit])
def test_automatic_path_eager_and_jit_on_auto_and_explicit_axes(kind):
  """The README's call, without and with jax.jit, on both axis kinds
  (jax 0.10's make_mesh gives Explicit), packed documents, dual-chunk."""
  mesh = cp_mesh(kind)
  q, k, v = qkv(1)
  seg = jnp.asarray(ref.random_segments(2, B, T, 3))
  cpc = jax_ring.ContextParallel(axis="cp", inputs="load_balanced")
  f = lambda q, k, v, seg: jax_ring.dot_product_attention(
      q, k, v, is_causal=True, segment_ids=seg, context_parallel=cpc)
  args = placed(mesh, q, k, v, seg)
  case = ref.Case(H**-0.5, is_causal=True, q_segment_ids=np.asarray(seg),
                  kv_segment_ids=np.asarray(seg))
  expected, _ = ref.attention(q, k, v, case)
  eager, jitted = f(*args), jax.jit(f)(*args)
  ref.assert_close(natural(eager, CP), expected, q.dtype, "eager")
  np.testing.assert_array_equal(np.asarray(eager), np.asarray(jitted))


# -m slow: jax.grad of jax.checkpoint (eager gradients in the layout are
# the vjp case's), auto and Explicit axes (both transforms each).
@pytest.mark.parametrize("strategy, kind, transforms", [
    ("ring", AxisType.Auto, ("vjp",)),
    ("ring", AxisType.Auto, ("checkpoint",)),
    ("auto", AxisType.Auto, ("vjp", "checkpoint")),
    pytest.param("ring", AxisType.Explicit, ("vjp", "checkpoint"),
                 marks=pytest.mark.slow)],
    ids=["ring-vjp", "ring-checkpoint", "auto", "ring-explicit"])
@pytest.mark.sample(1)
def test_eager_autodiff_uses_the_layout(strategy, kind, transforms):
  """jax.grad, jax.vjp and jax.checkpoint with no jax.jit around them
  (dual-chunk, causal, packed): the forward and every gradient are the
  reference's, as under jit; on Explicit axes too (under jax.set_mesh, as
  jax's own gradients there need), where the forward and the backward are
  two programs."""
  mesh = cp_mesh(kind)
  with jax.set_mesh(mesh) if kind == AxisType.Explicit else (
      contextlib.nullcontext()):
    _eager_autodiff(mesh, strategy, transforms)


def _eager_autodiff(mesh, strategy, transforms):
  q, k, v = qkv(7)
  do = jax.random.normal(jax.random.key(8), q.shape)
  seg = jnp.asarray(ref.random_segments(9, B, T, 3))
  cpc = jax_ring.ContextParallel(axis="cp", strategy=strategy,
                                 inputs="load_balanced")
  f = lambda q, k, v, seg: jax_ring.dot_product_attention(
      q, k, v, is_causal=True, segment_ids=seg, context_parallel=cpc)
  *args, seg_p, do_p = placed(mesh, q, k, v, seg, do)
  case = ref.Case(H**-0.5, is_causal=True, q_segment_ids=np.asarray(seg),
                  kv_segment_ids=np.asarray(seg))
  r_out, _, g = ref.attention(q, k, v, case, dout=do)
  if "vjp" in transforms:
    out, vjp = jax.vjp(lambda *a: f(*a, seg_p), *args)
    ref.assert_close(natural(out, CP), r_out, q.dtype, "vjp's out")
    for name, got in zip("qkv", vjp(do_p)):
      ref.assert_close(natural(got, CP), g[name], q.dtype, "d" + name)
  if "checkpoint" in transforms:
    loss = lambda q, k, v: jnp.sum(jax.checkpoint(f)(q, k, v, seg_p) * do_p)
    for name, got in zip("qkv", jax.grad(loss, (0, 1, 2))(*args)):
      ref.assert_close(natural(got, CP), g[name], q.dtype, "grad d" + name)


def test_flax_attention_fn_eager_uses_the_layout():
  pytest.importorskip("flax")
  import jax_ring.flax
  mesh = cp_mesh()
  q, k, v = qkv(3)
  fn = jax_ring.flax.attention_fn(
      is_causal=True, context_parallel=jax_ring.ContextParallel(
          axis="cp", inputs="load_balanced"))
  out = fn(*placed(mesh, q, k, v))
  expected, _ = ref.attention(q, k, v, ref.Case(H**-0.5, is_causal=True))
  ref.assert_close(natural(out, CP), expected, q.dtype)


@pytest.mark.parametrize("made", ["inside", "outside"])
def test_plain_arrays_under_set_mesh_and_jit(made):
  """Unplaced arrays, made under jax.set_mesh (replicated on its mesh) or
  before it (on one device: then nothing in the program names a mesh, and
  XLA hands the partition rule an empty one): the call runs on the mesh in
  scope."""
  mesh = cp_mesh()
  q, k, v = qkv(4)
  to = lambda *xs: [jax_ring.reorder_for_load_balance(x, CP) for x in xs]
  f = jax.jit(lambda q, k, v: jax_ring.dot_product_attention(
      q, k, v, is_causal=True,
      context_parallel=jax_ring.ContextParallel(axis="cp",
                                                inputs="load_balanced")))
  args = to(q, k, v) if made == "outside" else None
  with jax.set_mesh(mesh):
    out = f(*(args or to(q, k, v)))
  expected, _ = ref.attention(q, k, v, ref.Case(H**-0.5, is_causal=True))
  ref.assert_close(natural(out, CP), expected, q.dtype)


# Without ids with -m slow: id_pair is the same causal T != S call, with
# a pair of ids of two lengths besides.
@pytest.mark.parametrize("ids", [
    pytest.param(False, marks=pytest.mark.slow), True],
    ids=["causal", "id_pair"])
def test_ulysses_serves_t_not_equal_s_with_gradients(ids):
  """Causal cross-length attention (top-left, as jax.nn): Ulysses gathers
  whole sequences, so it serves T != S exactly; contiguous shards; with a
  (query ids, key ids) pair of two lengths too."""
  mesh = cp_mesh()
  q, k, v = qkv(5, t=8, s=T)
  do = jax.random.normal(jax.random.key(6), q.shape)
  cpc = jax_ring.ContextParallel(axis="cp", strategy="ulysses",
                                 load_balance=None)
  seg = (ref.random_segments(10, B, 8, 3), ref.random_segments(11, B, T, 3))
  f = lambda q, k, v: jax_ring.dot_product_attention(
      q, k, v, is_causal=True, context_parallel=cpc, segment_ids=tuple(
          jax.device_put(x, NamedSharding(mesh, SEQ)) for x in seg)
      if ids else None)
  args = placed(mesh, q, k, v, layout=None)
  out, vjp = jax.jit(lambda *a: jax.vjp(f, *a))(*args)
  grads = vjp(jax.device_put(do, NamedSharding(mesh, SEQ)))
  case = ref.Case(H**-0.5, is_causal=True, **dict(
      q_segment_ids=seg[0], kv_segment_ids=seg[1]) if ids else {})
  r_out, _, g = ref.attention(q, k, v, case, dout=do)
  ref.assert_close(out, r_out, q.dtype, "out")
  for name, got in zip("qkv", grads):
    ref.assert_close(got, g[name], q.dtype, "d" + name)


def test_shard_map_entry_points_run_eagerly():
  """An eager shard_map (no jax.jit) with gradients (op by op: 2 devices,
  8 tokens). The ring's blocks, as every strategy's, bind the kernel
  without a custom VJP of their own, which an eager shard_map refuses."""
  mesh = cp_mesh(shape=(2,))
  q, k, v = qkv(7, t=8, s=8)
  f = jax.shard_map(lambda q, k, v: jax_ring.ring_attention(
      q, k, v, axis_name="cp", is_causal=True),
                    mesh=mesh, in_specs=SEQ, out_specs=SEQ)
  out, vjp = jax.vjp(f, q, k, v)
  dq = vjp(jnp.ones_like(out))[0]
  r_out, _, g = ref.attention(q, k, v, ref.Case(H**-0.5, is_causal=True),
                              dout=np.ones(q.shape))
  ref.assert_close(out, r_out, q.dtype, "out")
  ref.assert_close(dq, g["q"], q.dtype, "dq")


# --- mesh-dependent refusals: ValueError eagerly and under jit -------------

def _cp_call(strategy="ring", load_balance="dual_chunk", axis="cp", t=T,
             s=T, n=N, k=K, mesh_shape=(CP,), names=("cp",),
             inputs="natural"):
  """The call, its arguments (placed where the shapes allow) and mesh."""
  mesh = cp_mesh(shape=mesh_shape, names=names)
  q, kk, v = qkv(8, t=t, s=s, n=n, k=k)
  if t % CP == 0 and s % CP == 0:
    spec = P(None, names if len(names) > 1 else names[0])
    q, kk, v = (jax.device_put(x, NamedSharding(mesh, spec))
                for x in (q, kk, v))
  cpc = jax_ring.ContextParallel(axis=axis, strategy=strategy,
                                 load_balance=load_balance, inputs=inputs)
  return lambda q, k, v: jax_ring.dot_product_attention(
      q, k, v, is_causal=True, context_parallel=cpc), (q, kk, v), mesh


CP_REFUSALS = {
    "ring_t_ne_s": (dict(t=8), "strategy 'ring' needs the query and key "
                    "sequences equally long (self-attention); got query "
                    "(2, 8, 4, 8) and key (2, 16, 2, 8)"),
    "all_gather_t_ne_s": (dict(strategy="all_gather", s=32, load_balance=None),
                          "strategy 'all_gather' needs the query and key "
                          "sequences equally long"),
    "auto_t_ne_s_heads": (dict(strategy="auto", s=32, n=2, k=1),
                          "strategy 'auto' runs Ulysses where the query "
                          "length (16) differs from the key length (32): "
                          "ulysses_attention splits query heads over axis "
                          "'cp': query heads (2) must be divisible by its "
                          "size (4)"),
    "ulysses_heads": (dict(strategy="ulysses", n=2, k=1),
                      "ulysses_attention splits query heads over axis 'cp'"),
    "all_gather_striped": (dict(strategy="all_gather", load_balance="striped"),
                           "strategy 'all_gather' does not support "
                           "load_balance='striped'"),
    # Arrays in a layout must divide (natural ones are padded).
    "dual_chunk_length": (dict(t=12, s=12, inputs="load_balanced"),
                          "load_balance='dual_chunk' needs "
                          "the global sequence length (12) divisible by 2 * "
                          "cp_size = 8"),
    "dual_chunk_key_length": (dict(strategy="ulysses", t=16, s=12,
                                   inputs="load_balanced"),
                              "load_balance='dual_chunk' needs the global "
                              "sequence length (12) divisible by 2 * cp_size "
                              "= 8; the local key length is 3"),
    "length_not_divisible": (dict(t=10, s=10, load_balance="striped",
                                  inputs="load_balanced"),
                             "context_parallel: the sequence length of query "
                             "(2, 10, 4, 8) must be divisible by the 'cp' "
                             "axis size 4"),
    "missing_axis": (dict(axis="sp"), "context_parallel.axis 'sp': 'sp' is "
                     "not an axis of the mesh in scope"),
    "hybrid_t_ne_s": (dict(strategy="hybrid", axis=("u", "cp"), t=8,
                           load_balance=None, mesh_shape=(2, 2),
                           names=("cp", "u")),
                      "strategy 'hybrid' needs the query and key sequences"),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(CP_REFUSALS))
def test_context_parallel_refusals_are_value_errors(name, jit):
  kw, message = CP_REFUSALS[name]
  f, args, mesh = _cp_call(**kw)
  with jax.set_mesh(mesh), pytest.raises(ValueError,
                                         match="^" + re.escape(message)):
    (jax.jit(f) if jit else f)(*args)


@pytest.mark.parametrize("name", ["ring", "all_gather", "hybrid"])
def test_shard_map_entry_points_refuse_t_not_equal_s(name):
  mesh = cp_mesh(shape=(2, 2), names=("cp", "u"))
  axis = ("u", "cp") if name == "hybrid" else "cp"
  fn = getattr(jax_ring, f"{name}_attention")
  q, k, v = qkv(9, s=8)  # K/V shorter than the queries on every device
  f = jax.jit(jax.shard_map(
      lambda q, k, v: fn(q, k, v, axis_name=axis, is_causal=True),
      mesh=mesh, in_specs=P(None, ("cp", "u")), out_specs=P(None, ("cp", "u"))))
  with pytest.raises(ValueError, match=f"strategy '{name}' needs the query "
                     r"and key sequences equally long \(self-attention\); got "
                     r"query \(2, 4, 4, 8\) and key \(2, 2, 2, 8\)"):
    f(q, k, v)


def test_auto_with_a_pair_of_axes_is_hybrid():
  mesh = cp_mesh(shape=(2, 2), names=("cp", "u"))
  q, k, v = qkv(10)
  cpc = jax_ring.ContextParallel(axis=("u", "cp"), strategy="auto",
                                 inputs="load_balanced")
  spec = P(None, ("cp", "u"))
  to = lambda x: jax_ring.reorder_for_load_balance(x, 2)
  args = [jax.device_put(to(x), NamedSharding(mesh, spec)) for x in (q, k, v)]
  out = jax.jit(lambda q, k, v: jax_ring.dot_product_attention(
      q, k, v, is_causal=True, context_parallel=cpc))(*args)
  expected, _ = ref.attention(q, k, v, ref.Case(H**-0.5, is_causal=True))
  ref.assert_close(natural(out, 2), expected, q.dtype)
  assert jax_ring.explain(q.shape, k.shape, cp_size=(2, 2),
                          context_parallel=cpc).forward == "hybrid"


# --- explain checks what the call checks ------------------------------------

EXPLAIN_REFUSALS = {
    "cp_zero": (dict(cp_size=0), "cp_size must be a positive int; got 0"),
    "cp_negative": (dict(cp_size=-2), "cp_size must be a positive int; got -2"),
    "cp_bool": (dict(cp_size=True), "cp_size must be a positive int; got True"),
    "not_divisible": (dict(cp_size=3, context_parallel=dict(
        inputs="load_balanced")), "context_parallel: the sequence "
                      "length of query (1, 64, 8, 16) must be divisible by "
                      "the 'cp' axis size 3"),
    "gqa": (dict(key_shape=(1, 64, 3, 16)), "query heads (8) must be "
            "divisible by key/value heads (3)"),
    "zero_kv_heads": (dict(key_shape=(1, 64, 0, 16)), "query heads, key/value"
                      " heads and head_dim must be positive"),
    # A ContextParallel's own choices are refused when it is made.
    "strategy": (dict(context_parallel=dict(strategy="fastest")),
                 "context_parallel.strategy must be one of"),
    "layout": (dict(context_parallel=dict(strategy="auto",
                                          load_balance="zigzag")),
               "load_balance must be None, 'dual_chunk' or 'striped'; got "
               "'zigzag'"),
    "window": (dict(local_window_size=-1), "local_window_size must be a "
               "non-negative int"),
    "dtype_bytes": (dict(dtype_bytes=3), "dtype_bytes must be 2"),
    "shape": (dict(query_shape=(64, 8, 16)), "query_shape, key_shape and "
              "value_shape must be (B, T, N, H), (B, S, K, H) and (B, S, K, "
              "Hv)"),
    "value_shape": (dict(value_shape=(1, 32, 4, 8)), "key and value must "
                    "agree on batch, sequence and heads"),
    "ring_t_ne_s": (dict(key_shape=(1, 32, 2, 16), context_parallel=
                         jax_ring.ContextParallel()),
                    "strategy 'ring' needs the query and key sequences"),
}


@pytest.mark.parametrize("name", list(EXPLAIN_REFUSALS))
def test_explain_refuses_what_the_call_refuses(name):
  kw, message = EXPLAIN_REFUSALS[name]
  args = dict(query_shape=(1, 64, 8, 16), key_shape=(1, 64, 2, 16),
              cp_size=4) | kw
  with pytest.raises(ValueError, match="^" + re.escape(message)):
    if isinstance(args.get("context_parallel"), dict):
      args["context_parallel"] = jax_ring.ContextParallel(
          **args["context_parallel"])
    jax_ring.explain(args.pop("query_shape"), args.pop("key_shape"), **args)


def test_explain_t_not_equal_s_picks_ulysses():
  choice = jax_ring.explain((1, 64, 8, 16), (1, 128, 2, 16), cp_size=4)
  assert (choice.forward, choice.backward) == ("ulysses", "ulysses")


# --- one device: what jax.nn takes, jax_ring takes -------------------------

def _both(q, k, v, *args, **kw):
  """jax_ring's and jax.nn's outputs, one compiled program (``kw`` static)."""
  return jax.jit(lambda q, k, v, *args: (
      jax_ring.dot_product_attention(q, k, v, *args, **kw),
      jax.nn.dot_product_attention(q, k, v, *args, implementation="xla",
                                   **kw)))(q, k, v, *args)


@pytest.mark.parametrize("name", ["numpy_scale", "array_scale", "bias_3d",
                                  "mask_2d", "unbatched_bias_4d"])
def test_inputs_jax_nn_accepts(name):
  q, k, v = qkv(11)
  rng = np.random.default_rng(12)
  unbatched = name == "unbatched_bias_4d"
  if unbatched:
    q, k, v = q[0], k[0], v[0]
  kw = {
      "numpy_scale": dict(scale=np.float32(0.3)),
      "array_scale": dict(scale=jnp.asarray(0.3)),
      "bias_3d": dict(bias=rng.normal(size=(N, T, T)).astype(np.float32)),
      "mask_2d": dict(mask=np.tril(np.ones((T, T), bool))),
      "unbatched_bias_4d": dict(bias=rng.normal(size=(1, N, T, T)).astype(
          np.float32)),
  }[name]
  ours, theirs = _both(q, k, v, **kw)
  ref.assert_close(ours, theirs, q.dtype)


def test_soft_cap_takes_numpy_scalars():
  q, k, v = qkv(13)
  a = jax_ring.dot_product_attention(q, k, v, logits_soft_cap=np.float32(3.0))
  b = jax_ring.dot_product_attention(q, k, v, logits_soft_cap=3.0)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_traced_scale_is_a_type_error():
  q, k, v = qkv(14)
  with pytest.raises(TypeError, match="^scale must be a concrete number"):
    jax.jit(lambda s: jax_ring.dot_product_attention(q, k, v, scale=s))(0.5)


@pytest.mark.parametrize("shape", ["t0", "s0", "b0"])
def test_empty_sequences_give_empty_or_zero_outputs(shape):
  t, s, b = {"t0": (0, T, B), "s0": (T, 0, B), "b0": (T, T, 0)}[shape]
  q = jnp.ones((b, t, N, H))
  k = v = jnp.ones((b, s, K, H))
  out, grads = jax.value_and_grad(
      lambda q, k, v: jax_ring.dot_product_attention(q, k, v).sum(),
      argnums=(0, 1, 2))(q, k, v)
  assert float(out) == 0.0
  for g, x in zip(grads, (q, k, v)):
    assert g.shape == x.shape and not np.any(np.asarray(g))


@pytest.mark.parametrize("t, s", [(0, 0), (8, 0)])
def test_empty_sequences_under_context_parallelism(t, s):
  mesh = cp_mesh()
  q, k, v = qkv(19, t=t, s=s)
  cpc = jax_ring.ContextParallel(axis="cp", strategy="ulysses")
  with jax.set_mesh(mesh):
    out = jax_ring.dot_product_attention(q, k, v, context_parallel=cpc)
  assert out.shape == q.shape and not np.any(np.asarray(out))


@pytest.mark.parametrize("dims", [(4, 0, 8), (0, 2, 8), (4, 2, 0)])
def test_zero_heads_or_head_dim_are_value_errors(dims):
  n, k, h = dims
  with pytest.raises(ValueError, match="^query heads, key/value heads and "
                     "head_dim must be positive"):
    jax_ring.dot_product_attention(jnp.ones((1, 4, n, h)),
                                   jnp.ones((1, 4, k, h)),
                                   jnp.ones((1, 4, k, h)))


@pytest.mark.parametrize("window", [2**31 - 1, 2**31, 2**40, (2**40, 0)])
def test_windows_of_any_size_at_least_the_sequence(window):
  """A window at least the sequence bounds nothing on that side (int32
  positions never overflow), also on the ring."""
  q, k, v = qkv(15)
  right = None if isinstance(window, int) else 0
  expected, _ = ref.attention(q, k, v, ref.Case(H**-0.5,
                                                is_causal=right == 0))
  got = jax_ring.dot_product_attention(q, k, v, local_window_size=window)
  ref.assert_close(got, expected, q.dtype)


def test_a_huge_window_on_the_ring():
  mesh = cp_mesh()
  q, k, v = qkv(16)
  f = jax.jit(jax.shard_map(
      lambda q, k, v: jax_ring.ring_attention(
          q, k, v, axis_name="cp", local_window_size=(2**40, 2**31)),
      mesh=mesh, in_specs=SEQ, out_specs=SEQ))
  expected, _ = ref.attention(q, k, v, ref.Case(H**-0.5))
  ref.assert_close(f(q, k, v), expected, q.dtype)


# --- non-finite values propagate as in jax.nn ------------------------------

def _poisoned(seed, where):
  q, k, v = (np.array(x) for x in qkv(seed))
  if where == "q_nan":
    q[0, 5, 1, 3] = np.nan
  elif where == "k_nan":
    k[1, 9, 0, 2] = np.nan
  elif where == "k_inf":
    k[0, 6, 1, 0] = np.inf
  return q, k, v


@pytest.mark.parametrize("where", ["q_nan", "k_nan", "k_inf", "bias_inf"])
def test_non_finite_inputs_propagate_as_in_jax_nn(where):
  """Same NaN pattern as jax.nn (causal): the rows whose visible logits hold
  a NaN or an Inf are NaN, the others equal it."""
  q, k, v = _poisoned(17, where)
  bias = None
  if where == "bias_inf":
    bias = np.zeros((1, 1, T, T), np.float32)
    bias[0, 0, 7, 3] = np.inf
  ours, theirs = _both(q, k, v, bias, is_causal=True)
  ours, theirs = np.asarray(ours), np.asarray(theirs)
  np.testing.assert_array_equal(np.isnan(ours), np.isnan(theirs))
  assert np.isnan(theirs).any() and not np.isnan(theirs).all()
  fine = ~np.isnan(theirs)
  np.testing.assert_allclose(ours[fine], theirs[fine], atol=2e-5)


# -m slow: the all-gather and Ulysses, whose kernel sees whole key rows (as
# in test_non_finite_inputs_propagate_as_in_jax_nn); the ring merges parts.
@pytest.mark.parametrize("strategy", ["ring", "all_gather", "ulysses"])
@pytest.mark.sample(1)
def test_non_finite_inputs_propagate_under_every_strategy(strategy):
  """A NaN in one query row and one key: under context parallelism the
  output's NaN rows are exactly jax.nn's (causal, dual-chunk)."""
  mesh = cp_mesh()
  q, k, v = _poisoned(18, "q_nan")
  k[1, 9, 0, 2] = np.nan
  cpc = jax_ring.ContextParallel(axis="cp", strategy=strategy,
                                 inputs="load_balanced")
  out = jax.jit(lambda q, k, v: jax_ring.dot_product_attention(
      q, k, v, is_causal=True, context_parallel=cpc))(*placed(mesh, q, k, v))
  theirs = np.asarray(jax.nn.dot_product_attention(q, k, v, is_causal=True))
  np.testing.assert_array_equal(np.isnan(natural(out, CP)), np.isnan(theirs))
