"""Transforms of a context-parallel call under ``jax.jit``: ``jax.vmap``
folds the mapped axis into the batch (mapped operands at any axis, others
broadcast, nested maps), composed with ``jax.grad`` either way round, on
Auto and Explicit mesh axes, eagerly and under jit; forward mode is
refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_ring
import reference as ref

V, B, S, N, K, H = 3, 2, 32, 4, 2, 16
CP = jax_ring.ContextParallel()


def _mesh(kind):
  if len(jax.devices()) < 4:
    pytest.skip("needs 4 devices")
  return jax.make_mesh((2, 2), ("data", "cp"), axis_types=(kind, kind),
                       devices=jax.devices()[:4])


def _instances():
  """V problems: q, k, v, dout (each stacked on axis 1: (B, V, S, ...)),
  packed segment ids (B, V, S), one sinks vector (N,) for all."""
  parts = [ref.random_qkv(10 + i, B, S, S, N, K, H) for i in range(V)]
  q, k, v, do = (jnp.stack([p[j] for p in parts], 1) for j in range(4))
  ids = np.stack([ref.random_segments(i, B, S, 3) for i in range(V)], 1)
  sinks = jax.random.normal(jax.random.key(7), (N,), jnp.float32)
  return q, k, v, do, ids, sinks


def _expected(q, k, v, do, ids, sinks, shared_kv=False):
  """Per instance float64 out and grads; sinks' gradient summed."""
  outs, grads = [], []
  for i in range(V):
    case = ref.Case(H**-0.5, is_causal=True, q_segment_ids=ids[:, i],
                    kv_segment_ids=ids[:, i])
    kv = (k[:, 0], v[:, 0]) if shared_kv else (k[:, i], v[:, i])
    out, _, g = ref.attention(q[:, i], *kv, case, dout=do[:, i],
                              sinks=sinks)
    outs.append(out)
    grads.append(g)
  stack = lambda name: np.stack([g[name] for g in grads], 1)
  return np.stack(outs, 1), {"q": stack("q"), "k": stack("k"),
                             "v": stack("v"),
                             "sinks": sum(g["sinks"] for g in grads)}


def _attend(q, k, v, ids, sinks):
  return jax_ring.dot_product_attention(q, k, v, is_causal=True,
                                        segment_ids=ids, sinks=sinks,
                                        context_parallel=CP)


@pytest.mark.parametrize("kind, eager", [
    (jax.sharding.AxisType.Auto, False),
    (jax.sharding.AxisType.Explicit, True)], ids=["auto-jit", "explicit"])
@pytest.mark.sample(1)
def test_vmap_folds_the_mapped_axis_into_the_batch(kind, eager):
  """vmap over axis 1 of q, k, v, dout and the segment ids (sinks shared),
  out on axis 1, differentiated through: output and every gradient equal
  each instance's reference."""
  q, k, v, do, ids, sinks = _instances()
  want, g = _expected(q, k, v, do, ids, sinks)
  mesh = _mesh(kind)
  mapped = jax.vmap(_attend, (1, 1, 1, 1, None), out_axes=1)
  with jax.set_mesh(mesh):
    put = lambda x, spec: jax.device_put(jnp.asarray(x),
                                         NamedSharding(mesh, spec))
    args = [put(x, P("data", None, "cp")) for x in (q, k, v)]
    seg, dout = put(ids, P("data", None, "cp")), put(do, P("data", None,
                                                           "cp"))
    vjp = lambda q, k, v, s: jax.vjp(lambda *a: mapped(*a[:3], seg, a[3]),
                                     q, k, v, s)
    out, back = (vjp if eager else jax.jit(vjp))(*args, sinks)
    grads = back(dout)
  ref.assert_close(out, want, jnp.float32, "out")
  for name, x in zip(("q", "k", "v", "sinks"), grads):
    ref.assert_close(x, g[name], jnp.float32, "d" + name)


def _shared_kv():
  """The instances with every one's k, v and ids the first's; their
  reference; the mesh; k, v and the ids placed."""
  q, k, v, do, ids, sinks = _instances()
  k, v = jnp.repeat(k[:, :1], V, 1), jnp.repeat(v[:, :1], V, 1)
  ids = np.repeat(ids[:, :1], V, 1)
  want, g = _expected(q, k, v, do, ids, sinks, shared_kv=True)
  mesh = _mesh(jax.sharding.AxisType.Auto)
  put = lambda x, *spec: jax.device_put(jnp.asarray(x), NamedSharding(
      mesh, P("data", *spec)))
  return (q, do, sinks, want, g, mesh, put,
          [put(x[:, 0], "cp") for x in (k, v, ids)])


def test_vmap_of_grad_with_shared_keys():
  """The gradient mapped over queries (k, v shared, so each instance has
  its own dk, dv): the same numbers."""
  q, do, sinks, _, g, mesh, put, (k, v, seg) = _shared_kv()
  with jax.set_mesh(mesh):

    def loss(q, k, v, do):
      return jnp.sum(_attend(q, k, v, seg, sinks) * do)

    grad = jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), (1, None, None, 1),
                    out_axes=1)
    dq, dk, dv = jax.jit(grad)(put(q, None, "cp"), k, v, jnp.asarray(do))
  for name, x in (("q", dq), ("k", dk), ("v", dv)):
    ref.assert_close(x, g[name], jnp.float32, "d" + name)


# -m slow: one map, its operands at any axis, differentiated through, is
# test_vmap_folds_the_mapped_axis_into_the_batch's.
@pytest.mark.slow
def test_nested_maps_with_shared_keys():
  """A map inside a map (k, v shared): the same numbers."""
  q, _, sinks, want, _, mesh, _, (k, v, seg) = _shared_kv()
  with jax.set_mesh(mesh):
    nested = jax.vmap(jax.vmap(_attend, (0, None, None, None, None)),
                      (0, None, None, None, None))
    out = jax.jit(nested)(jnp.moveaxis(q, 1, 0)[None], k, v, seg, sinks)
  ref.assert_close(jnp.moveaxis(out[0], 0, 1), want, jnp.float32, "out")


def test_vmap_over_an_empty_axis():
  q, k, v, _, ids, sinks = _instances()
  mesh = _mesh(jax.sharding.AxisType.Auto)
  with jax.set_mesh(mesh):
    out = jax.jit(jax.vmap(_attend, (1, 1, 1, 1, None), out_axes=1))(
        q[:, :0], k[:, :0], v[:, :0], ids[:, :0], sinks)
  assert out.shape == (B, 0, S, N, H)


def test_forward_mode_is_refused_by_name():
  """jax.jvp and jax.jacfwd of a context-parallel call are a TypeError
  naming forward mode; jax.hessian (forward over reverse) a
  NotImplementedError naming the backward's primitive; each raised where
  the transform reaches the attention's differentiation rule (under
  ``jit``, before anything runs; docs/design.md, Transforms). The
  Jacobians are taken in a scale of the queries: a basis of one tangent,
  not one a query entry."""
  q, k, v, _, ids, sinks = _instances()
  mesh = _mesh(jax.sharding.AxisType.Auto)
  with jax.set_mesh(mesh):
    f = lambda q: _attend(q, k[:, 0], v[:, 0], ids[:, 0], sinks)
    scaled = lambda c: f(c * q[:, 0]).sum()
    with pytest.raises(TypeError, match="forward-mode"):
      jax.jvp(f, (q[:, 0],), (q[:, 0],))
    with pytest.raises(TypeError, match="forward-mode"):
      jax.jacfwd(scaled)(1.0)
    with pytest.raises(NotImplementedError, match="Differentiation rule"):
      jax.hessian(scaled)(1.0)
