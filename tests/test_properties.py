"""Property tests against the float64 reference: random shapes, tiles and
masks of the block kernel, random calls of the public API, and random
calls of the strategies inside shard_map, on the simulated devices."""

import dataclasses

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from jax.sharding import PartitionSpec as P

import jax_ring
import reference as ref
from helpers import (check_kernel, check_public_call, document_ids,
                     layout_vjp, mesh)


@st.composite
def problems(draw):
  b = draw(st.integers(1, 2))
  t, s = draw(st.integers(1, 33)), draw(st.integers(1, 33))
  kh, g = draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 3]))
  h = draw(st.sampled_from([8, 16]))
  case = ref.Case(
      scale=draw(st.floats(0.05, 1.0)),
      is_causal=draw(st.booleans()),
      window=draw(st.none() | st.tuples(st.integers(0, 12),
                                        st.integers(0, 12))),
      soft_cap=draw(st.none() | st.floats(1.0, 20.0)),
      q_offset=draw(st.integers(0, 20)), kv_offset=draw(st.integers(0, 20)))
  if draw(st.booleans()):
    nseg = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**16))
    case = dataclasses.replace(
        case, q_segment_ids=ref.random_segments(seed, b, t, nseg),
        kv_segment_ids=ref.random_segments(seed + 1, b, s, nseg))
  tiles = dict(block_q=draw(st.integers(1, 40)),
               block_kv=draw(st.integers(1, 40)))
  return (b, t, s, kh * g, kh, h), case, tiles, draw(st.integers(0, 2**16))


def _matches_reference(problem):
  shape, case, tiles, seed = problem
  q, k, v, do = ref.random_qkv(seed, *shape[:3], *shape[3:], jnp.float32)
  check_kernel(q, k, v, do, case, **tiles)


def _examples(n):
  """``n`` random problems; each is a fresh compile (2-3 s here)."""
  return settings(max_examples=n, deadline=None,
                  suppress_health_check=[HealthCheck.too_slow])


# Two in the default run (each a compile; the fixed mask and tile cases:
# test_kernel.py), sixty with -m slow.
test_random_problems_match_reference = _examples(2)(
    given(problems())(_matches_reference))
test_many_random_problems_match_reference = pytest.mark.slow(_examples(60)(
    given(problems())(_matches_reference)))


# -- random calls of the public API on the simulated mesh ------------------

# Each strategy's layouts (hybrid: its default alone).
LAYOUTS = {"ring": ("dual_chunk", "striped", None),
           "all_gather": ("dual_chunk", None),
           "ulysses": ("dual_chunk", "striped", None),
           "auto": ("dual_chunk", "striped", None)}


@st.composite
def public_calls(draw):
  """A call the API serves: strategy, its options and mesh, heads, value
  head dims, odd lengths (T != S where Ulysses serves it), documents,
  masks, sinks."""
  strategy = draw(st.sampled_from(
      ["ring", "all_gather", "ulysses", "hybrid", "auto"]))
  n, kh = draw(st.sampled_from([(8, 2), (8, 8), (8, 4)]))
  if strategy == "hybrid":
    mesh_shape, names = draw(st.sampled_from([(2, 2), (2, 4), (4, 2)])), (
        "u", "r")
  else:
    mesh_shape, names = (draw(st.sampled_from([2, 4, 8])),), ("cp",)
  opts = {}
  if strategy in LAYOUTS:
    opts["load_balance"] = draw(st.sampled_from(LAYOUTS[strategy]))
  if strategy == "ring":
    opts["loop"] = draw(st.sampled_from(["scan", "unrolled"]))
    opts["kv_sends"] = draw(st.sampled_from([None, "gather", "neighbour"]))
  t = draw(st.integers(3, 70))
  s = t
  if strategy in ("ulysses", "auto") and draw(st.booleans()):
    s = draw(st.integers(3, 70))
  docs = draw(st.sampled_from([None, 1, 2, 5, 17, t])) if s == t else None
  causal = draw(st.booleans())
  kw = dict(is_causal=causal, eager=draw(st.integers(0, 5)) == 0,
            pair=docs is not None and draw(st.booleans()))
  if draw(st.booleans()):
    kw["local_window_size"] = (draw(st.integers(0, 12)),
                               0 if causal else draw(st.integers(0, 12)))
  if draw(st.booleans()):
    kw["sinks"] = jnp.linspace(-1.0, 1.0, n, dtype=jnp.float32)
  if docs is None and draw(st.booleans()):
    kw["key_value_seq_lengths"] = jnp.asarray(
        [draw(st.integers(1, s)) for _ in range(2)], jnp.int32)
  cpc = jax_ring.ContextParallel(
      axis=names if strategy == "hybrid" else "cp", strategy=strategy,
      **opts)
  h = draw(st.sampled_from([8, 16]))
  shape = (2, n, kh, h, draw(st.sampled_from([h, h, 12])))  # Hv
  return cpc, mesh_shape, names, shape, (t, s, docs,
                                         draw(st.integers(0, 999)), kw)


@pytest.mark.slow
@_examples(40)
@given(public_calls())
def test_random_public_calls_match_reference(call):
  """Forward and gradients of random calls (every strategy, layout and
  loop; odd lengths; documents; windows, sinks, key lengths; eager or
  jitted) against the float64 reference on the simulated devices."""
  cpc, mesh_shape, names, shape, (t, s, docs, seed, kw) = call
  grid = jax.make_mesh(mesh_shape, names,
                       axis_types=(jax.sharding.AxisType.Auto,) * len(names),
                       devices=jax.devices()[:int(np.prod(mesh_shape))])
  check_public_call(cpc, grid, shape, t=t, s=s, docs=docs, seed=seed, **kw)


# -- random calls of the strategies inside a user's shard_map --------------

SHARD_MAP = {"ring": jax_ring.ring_attention,
             "all_gather": jax_ring.all_gather_attention,
             "ulysses": jax_ring.ulysses_attention}


@st.composite
def shard_map_calls(draw):
  """A strategy's call on local shards: layout, loop and sends, heads,
  value head dims, lengths the layout divides, documents or query and key
  lengths, windows, soft caps, scales, sinks."""
  name = draw(st.sampled_from(sorted(SHARD_MAP)))
  cp = draw(st.sampled_from([2, 4, 8]))
  lb = draw(st.sampled_from(LAYOUTS[name]))
  t = (2 * cp if lb == "dual_chunk" else cp) * draw(st.integers(1, 5))
  n, kh = draw(st.sampled_from([(8, 2), (8, 8), (8, 4)]))
  h = draw(st.sampled_from([8, 16]))
  shape = (draw(st.integers(1, 2)), n, kh, h, draw(st.sampled_from([h, 12])))
  causal = draw(st.booleans())
  kw = dict(is_causal=causal, scale=draw(st.sampled_from([None, 0.3])),
            logits_soft_cap=draw(st.sampled_from([None, 5.0])))
  if name == "ring":
    kw["loop"] = draw(st.sampled_from(["scan", "unrolled"]))
    kw["kv_sends"] = draw(st.sampled_from([None, "gather", "neighbour"]))
  if name == "all_gather" and draw(st.booleans()):
    kw["kv_chunk_heads"] = 1
  if draw(st.booleans()):
    kw["local_window_size"] = (draw(st.integers(0, 10)),
                               0 if causal else draw(st.integers(0, 10)))
  if draw(st.booleans()):
    kw["sinks"] = jnp.linspace(-1.0, 1.0, n, dtype=jnp.float32)
  docs = draw(st.sampled_from([None, None, 1, 3, 7, t]))
  if docs is None and draw(st.booleans()):
    for side in ("query_seq_lengths", "key_value_seq_lengths"):
      kw[side] = jnp.asarray(
          [draw(st.integers(1, t)) for _ in range(shape[0])], jnp.int32)
  return name, cp, lb, shape, t, docs, draw(st.integers(0, 999)), kw


@pytest.mark.slow
@_examples(40)
@given(shard_map_calls())
def test_random_shard_map_calls_match_reference(call):
  """Forward and gradients of the strategies inside ``shard_map`` on
  inputs in their layout, against the float64 reference."""
  name, cp, lb, (b, n, kh, h, hv), t, docs, seed, kw = call
  q, k, v, do = ref.random_qkv(seed, b, t, t, n, kh, h, hv=hv)
  ids = document_ids(seed, b, t, docs)
  case = ref.Case(
      kw["scale"] or h**-0.5, is_causal=kw["is_causal"],
      window=kw.get("local_window_size"), soft_cap=kw["logits_soft_cap"],
      q_segment_ids=ids, kv_segment_ids=ids,
      q_lengths=kw.get("query_seq_lengths"),
      kv_lengths=kw.get("key_value_seq_lengths"))
  want, _, g = ref.attention(q, k, v, case, dout=do, sinks=kw.get("sinks"))
  spec, extra = P(None, "cp"), () if ids is None else (jnp.asarray(ids),)
  f = jax.shard_map(
      lambda q, k, v, *ids: SHARD_MAP[name](
          q, k, v, axis_name="cp", load_balance=lb, implementation="xla",
          segment_ids=ids[0] if ids else None, **kw),
      mesh=mesh(cp), in_specs=(spec,) * (3 + len(extra)),
      out_specs=spec)
  out, grads = layout_vjp(f, cp, lb, q, k, v, do, *extra)
  ref.assert_close(out, want, jnp.float32, "out")
  for x, key in zip(grads, "qkv"):
    ref.assert_close(x, g[key], jnp.float32, "d" + key)
