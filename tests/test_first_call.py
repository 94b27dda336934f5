"""``ContextParallel``'s default takes the sequence in natural order: every
layout, strategy and mesh-axis type gives the float64 reference on natural
inputs (the permutation into the layout and back is the call's own), and
``inputs="load_balanced"`` takes arrays already in the layout, permuting
nothing; options are checked when a ``ContextParallel`` is made."""

import functools
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_ring
import reference as ref
from helpers import collectives

B, S, N, K, H = 2, 32, 4, 2, 16
IDS = ref.random_segments(3, B, S, 4)


def _mesh(shape, names, kind=jax.sharding.AxisType.Auto):
  if len(jax.devices()) < int(np.prod(shape)):
    pytest.skip("needs more devices")
  return jax.make_mesh(shape, names, axis_types=(kind,) * len(names),
                       devices=jax.devices()[:int(np.prod(shape))])


def _check(cpc, mesh, spec, *, eager=False, packed=True, layout_in=None):
  """Forward and gradients of a causal packed call against the float64
  reference, inputs natural (or put in ``layout_in`` by the test)."""
  q, k, v, do = ref.random_qkv(1, B, S, S, N, K, H)
  ids = IDS if packed else None
  case = ref.Case(H**-0.5, is_causal=True, q_segment_ids=ids,
                  kv_segment_ids=ids)
  want, _, g = ref.attention(q, k, v, case, dout=do)
  to = (lambda x: x) if layout_in is None else (
      lambda x: jax_ring.reorder_for_load_balance(x, layout_in[1],
                                                  layout=layout_in[0]))
  back = (lambda x: x) if layout_in is None else (
      lambda x: jax_ring.reorder_from_load_balance(x, layout_in[1],
                                                   layout=layout_in[0]))
  put = lambda x: jax.device_put(to(jnp.asarray(x)), NamedSharding(mesh,
                                                                    spec))
  seg = None if ids is None else put(ids)

  def f(q, k, v):
    return jax_ring.dot_product_attention(q, k, v, is_causal=True,
                                          segment_ids=seg,
                                          context_parallel=cpc)
  with jax.set_mesh(mesh):
    args = [put(x) for x in (q, k, v)]
    run = (lambda *a: jax.vjp(f, *a)) if eager else jax.jit(
        lambda *a: jax.vjp(f, *a))
    out, vjp = run(*args)
    grads = vjp(put(do))
  ref.assert_close(back(out), want, jnp.float32, "out")
  for name, x in zip("qkv", grads):
    ref.assert_close(back(x), g[name], jnp.float32, "d" + name)


# -m slow: the default (the ring, dual-chunk) is in
# test_maxtext_mesh_context_and_in_shardings and, padded, in
# test_any_length.py::test_every_strategy_at_a_length_no_layout_divides (the
# all-gather too); Ulysses (auto's pick here) in test_any_length.py::
# test_ulysses_query_and_key_lengths_padded_apart_on_explicit_axes.
@pytest.mark.parametrize("strategy, layout", [
    ("ring", "striped"), ("ring", "dual_chunk"), ("auto", "dual_chunk"),
    ("ulysses", "dual_chunk"), ("all_gather", "dual_chunk")])
@pytest.mark.sample(1)
def test_natural_inputs_are_exact_by_default(strategy, layout):
  """The first call a user makes: natural order, the default options but
  the strategy and layout, on 4 devices."""
  cpc = jax_ring.ContextParallel(strategy=strategy, load_balance=layout)
  _check(cpc, _mesh((4,), ("cp",)), P(None, "cp"))


# -m slow: hybrid on natural inputs is test_any_length.py::
# test_every_strategy_at_a_length_no_layout_divides[hybrid]'s.
@pytest.mark.slow
def test_default_with_hybrid_axes():
  """A pair of axes (the ring axis's size is the layout's)."""
  cpc = jax_ring.ContextParallel(axis=("u", "r"), strategy="hybrid")
  _check(cpc, _mesh((2, 2), ("r", "u")), P(None, ("r", "u")))


# -m slow: eagerly on Explicit axes, placed arrays, is test_never_silent.py::
# test_automatic_path_eager_and_jit_on_auto_and_explicit_axes' (gradients:
# test_plain_arrays_under_set_mesh_with_explicit_axes).
@pytest.mark.slow
def test_default_eagerly_on_explicit_axes():
  """The default ContextParallel eagerly on Explicit axes (jax.make_mesh's
  default)."""
  _check(jax_ring.ContextParallel(), _mesh(
      (4,), ("cp",), jax.sharding.AxisType.Explicit), P(None, "cp"),
         eager=True, packed=False)


# -m slow: arrays in the layout, exact with gradients, are
# test_never_silent.py::test_eager_autodiff_uses_the_layout's (eagerly).
@pytest.mark.slow
def test_load_balanced_inputs_are_exact():
  """``inputs="load_balanced"``: arrays put in the layout by the caller are
  exact."""
  laid = jax_ring.ContextParallel(inputs="load_balanced", kv_sends="neighbour")
  _check(laid, _mesh((4,), ("cp",)), P(None, "cp"),
         layout_in=("dual_chunk", 4))


def test_load_balanced_inputs_permute_nothing():
  """``inputs="load_balanced"``: the program holds the ring's sends only;
  natural inputs add the permutation's collectives, chunks sent once
  each."""
  mesh = _mesh((4,), ("cp",))
  q = jax.device_put(jnp.ones((B, S, N, H)), NamedSharding(mesh, P(None,
                                                                   "cp")))
  counts = {}
  for inputs in ("load_balanced", "natural"):
    cpc = jax_ring.ContextParallel(inputs=inputs, kv_sends="neighbour")
    with jax.set_mesh(mesh):
      hlo = jax.jit(lambda q: jax_ring.dot_product_attention(
          q, q, q, is_causal=True, context_parallel=cpc)).lower(
              q).compile().as_text()
    counts[inputs] = collectives(hlo)
  moved = lambda c: sum(c[op] for op in ("all-to-all", "collective-permute",
                                         "all-gather"))
  assert moved(counts["natural"]) > moved(counts["load_balanced"]), counts
  # The dual-chunk permutation moves chunks (ppermutes), never the whole
  # sequence onto every device (an all-gather of q, k, v or the output).
  assert counts["natural"]["all-gather"] == counts["load_balanced"][
      "all-gather"] == 0, counts


@pytest.mark.parametrize("cp", [2, 4])
def test_the_chunk_swap_is_the_dual_chunk_reorder(cp):
  """``layout.dual_chunk_swap`` (what natural inputs move by) gives the
  public reorder's order and its inverse, on a sequence split over cp."""
  from jax_ring._src.strategies.layout import dual_chunk_swap
  mesh = _mesh((cp,), ("cp",))
  x = np.random.default_rng(cp).normal(size=(2, 8 * cp, 3)).astype(
      np.float32)
  placed = jax.device_put(x, NamedSharding(mesh, P(None, "cp")))
  with jax.set_mesh(mesh):
    laid = jax.jit(lambda y: dual_chunk_swap(y, "cp", cp, mesh))(placed)
    back = jax.jit(lambda y: dual_chunk_swap(y, "cp", cp, mesh,
                                             inverse=True))(laid)
  np.testing.assert_array_equal(
      np.asarray(laid), np.asarray(jax_ring.reorder_for_load_balance(x, cp)))
  np.testing.assert_array_equal(np.asarray(back), x)


@pytest.mark.parametrize("kw, message", [
    (dict(strategy="ulyses"), "context_parallel.strategy must be one of "
     "('ring', 'all_gather', 'ulysses', 'hybrid', 'auto'); got 'ulyses'"),
    (dict(strategy="zigzag"), "context_parallel.strategy must be one of"),
    (dict(load_balance=True), "load_balance must be None, 'dual_chunk' or "
     "'striped'; got True"),
    (dict(load_balance="zig"), "load_balance must be None, 'dual_chunk' or "
     "'striped'; got 'zig'"),
    (dict(inputs="layout"), "context_parallel.inputs must be one of "
     "('natural', 'load_balanced'); got 'layout'"),
    (dict(loop="fast"), "loop must be None, 'scan' or 'unrolled'"),
    (dict(axis=("a", "a"), strategy="hybrid"), "context_parallel.axis must "
     "be one axis name or a pair (ulysses_axis, ring_axis) of distinct axis "
     "names; got ('a', 'a')"),
])
def test_bad_options_are_refused_when_made(kw, message):
  with pytest.raises(ValueError, match="^" + re.escape(message)):
    jax_ring.ContextParallel(**kw)


def test_explain_follows_the_named_strategy_and_takes_a_pair_of_sizes():
  """A strategy other than auto is what explain reports for both passes;
  the times are labelled as modelled; a (ulysses, ring) pair of sizes
  needs no ContextParallel; the permutation of natural inputs is listed."""
  shape = (1, 4096, 8, 64)
  named = jax_ring.explain(shape, shape, cp_size=4, is_causal=True,
                           context_parallel=jax_ring.ContextParallel(
                               strategy="ulysses"))
  assert (named.forward, named.backward) == ("ulysses", "ulysses")
  assert "strategy 'ulysses' as given" in named.reason
  assert "modelled from H200 measurements" in named.reason
  assert named.defaults["inputs"][0] == "natural"
  assert "permuted into 'dual_chunk'" in str(named)
  pair = jax_ring.explain(shape, shape, cp_size=(2, 4), is_causal=True)
  assert (pair.forward, pair.backward) == ("hybrid", "hybrid")
  laid = jax_ring.explain(shape, shape, cp_size=4, context_parallel=(
      jax_ring.ContextParallel(inputs="load_balanced")))
  assert "nothing is permuted" in laid.defaults["inputs"][1]


def test_maxtext_mesh_context_and_in_shardings():
  """MaxText's habit: ``with mesh:`` (no ``jax.set_mesh``) and
  ``jax.jit(in_shardings=...)``; and eagerly in the block on placed
  arrays: exact on natural inputs."""
  import warnings
  mesh = _mesh((4,), ("cp",))
  q, k, v, do = ref.random_qkv(2, B, S, S, N, K, H)
  want, _, g = ref.attention(q, k, v, ref.Case(H**-0.5, is_causal=True),
                             dout=do)
  tok = NamedSharding(mesh, P(None, "cp"))
  f = lambda q, k, v: jax_ring.dot_product_attention(
      q, k, v, is_causal=True, context_parallel=jax_ring.ContextParallel())

  def both(q, k, v, do):  # one program: out and the gradients
    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(do)

  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    with mesh:
      out, (dq, dk, dv) = jax.jit(both, in_shardings=(tok,) * 4)(q, k, v,
                                                                   do)
      eager = f(*(jax.device_put(x, tok) for x in (q, k, v)))
  for got, wanted, name in ((out, want, "out"), (eager, want, "eager"),
                            (dq, g["q"], "dq"), (dk, g["k"], "dk"),
                            (dv, g["v"], "dv")):
    ref.assert_close(got, wanted, jnp.float32, name)


@pytest.mark.parametrize("fn", [jax_ring.ring_attention,
                                jax_ring.ulysses_attention,
                                jax_ring.all_gather_attention],
                         ids=lambda f: f.__name__)
def test_a_tuple_axis_name_is_refused_by_name(fn):
  """Inside shard_map, a one-axis entry point given a tuple of axes (which
  once ran the ring over the last axis only, silently) names the
  argument and points to hybrid_attention."""
  mesh = _mesh((2, 4), ("data", "cp"))
  q = jnp.ones((1, 64, 4, 16))
  spec = P(None, ("data", "cp"))
  f = jax.shard_map(lambda q: fn(q, q, q, axis_name=("data", "cp")),
                    mesh=mesh, in_specs=spec, out_specs=spec)
  with pytest.raises(ValueError, match=re.escape(
      f"{fn.__name__}: axis_name must be one mesh axis name; got ('data', "
      "'cp'). To split the sequence over two axes, use hybrid_attention")):
    f(q)


def _padded_ids():
  """(B, S) ids: documents 1 and 2 then padding 0 at the end of row 0;
  row 1 starts with padding and holds a document 0 nowhere else."""
  ids = np.ones((B, S), np.int32)
  ids[0, 13:25], ids[0, 25:] = 2, 0
  ids[1, :6], ids[1, 6:20], ids[1, 20:] = 0, 3, 4
  return ids


def _padding_reference(q, k, v, do, ids, pad, sinks=None):
  vis = None
  if pad is not None:
    vis = ((ids != pad)[:, None, :, None] & (ids != pad)[:, None, None, :])
  case = ref.Case(H**-0.5, is_causal=True, q_segment_ids=ids,
                  kv_segment_ids=ids, dense=vis)
  return ref.attention(q, k, v, case, dout=do, sinks=sinks)


# -m slow: None, the default, where 0 is a document as in every packed test.
@pytest.mark.parametrize("pad", [pytest.param(None, marks=pytest.mark.slow),
                                 0])
def test_padding_segment_id_on_one_device(pad):
  """``padding_segment_id=0`` (TransformerEngine's and MaxText's
  convention): padding rows give 0, a finite zero gradient and the
  logsumexp of a row that sees no key (its sink's logit, with sinks);
  nobody sees padding keys. Default None: 0 is an ordinary document."""
  q, k, v, do = ref.random_qkv(4, B, S, S, N, K, H)
  ids = _padded_ids()
  sinks = jnp.asarray([0.3, -0.2, 1.0, 0.5], jnp.float32)
  dlse = jax.random.normal(jax.random.key(5), (B, S, N), jnp.float32)
  want, want_lse, g = _padding_reference(q, k, v, do, ids, pad, sinks)
  vis = None if pad is None else (
      (ids != pad)[:, None, :, None] & (ids != pad)[:, None, None, :])
  _, _, g2 = ref.attention(q, k, v, ref.Case(
      H**-0.5, is_causal=True, q_segment_ids=ids, kv_segment_ids=ids,
      dense=vis), dout=do, dlse=dlse, sinks=sinks)
  f = lambda q, k, v, s: jax_ring.dot_product_attention(
      q, k, v, is_causal=True, segment_ids=ids, sinks=s,
      padding_segment_id=pad, return_residual=True)
  (out, lse), vjp = jax.vjp(jax.jit(f), q, k, v, sinks)
  grads = vjp((do, dlse))
  ref.assert_close(out, want, jnp.float32, "out")
  ref.assert_close(lse, want_lse, jnp.float32, "lse")
  for name, x in zip(("q", "k", "v", "sinks"), grads):
    assert np.isfinite(np.asarray(x)).all(), name
    ref.assert_close(x, g2[name], jnp.float32, "d" + name)


@pytest.mark.parametrize("entry", [
    "jit", pytest.param("shard_map", marks=pytest.mark.slow)])
def test_padding_segment_id_across_devices(entry):
  """The same convention under context parallelism (natural inputs) and
  inside shard_map (the ring, dual-chunk shards)."""
  mesh = _mesh((4,), ("cp",))
  q, k, v, do = ref.random_qkv(6, B, S, S, N, K, H)
  ids = _padded_ids()
  want, _, g = _padding_reference(q, k, v, do, ids, 0)
  tok = NamedSharding(mesh, P(None, "cp"))
  if entry == "jit":
    put = lambda x: jax.device_put(jnp.asarray(x), tok)
    back = lambda x: x
    seg = put(ids)
    f = lambda q, k, v: jax_ring.dot_product_attention(
        q, k, v, is_causal=True, segment_ids=seg, padding_segment_id=0,
        context_parallel=jax_ring.ContextParallel())
  else:
    put = lambda x: jax.device_put(jax_ring.reorder_for_load_balance(
        jnp.asarray(x), 4), tok)
    back = lambda x: jax_ring.reorder_from_load_balance(x, 4)
    seg = put(ids)
    f = jax.shard_map(lambda q, k, v, s: jax_ring.ring_attention(
        q, k, v, axis_name="cp", is_causal=True, load_balance="dual_chunk",
        segment_ids=s, padding_segment_id=0), mesh=mesh,
        in_specs=(P(None, "cp"),) * 4, out_specs=P(None, "cp"))
    f = functools.partial(lambda f, q, k, v: f(q, k, v, seg), f)
  with jax.set_mesh(mesh):
    out, vjp = jax.jit(lambda *a: jax.vjp(f, *a))(*(put(x) for x in (q, k,
                                                                       v)))
    grads = vjp(put(do))
  ref.assert_close(back(out), want, jnp.float32, "out")
  for name, x in zip("qkv", grads):
    ref.assert_close(back(x), g[name], jnp.float32, "d" + name)


def test_padding_segment_id_is_checked():
  q = jnp.ones((1, 8, 2, 8))
  for kw, message in (
      (dict(padding_segment_id=0), "padding_segment_id=0 needs segment_ids"),
      (dict(padding_segment_id=1.5, segment_ids=jnp.zeros((1, 8), int)),
       "padding_segment_id must be None or an int segment id; got 1.5")):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
      jax_ring.dot_product_attention(q, q, q, **kw)


def test_plain_arrays_under_set_mesh_with_explicit_axes():
  """``jax.make_mesh``'s default axes (Explicit) and arrays placed nowhere:
  ``dot_product_attention`` eagerly (its vjp's output and gradients) and
  under jit, as on one device."""
  mesh = _mesh((4,), ("cp",), jax.sharding.AxisType.Explicit)
  q, k, v, do = ref.random_qkv(7, B, S, S, N, K, H)
  want, _, g = ref.attention(q, k, v, ref.Case(
      H**-0.5, is_causal=True, q_segment_ids=IDS, kv_segment_ids=IDS),
                             dout=do)
  f = lambda q, k, v: jax_ring.dot_product_attention(
      q, k, v, is_causal=True, segment_ids=IDS,
      context_parallel=jax_ring.ContextParallel())
  with jax.set_mesh(mesh):
    eager, vjp = jax.vjp(f, q, k, v)
    jitted, grads = jax.jit(f)(q, k, v), vjp(do)
  for got, name in ((eager, "eager"), (jitted, "jit")):
    ref.assert_close(got, want, jnp.float32, name)
  for name, x in zip("qkv", grads):
    ref.assert_close(x, g[name], jnp.float32, "d" + name)


# -m slow: decode_attention over cp, eagerly and under jit (Auto axes), is
# test_decode.py::test_context_parallel_under_jit_and_eagerly_moves_no_kv.
@pytest.mark.slow
def test_decode_with_host_positions_under_set_mesh_with_explicit_axes():
  """``decode_attention`` on Explicit axes, the cache placed, the values
  and positions not (host positions), as on one device."""
  mesh = _mesh((4,), ("cp",), jax.sharding.AxisType.Explicit)
  q, k, v, _ = ref.random_qkv(7, B, S, S, N, K, H)
  kv_pos = np.arange(S, dtype=np.int32)[None].repeat(B, 0)
  q_pos = np.full((B, 1), S, np.int32)
  with jax.set_mesh(mesh):
    cache = jax.device_put(k, NamedSharding(mesh, P(None, "cp")))
    split = jax_ring.decode_attention(
        q[:, :1], cache, v, query_positions=q_pos, key_positions=kv_pos,
        context_parallel=jax_ring.ContextParallel())
  vis = np.ones((B, 1, 1, S), bool)
  ref.assert_close(split, ref.attention(q[:, :1], k, v, ref.Case(
      H**-0.5, dense=vis))[0], jnp.float32, "decode")


def test_an_eager_call_like_an_earlier_one_compiles_nothing(caplog):
  """Eagerly on Auto axes, a context-parallel call runs the program an
  earlier call of the same config, mesh and shapes compiled."""
  mesh = jax.make_mesh((4,), ("cp",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  q = jax.random.normal(jax.random.key(0), (1, 19, 4, 8))
  call = lambda: jax_ring.dot_product_attention(
      q, q, q, is_causal=True, implementation="xla",
      context_parallel=jax_ring.ContextParallel(axis="cp"))
  compiles = lambda: sum("Compiling" in r.getMessage()
                         for r in caplog.records)
  with jax.set_mesh(mesh), jax.log_compiles(True), caplog.at_level(
      logging.WARNING):
    first = call()
    assert compiles() > 0
    caplog.clear()
    np.testing.assert_array_equal(call(), first)
    assert compiles() == 0, [r.getMessage() for r in caplog.records]
