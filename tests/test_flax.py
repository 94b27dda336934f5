"""jax_ring.flax: the NNX attention layer against a float64 NumPy reference,
its context-parallel run against its single-device run, the LM batch
helpers, and the config validators."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_ring
import reference as ref
from jax_ring import flax as jrf

B, S, E, N, K, H = 2, 48, 32, 4, 2, 16  # S divisible by 2 * cp for cp = 4
CP, DP = 4, 2


def make_mesh():
  if len(jax.devices()) < DP * CP:
    pytest.skip(f"needs {DP * CP} devices")
  return Mesh(np.array(jax.devices()[:DP * CP]).reshape(DP, CP),
              ("data", "context"))


def layer_config(**kw):
  return jrf.AttentionLayerConfig(embed_dim=E, num_heads=kw.pop("n", N),
                                  num_kv_heads=kw.pop("k", K), head_dim=H,
                                  implementation="xla", **kw)


def inputs(seed, segments, shuffled_positions=False):
  x = jax.random.normal(jax.random.key(seed), (B, S, E), jnp.float32)
  ids = ref.random_segments(seed + 1, B, S, 4) if segments else None
  pos = (jrf.document_positions(ids) if segments else
         np.broadcast_to(np.arange(S, dtype=np.int32), (B, S)))
  if shuffled_positions:  # RoPE must read these, not the token index
    pos = np.random.default_rng(seed).permuted(pos, axis=1)
  return x, np.asarray(pos, np.int32), ids


# -- float64 reference of the layer -----------------------------------------


def rope64(x, pos, theta):
  """RoPE as a complex rotation of the pairs (x_i, x_{i + H/2}): written
  independently of the layer's sin/cos form."""
  h = x.shape[-1]
  freq = theta ** -(np.arange(0, h, 2, dtype=np.float64) / h)
  rot = np.exp(1j * pos[..., None, None].astype(np.float64) * freq)
  z = (x[..., :h // 2] + 1j * x[..., h // 2:]) * rot
  return np.concatenate([z.real, z.imag], axis=-1)


def layer64(layer, x, pos, ids):
  """The layer's forward in float64 NumPy, attention from tests/reference."""
  cfg = layer.config
  w = {n: np.asarray(getattr(layer, n)[...], np.float64)
       for n in ("wq", "wk", "wv", "wo")}
  x = np.asarray(x, np.float64)
  q = rope64(np.einsum("bse,enh->bsnh", x, w["wq"]), pos,
             cfg.rope_max_wavelength)
  k = rope64(np.einsum("bse,enh->bsnh", x, w["wk"]), pos,
             cfg.rope_max_wavelength)
  v = np.einsum("bse,enh->bsnh", x, w["wv"])
  case = ref.Case(cfg.head_dim**-0.5, is_causal=cfg.is_causal,
                  window=cfg.local_window_size, soft_cap=cfg.logits_soft_cap,
                  q_segment_ids=ids, kv_segment_ids=ids)
  out, _ = ref.attention(q, k, v, case)
  return np.einsum("bsnh,nhe->bse", out, w["wo"])


@pytest.mark.parametrize("kw, segments", [
    (dict(), False),
    (dict(shuffled_positions=True), False),
    (dict(), True),
    (dict(k=1), True),
    (dict(n=4, k=4), False),
    (dict(sliding_window=7), True),
    (dict(sliding_window=5, is_causal=False), False),
    (dict(logits_soft_cap=2.0), True),
], ids=["gqa_causal", "gqa_shuffled_positions", "gqa_packed", "mqa_packed",
        "mha", "window_packed", "window_bidirectional", "soft_cap_packed"])
@pytest.mark.sample(4)
def test_layer_matches_float64_reference(kw, segments):
  shuffled = kw.pop("shuffled_positions", False)
  layer = jrf.Attention(layer_config(**kw), rngs=nnx.Rngs(0))
  x, pos, ids = inputs(1, segments, shuffled)
  got = jax.jit(lambda x, p, i: layer(x, p, i))(x, pos, ids)
  ref.assert_close(got, layer64(layer, x, pos, ids), jnp.float32, "layer")


# -m slow: the packed layer against the float64 reference's segment mask is
# test_layer_matches_float64_reference[gqa_packed] (and [mqa_packed]).
@pytest.mark.slow
def test_packed_documents_equal_each_document_alone():
  """Packed documents: each document's output equals that document run
  alone. (RoPE attention depends only on position differences within a
  document, so restarting positions is a convention, not what this
  checks: the segment mask is.)"""
  layer = jrf.Attention(layer_config(), rngs=nnx.Rngs(2))
  x, pos, ids = inputs(3, True)
  packed = layer(x, pos, ids)
  row = ids[0]
  for d in np.unique(row):
    sel = np.flatnonzero(row == d)
    alone = layer(x[:1, sel], np.arange(sel.size)[None], None)
    np.testing.assert_allclose(packed[0, sel], alone[0], atol=2e-5)


def test_linen_bridge_gives_the_same_layer():
  """Linen users wrap the NNX layer with flax's bridge."""
  cfg = layer_config()
  linen_layer = nnx.bridge.to_linen(jrf.Attention, cfg)
  x, pos, ids = inputs(9, True)
  variables = linen_layer.init(jax.random.key(0), x, pos, ids)
  layer = jrf.Attention(cfg, rngs=nnx.Rngs(1))
  for name in ("wq", "wk", "wv", "wo"):
    getattr(layer, name)[...] = variables["params"][name]
  np.testing.assert_array_equal(linen_layer.apply(variables, x, pos, ids),
                                layer(x, pos, ids))


# -- context parallelism ----------------------------------------------------


COLLECTIVES = {"ring": ["collective-permute"], "all_gather": ["all-gather"],
               "ulysses": ["all-to-all"],
               "hybrid": ["all-to-all", "collective-permute"]}


def cp_setup(strategy, load_balance="dual_chunk"):
  """(mesh, ContextParallel, rules, token spec) for data=2 x 4 devices on
  the sequence: one context axis, or ring 2 x ulysses 2 for hybrid."""
  if len(jax.devices()) < DP * CP:
    pytest.skip(f"needs {DP * CP} devices")
  devices = np.array(jax.devices()[:DP * CP])
  if strategy == "hybrid":
    mesh = Mesh(devices.reshape(DP, 2, 2), ("data", "context", "ulysses"))
    axis, seq = ("ulysses", "context"), ("context", "ulysses")
  else:
    mesh = Mesh(devices.reshape(DP, CP), ("data", "context"))
    axis = seq = "context"
  cpc = jax_ring.ContextParallel(axis=axis, strategy=strategy,
                                 load_balance=load_balance, loop="scan",
                                 inputs="load_balanced")
  return mesh, cpc, jrf.logical_rules(length=seq), P("data", seq)


# The layer's sharding on one sequence axis (ring, with a window, soft cap
# and sinks) and on two (hybrid) in the default run; each strategy's masks
# and layouts are tested against the reference in its own module (the
# all-gather's windows and packed rows: test_all_gather.py). The other
# cases with -m slow (Ulysses in the layer: hybrid_packed's all-to-all).
@pytest.mark.parametrize("strategy, load_balance, kw, segments", [
    pytest.param("ring", "dual_chunk", dict(), False, marks=pytest.mark.slow),
    ("ring", "dual_chunk", dict(sliding_window=7, logits_soft_cap=2.0,
                                sinks=True), True),
    pytest.param("ring", "striped", dict(), True, marks=pytest.mark.slow),
    pytest.param("all_gather", "dual_chunk", dict(sliding_window=7), True,
                 marks=pytest.mark.slow),
    pytest.param("ulysses", "dual_chunk", dict(), True,
                 marks=pytest.mark.slow),
    ("hybrid", "dual_chunk", dict(), True),
    pytest.param("ring", "dual_chunk", dict(sinks=True, sliding_window=7),
                 True, marks=pytest.mark.slow),
], ids=["ring_causal", "ring_packed_window_cap_sinks", "ring_striped_packed",
        "all_gather_packed_window", "ulysses_packed", "hybrid_packed",
        "ring_packed_window_sinks"])
def test_context_parallel_layer_equals_single_device(strategy, load_balance,
                                                     kw, segments):
  """data=2 x 4 sequence devices: positions and segment ids in the
  load-balance layout give the natural-layout output and gradients."""
  mesh, cpc, rules, spec = cp_setup(strategy, load_balance)
  single = jrf.Attention(layer_config(**kw), rngs=nnx.Rngs(4))
  with jax.set_mesh(mesh):
    sharded = jrf.Attention(layer_config(
        context_parallel=cpc, rules=rules, **kw), rngs=nnx.Rngs(4))
  assert sharded.wq[...].sharding.spec == P(None, None, None)
  x, pos, ids = inputs(5, segments)
  dy = jax.random.normal(jax.random.key(6), (B, S, E), jnp.float32)

  def grads(layer):
    gdef, params = nnx.split(layer)

    @jax.jit
    def go(params, x, pos, ids, dy):
      apply = lambda p, x: nnx.merge(gdef, p)(x, pos, ids)
      out, vjp = jax.vjp(apply, params, x)
      return out, vjp(dy)

    return go, params

  go, params = grads(single)
  want_out, (want_dp, want_dx) = go(params, x, pos, ids, dy)

  n = jrf.reorder_size(cpc, mesh)
  re_ = lambda a: np.asarray(jax_ring.reorder_for_load_balance(
      a, n, layout=load_balance))
  un_ = lambda a: jax_ring.reorder_from_load_balance(a, n, layout=load_balance)
  tok = NamedSharding(mesh, spec)
  args = [jax.device_put(re_(a), tok) if a is not None else None
          for a in (x, pos, ids, dy)]
  with jax.set_mesh(mesh):
    go, params = grads(sharded)
    compiled = go.lower(params, *args).compile()
    out, (dp, dx) = compiled(params, *args)
  assert out.sharding.spec[:2] == tuple(spec)
  hlo = compiled.as_text()
  for collective in COLLECTIVES[strategy]:  # the strategy really ran
    assert collective in hlo, collective
  tol = jnp.float32
  ref.assert_close(un_(out), want_out, tol, "out")
  ref.assert_close(un_(dx), want_dx, tol, "dx")
  for name in ("wq", "wk", "wv", "wo") + (("sinks",) if "sinks" in kw else ()):
    ref.assert_close(dp[name][...], want_dp[name][...], tol, "d" + name)


# -- LM batches -------------------------------------------------------------


def test_lm_batch_positions_labels_and_loss_mask():
  tokens = np.array([[10, 11, 12, 13, 14, 15, 16, 17]])
  ids = np.array([[1, 1, 1, 2, 2, 2, 0, 0]])  # 0 = padding
  b = jrf.make_lm_batch(tokens, ids)
  np.testing.assert_array_equal(b.positions, [[0, 1, 2, 0, 1, 2, 0, 1]])
  np.testing.assert_array_equal(b.labels, [[11, 12, 13, 14, 15, 16, 17, 0]])
  # no loss at a document's last token, into or on padding, at the end
  np.testing.assert_array_equal(b.loss_mask, [[1, 1, 0, 1, 1, 0, 0, 0]])
  plain = jrf.make_lm_batch(np.array([[5, 6, 7, 0, 0]]), pad_id=0)
  np.testing.assert_array_equal(plain.positions, [[0, 1, 2, 3, 4]])
  np.testing.assert_array_equal(plain.loss_mask, [[1, 1, 0, 0, 0]])
  assert plain.segment_ids is None
  # supervised fine-tuning: only the responses (here 12, 15, 16) are targets
  sft = jrf.make_lm_batch(tokens, ids, targets=np.array(
      [[0, 0, 1, 0, 0, 1, 1, 0]], bool))
  np.testing.assert_array_equal(sft.loss_mask, [[0, 1, 0, 0, 1, 0, 0, 0]])


def test_ordered_documents_move_every_field_with_its_tokens():
  """``order_documents`` (and ``prepare_lm_batch(even_documents=True)``):
  one order of whole documents for every field, so each token keeps its
  position, label and loss mask, and each document stays one run."""
  mesh = make_mesh()
  ids = ref.random_segments(9, B, S, 6)
  tokens = np.arange(B * S).reshape(B, S)  # each token names its place
  natural = jrf.make_lm_batch(tokens, ids)
  got = jrf.order_documents(natural, CP)
  order = got.inputs - np.arange(B)[:, None] * S
  assert (np.sort(order, 1) == np.arange(S)).all()
  for name in ("inputs", "positions", "segment_ids", "labels", "loss_mask"):
    np.testing.assert_array_equal(getattr(got, name), np.take_along_axis(
        getattr(natural, name), order, 1), err_msg=name)
  runs = lambda x: (x[:, 1:] != x[:, :-1]).sum()
  assert runs(got.segment_ids) == runs(natural.segment_ids)
  cpc = jax_ring.ContextParallel(axis="context", load_balance=None)
  placed = jrf.prepare_lm_batch(tokens, ids, mesh=mesh,
                                spec=P("data", "context"),
                                context_parallel=cpc, even_documents=True)
  np.testing.assert_array_equal(np.asarray(placed.labels), got.labels)
  with pytest.raises(ValueError, match="even_documents=True orders documents "
                     "for contiguous shards"):
    jrf.prepare_lm_batch(tokens, ids, mesh=mesh, spec=P("data", "context"),
                         context_parallel=jax_ring.ContextParallel(
                             axis="context"), even_documents=True)


def test_prepared_batch_is_one_permutation_sharded_on_the_mesh():
  mesh = make_mesh()
  rng = np.random.default_rng(7)
  tokens = rng.integers(0, 256, (B, S))
  ids = ref.random_segments(8, B, S, 3)
  natural = jrf.make_lm_batch(tokens, ids)
  cpc = jax_ring.ContextParallel(axis="context", load_balance="dual_chunk",
                                 inputs="load_balanced")
  got = jrf.prepare_lm_batch(tokens, ids, mesh=mesh, spec=P("data", "context"),
                             context_parallel=cpc)
  for name in ("inputs", "positions", "segment_ids", "labels", "loss_mask"):
    arr = getattr(got, name)
    assert arr.sharding.spec == P("data", "context"), name
    back = jax_ring.reorder_from_load_balance(arr, CP)
    np.testing.assert_array_equal(back, getattr(natural, name), err_msg=name)
  # Device (data 0, context r) holds chunks r and 2*CP-1-r of the sequence:
  # check through the global index each label position came from.
  idx = jrf.prepare_lm_batch(np.broadcast_to(np.arange(S), (B, S)), mesh=mesh,
                             spec=P("data", "context"),
                             context_parallel=cpc).inputs
  chunk, rows = S // (2 * CP), B // DP
  for shard in idx.addressable_shards:
    (d, r), = np.argwhere(mesh.devices == shard.device)
    want = np.concatenate([np.arange(r * chunk, (r + 1) * chunk),
                           np.arange((2 * CP - 1 - r) * chunk,
                                     (2 * CP - r) * chunk)])
    np.testing.assert_array_equal(np.asarray(shard.data),
                                  np.broadcast_to(want, (rows, 2 * chunk)))


# -- validators -------------------------------------------------------------


@pytest.mark.parametrize("kw, message", [
    (dict(n=6, k=4), "num_heads (6) must be divisible by num_kv_heads (4)"),
    (dict(sliding_window=0), "sliding_window must be None or an int >= 1; "
     "got 0"),
    (dict(rules=(("batch", "data"),)), "rules must map every logical axis of "
     "the layer ('batch', 'length', 'heads', 'kv_heads', 'head_dim', "
     "'embed'); missing ['length', 'heads', 'kv_heads', 'head_dim', 'embed']"),
    (dict(rules=jrf.logical_rules(length="seq"),
          context_parallel=jax_ring.ContextParallel(axis="context")),
     "rules map 'length' to 'seq' but context_parallel.axis is 'context'"),
    (dict(param_rules=jrf.logical_rules()),
     "param_rules needs rules (the activations' sharding)"),
    (dict(rules=jrf.logical_rules(), param_rules=(("embed", "data"),)),
     "param_rules must map every logical axis of the layer"),
    (dict(rules=jrf.logical_rules(), param_rules=()),
     "param_rules must map every logical axis of the layer"),
])
def test_config_errors(kw, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    layer_config(**kw)


def test_odd_head_dim_error():
  with pytest.raises(ValueError, match=re.escape(
      "head_dim must be even for RoPE; got 15")):
    jrf.AttentionLayerConfig(embed_dim=8, num_heads=2, num_kv_heads=1,
                             head_dim=15)


@pytest.mark.parametrize("x_shape, positions, message", [
    ((2, 10, 16), np.zeros((2, 10), np.int32), "x must be (B, S, "
     "embed_dim=32); got (2, 10, 16)"),
    ((2, 10, 32), np.zeros((2, 9), np.int32), "positions must be an int "
     "array of x's (B, S) = (2, 10); got int32 (2, 9)"),
    ((2, 10, 32), np.zeros((2, 10), np.float32), "positions must be an int "
     "array of x's (B, S) = (2, 10); got float32 (2, 10)"),
])
def test_the_layers_inputs_are_named(x_shape, positions, message):
  layer = jrf.Attention(jrf.AttentionLayerConfig(
      embed_dim=32, num_heads=4, num_kv_heads=2, head_dim=8),
      rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=re.escape(
      "jax_ring.flax.Attention: " + message)):
    layer(jnp.ones(x_shape), positions)
