"""Inputs at the edges of what the API takes, each exact against the float64
reference or refused with an error that names the argument: segment ids
spanning their whole dtype, empty sequences in ``explain``, device counts
that are not counts, NumPy ints and nested lists where ints and arrays are
documented, unbatched queries with their segment ids, layouts whose length
divides the devices but not twice, and stored dtypes that are not floats."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_ring
import jax_ring.flax as jrf
import reference as ref
from jax_ring import models

B, T, N, H = 1, 13, 4, 8  # T: padded inside the call on 4 devices


# The padding and its id are the API's, before any strategy
# (jax_ring/_src/padding.py): the default run takes the cheapest program
# (Ulysses); the ring and all-gather with -m slow.
@pytest.mark.parametrize("strategy", [
    pytest.param("ring", marks=pytest.mark.slow),
    pytest.param("all_gather", marks=pytest.mark.slow), "ulysses"])
def test_segment_ids_at_both_ends_of_int32(strategy):
  """Non-causal at a length the call pads: the padding's own id must be
  one no document has, though the ids hold int32's minimum and maximum."""
  lo, hi = np.iinfo(np.int32).min, np.iinfo(np.int32).max
  ids = np.array([[lo] * 5 + [hi] * 4 + [7] * 4], np.int32)
  q, k, v, dout = ref.random_qkv(0, B, T, T, N, N, H)[:4]
  mesh = jax.make_mesh((4,), ("cp",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  cpc = jax_ring.ContextParallel(axis="cp", strategy=strategy,
                                 load_balance=None)

  def loss(q, k, v):
    out = jax_ring.dot_product_attention(q, k, v, segment_ids=ids,
                                         context_parallel=cpc)
    return jnp.sum(out * dout), out

  with jax.set_mesh(mesh):
    (_, out), grads = jax.jit(jax.value_and_grad(
        loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  case = ref.Case(scale=H ** -0.5, q_segment_ids=ids, kv_segment_ids=ids)
  want, _, want_grads = ref.attention(q, k, v, case, dout=dout)
  ref.assert_close(out, want, jnp.float32, "out")
  for name, got in zip("qkv", grads):
    ref.assert_close(got, want_grads[name], jnp.float32, f"d{name}")


def test_unbatched_query_takes_unbatched_segment_ids():
  q, k, v = ref.random_qkv(1, 1, 8, 8, N, 2, H)[:3]
  ids = np.array([0, 0, 0, 1, 1, 1, 2, 2], np.int32)
  got = jax_ring.dot_product_attention(q[0], k[0], v[0], is_causal=True,
                                       segment_ids=ids)
  case = ref.Case(scale=H ** -0.5, is_causal=True, q_segment_ids=ids[None],
                  kv_segment_ids=ids[None])
  ref.assert_close(got[None], ref.attention(q, k, v, case)[0], jnp.float32)


def test_explain_of_no_tokens_says_so():
  choice = jax_ring.explain((1, 0, 4, 16), (1, 0, 4, 16), cp_size=2,
                            is_causal=True)
  assert (choice.forward, choice.backward) == ("none", "none")
  assert "no tokens" in choice.reason


@pytest.mark.parametrize("load_balance", ["striped", None])
def test_explain_takes_rows_that_divide_the_devices_not_twice(load_balance):
  ids = np.repeat(np.arange(3), 2)[None]  # 6 tokens on 2 devices
  cpc = jax_ring.ContextParallel(strategy="auto", load_balance=load_balance)
  choice = jax_ring.explain((1, 6, 4, 16), (1, 6, 4, 16), cp_size=2,
                            is_causal=True, segment_ids=ids,
                            context_parallel=cpc)
  balance = choice.defaults["balance"][0]
  assert "dual_chunk" not in balance and (
      load_balance or "contiguous") in balance, balance


@pytest.mark.parametrize("cp_size", [0, -2, 2.0, True])
def test_reorder_device_counts_that_are_not_counts(cp_size):
  x = jnp.arange(8)[None]
  for reorder in (jax_ring.reorder_for_load_balance,
                  jax_ring.reorder_from_load_balance):
    with pytest.raises(ValueError, match="cp_size must be a positive int"):
      reorder(x, cp_size)
  np.testing.assert_array_equal(  # NumPy ints are counts
      jax_ring.reorder_for_load_balance(x, np.int64(2)),
      jax_ring.reorder_for_load_balance(x, 2))


def test_kv_chunk_heads_is_checked_when_made():
  with pytest.raises(ValueError, match="kv_chunk_heads"):
    jax_ring.ContextParallel(kv_chunk_heads=0)


def test_layer_takes_numpy_ints_and_nested_list_positions():
  cfg = jrf.AttentionLayerConfig(embed_dim=np.int64(32),
                                 num_heads=np.int64(4),
                                 num_kv_heads=np.int32(2), head_dim=8)
  assert cfg == jrf.AttentionLayerConfig(embed_dim=32, num_heads=4,
                                         num_kv_heads=2, head_dim=8)
  layer = jrf.Attention(cfg, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (1, 4, 32))
  np.testing.assert_array_equal(layer(x, [[0, 1, 2, 3]]),
                                layer(x, jnp.arange(4)[None]))
  with pytest.raises(ValueError, match="positions must be an int array"):
    layer(x, [[0, 1], [2]])


def test_saving_to_an_integer_dtype_is_refused(tmp_path):
  # Refused before any weight is read: the model's shapes serve.
  model = nnx.eval_shape(lambda: models.Decoder(models.LlamaConfig(
      vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
      num_heads=2, num_kv_heads=1, head_dim=8), rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match="dtype must be a float dtype"):
    models.save_pretrained(model, tmp_path / "int8", dtype=np.int8)
  assert not (tmp_path / "int8").exists()


@pytest.mark.parametrize("skip, match", [
    (3, r"remat_skip must be an int in \[0, num_layers=2\]; got 3"),
    (-1, r"remat_skip must be an int"), (True, r"remat_skip must be an int"),
    (1, r"remat_skip=1 needs remat")])
def test_remat_skip_is_checked_when_made(skip, match):
  cfg = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=2,
             num_heads=2, num_kv_heads=1, head_dim=4)
  with pytest.raises(ValueError, match=match):
    models.DecoderConfig(**cfg, remat_skip=skip)
  assert models.DecoderConfig(**cfg, remat=True, remat_skip=2).remat_skip == 2
  # The scan counts whole groups over the blocks remat_skip leaves.
  seven = dict(cfg, num_layers=7, remat=True)
  assert [models.DecoderConfig(**seven, remat_skip=k).scanned_groups()
          for k in (0, 2, 5, 6)] == [7, 5, 2, 0]
  assert models.DecoderConfig(**seven, scan_layers=False).scanned_groups() == 0
