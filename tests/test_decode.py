"""``decode_attention``: new tokens against a cache masked by position, on
one device and with the cache split over a mesh axis (inside shard_map and
on global arrays under jit), against the float64 reference with the same
visibility written as a dense mask; what moves; bad inputs by name."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_ring
import reference as ref
from helpers import collectives, mesh

B, T, C, N, K, H, HV = 2, 3, 32, 4, 2, 16, 8
RNG = np.random.default_rng(0)
# The cache in no particular order: row 0 holds positions 0..19 and 12 empty
# slots, row 1 positions 0..31; the new tokens follow.
KV_POS = np.stack([RNG.permutation(C) for _ in range(B)]).astype(np.int32)
KV_POS[0, KV_POS[0] >= 20] = -1
Q_POS = np.array([[20, 21, 22], [32, 33, 34]], np.int32)
SINKS = np.array([0.5, -1.0, 1.5, 0.0], np.float32)
CASES = {  # name -> (decode_attention options, window)
    "causal": (dict(), None),
    "window_cap_sinks": (dict(local_window_size=(5, 0), logits_soft_cap=2.0,
                              sinks=SINKS), (5, 0)),
}


def expected(q, k, v, kw, window, q_pos=Q_POS):
  d = KV_POS[:, None, :] - q_pos[:, :, None]
  vis = (KV_POS[:, None, :] >= 0) & (d <= 0)
  if window:
    vis &= d >= -window[0]
  case = ref.Case(H**-0.5, dense=vis[:, None],
                  soft_cap=kw.get("logits_soft_cap"))
  return ref.attention(q, k, v, case, sinks=kw.get("sinks"))[0]


def call(q, k, v, kw, **more):
  return jax_ring.decode_attention(q, k, v, query_positions=Q_POS,
                                   key_positions=KV_POS, **kw, **more)


@pytest.mark.parametrize("name", list(CASES))
def test_one_device_matches_reference(name):
  kw, window = CASES[name]
  q, k, v, _ = ref.random_qkv(1, B, T, C, N, K, H, hv=HV)
  ref.assert_close(call(q, k, v, kw), expected(q, k, v, kw, window),
                   jnp.float32)


def test_bfloat16_cache():
  """16-bit operands, float32 softmax (on XLA:CPU, which has no 16-bit
  batched product into float32, the operands are widened)."""
  q, k, v, _ = ref.random_qkv(7, B, T, C, N, K, H, jnp.bfloat16, hv=HV)
  out = call(q, k, v, {})
  assert out.dtype == jnp.bfloat16
  ref.assert_close(out, expected(q, k, v, {}, None), jnp.bfloat16)


def test_no_visible_slot_is_zero_and_nan_propagates():
  q, k, v, _ = ref.random_qkv(2, B, T, C, N, K, H, hv=HV)
  out = jax_ring.decode_attention(
      q.at[1, 0, 2, 0].set(jnp.nan), k, v, key_positions=KV_POS,
      query_positions=np.array([[-5, 21, 22], [32, 33, 34]], np.int32))
  np.testing.assert_array_equal(np.asarray(out[0, 0]), 0.0)
  nan = np.isnan(np.asarray(out))
  assert nan[1, 0, 2].all() and nan.sum() == HV


# "causal" alone with -m slow: window_cap_sinks is causal too (and
# test_kv_head_major_cache_is_the_same_attention splits its cache so).
@pytest.mark.parametrize("name", [
    pytest.param("causal", marks=pytest.mark.slow), "window_cap_sinks"])
def test_cache_split_inside_shard_map(name):
  """Rank-coded shards of the cache over 4 devices: each attends to its
  slots, and the parts merge into the one-device result."""
  kw, window = CASES[name]
  q, k, v, _ = ref.random_qkv(3, B, T, C, N, K, H, hv=HV)
  code = ref.shard_code(C, 4)
  k, v = k - code, v + code
  cache = P(None, "cp")
  f = jax.jit(jax.shard_map(
      lambda q, k, v, kp: jax_ring.decode_attention(
          q, k, v, query_positions=Q_POS, key_positions=kp, axis_name="cp",
          **kw),
      mesh=mesh(4), in_specs=(P(), cache, cache, cache), out_specs=P()))
  ref.assert_close(f(q, k, v, KV_POS), expected(q, k, v, kw, window),
                   jnp.float32)


# Causal: each operation of the eager call is a program of its own (the
# window, soft cap and sinks on a split cache, against the reference:
# test_cache_split_inside_shard_map[window_cap_sinks]).
@pytest.mark.parametrize("cp", [4, 1])
def test_context_parallel_under_jit_and_eagerly_moves_no_kv(cp):
  """A data x cp mesh: the cache's slots over cp, the batch over data;
  the same numbers eagerly and under jit, and a program whose only
  collectives are the merge's reductions (none where cp is 1)."""
  kw, window = CASES["causal"]
  q, k, v, _ = ref.random_qkv(4, B, T, C, N, K, H, hv=HV)
  m = jax.make_mesh((2, cp), ("data", "cp"), devices=jax.devices()[:2 * cp],
                    axis_types=(jax.sharding.AxisType.Auto,) * 2)
  cpc = jax_ring.ContextParallel(axis="cp")
  f = lambda q, k, v, kp: jax_ring.decode_attention(
      q, k, v, query_positions=Q_POS, key_positions=kp, context_parallel=cpc,
      **kw)
  with jax.set_mesh(m):
    k, v, kv_pos = (jax.device_put(x, NamedSharding(m, P("data", "cp")))
                    for x in (k, v, KV_POS))
    jitted = jax.jit(f)
    out = jitted(q, k, v, kv_pos)
    np.testing.assert_array_equal(np.asarray(f(q, k, v, kv_pos)),
                                  np.asarray(out))
    hlo = jitted.lower(q, k, v, kv_pos).compile().as_text()
  ref.assert_close(out, expected(q, k, v, kw, window), jnp.float32)
  moved = collectives(hlo)
  assert moved["all-reduce"] == (cp > 1), moved  # the merge, once
  assert not any(moved[op] for op in ("all-gather", "collective-permute",
                                      "all-to-all")), moved


def test_large_rows_merge_by_two_reductions():
  """Parts of more than ``GATHER_BYTES`` over the devices (8 rows x 64
  heads of 128 values, 4 devices) merge by a max- and a sum-all-reduce of
  one part's size, not one all-reduce of every device's; the same
  attention as the reference and as one device."""
  b, n, hv = 8, 64, 128
  rng = np.random.default_rng(12)
  kv_pos = np.stack([rng.permutation(C) for _ in range(b)]).astype(np.int32)
  q_pos = np.full((b, 1), C, np.int32)
  q, k, v, _ = ref.random_qkv(12, b, 1, C, n, 8, H, hv=hv)
  kw = dict(query_positions=q_pos, sinks=np.linspace(-1, 1, n))
  one = jax.jit(lambda q, k, v: jax_ring.decode_attention(
      q, k, v, key_positions=kv_pos, **kw))(q, k, v)
  m = mesh(4)
  with jax.set_mesh(m):
    k, v, kp = (jax.device_put(x, NamedSharding(m, P(None, "cp")))
                for x in (k, v, kv_pos))
    f = jax.jit(lambda q, k, v, kp: jax_ring.decode_attention(
        q, k, v, key_positions=kp,
        context_parallel=jax_ring.ContextParallel(axis="cp"), **kw))
    split = f(q, k, v, kp)
    moved = collectives(f.lower(q, k, v, kp).compile().as_text())
  assert moved["all-reduce"] == 2 and moved["all-gather"] == 0, moved
  want = ref.attention(q, k, v, ref.Case(H**-0.5, dense=np.ones(
      (b, 1, 1, C), bool)), sinks=kw["sinks"])[0]  # every slot is seen
  ref.assert_close(split, want, jnp.float32)
  ref.assert_close(one, want, jnp.float32, "one device")


@pytest.mark.parametrize("kw, message", [
    (dict(query_positions=np.zeros((B, T + 1), np.int32)),
     "query_positions must be an int array of shape (2, 3); got int32 (2, 4)"),
    (dict(key_positions=np.zeros((B, C), np.float32)),
     "key_positions must be an int array of shape (2, 32); got float32"),
    (dict(axis_name="cp", context_parallel=jax_ring.ContextParallel()),
     "decode_attention takes axis_name (inside shard_map) or "
     "context_parallel"),
    (dict(query_positions=np.full((B, T), 2**32 - 1, np.int64)),
     "query_positions must fit in int32; got 4294967295..4294967295"),
])
def test_bad_inputs_are_named(kw, message):
  q, k, v, _ = ref.random_qkv(5, B, T, C, N, K, H, hv=HV)
  args = dict(query_positions=Q_POS, key_positions=KV_POS) | kw
  with pytest.raises(ValueError, match="^" + re.escape(message)):
    jax_ring.decode_attention(q, k, v, **args)


def test_a_cache_that_does_not_divide_over_the_axis_is_named():
  q, k, v, _ = ref.random_qkv(6, B, T, 30, N, K, H)
  m = jax.make_mesh((8,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,))
  with jax.set_mesh(m), pytest.raises(ValueError, match=re.escape(
      "decode_attention: the cache's slots, key (2, 30, 2, 16), must divide "
      "over the 'cp' axis of size 8")):
    jax_ring.decode_attention(
        q, k, v, query_positions=Q_POS, key_positions=KV_POS[:, :30],
        context_parallel=jax_ring.ContextParallel(axis="cp"))


def test_kv_head_major_cache_is_the_same_attention():
  """``kv_layout="bksh"``: the cache as (B, K, C, H), on one device and
  split over 4 devices inside shard_map; also a bad layout by name."""
  kw, window = CASES["window_cap_sinks"]
  q, k, v, _ = ref.random_qkv(8, B, T, C, N, K, H, hv=HV)
  want = expected(q, k, v, kw, window)
  km, vm = (jnp.swapaxes(x, 1, 2) for x in (k, v))
  ref.assert_close(call(q, km, vm, kw, kv_layout="bksh"), want, jnp.float32)
  cache = P(None, None, "cp")
  f = jax.jit(jax.shard_map(
      lambda q, k, v, kp: jax_ring.decode_attention(
          q, k, v, query_positions=Q_POS, key_positions=kp, axis_name="cp",
          kv_layout="bksh", **kw),
      mesh=mesh(4), in_specs=(P(), cache, cache, P(None, "cp")),
      out_specs=P()))
  ref.assert_close(f(q, km, vm, KV_POS), want, jnp.float32)
  with pytest.raises(ValueError, match="^kv_layout must be 'bskh' or 'bksh'"):
    call(q, k, v, kw, kv_layout="bhsd")


def test_two_sided_window_without_causality_and_empty_sizes():
  """A window (2, 3) with no causal mask; an empty cache (C = 0: zeros)
  and no new tokens (T = 0: an empty output)."""
  q, k, v, _ = ref.random_qkv(9, B, T, C, N, K, H, hv=HV)
  out = call(q, k, v, dict(is_causal=False, local_window_size=(2, 3)))
  d = KV_POS[:, None, :] - Q_POS[:, :, None]
  vis = (KV_POS[:, None, :] >= 0) & (d >= -2) & (d <= 3)
  want = ref.attention(q, k, v, ref.Case(H**-0.5, dense=vis[:, None]))[0]
  ref.assert_close(out, want, jnp.float32)
  empty = jax_ring.decode_attention(q, k[:, :0], v[:, :0],
                                    query_positions=Q_POS,
                                    key_positions=KV_POS[:, :0])
  np.testing.assert_array_equal(np.asarray(empty), 0.0)
  # A side wider than int32 positions bound nothing: no window.
  wide = call(q, k, v, dict(is_causal=False, local_window_size=2**40))
  np.testing.assert_array_equal(np.asarray(wide), np.asarray(
      call(q, k, v, dict(is_causal=False))))
  none = jax_ring.decode_attention(q[:, :0], k, v,
                                   query_positions=Q_POS[:, :0],
                                   key_positions=KV_POS)
  assert none.shape == (B, 0, N, HV)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs GPUs")
@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_bfloat16_cache_over_every_gpu_matches_reference(implementation):
  """A bfloat16 cache of 8k slots a row in no particular order, split over
  every GPU of the machine (``context_parallel`` under jit), with a window,
  soft cap and sinks: the float64 reference, and the one-GPU call to
  bfloat16's rounding; each implementation (the Pallas kernel on a
  kv-head-major cache)."""
  gpus, c, t = jax.device_count(), 8192, 2
  rng = np.random.default_rng(10)
  kv_pos = np.stack([rng.permutation(c) for _ in range(B)]).astype(np.int32)
  kv_pos[0, kv_pos[0] >= c - 700] = -1  # row 0: 700 empty slots
  q_pos = np.array([[c - 700, c - 699], [c, c + 1]], np.int32)
  kw = dict(local_window_size=(3000, 0), logits_soft_cap=20.0,
            sinks=SINKS)
  q, k, v, _ = ref.random_qkv(11, B, t, c, N, K, 128, jnp.bfloat16, hv=64)
  code = ref.shard_code(c, gpus)
  k, v = (k - code).astype(jnp.bfloat16), (v + code).astype(jnp.bfloat16)
  d = kv_pos[:, None, :] - q_pos[:, :, None]
  vis = (kv_pos[:, None, :] >= 0) & (d <= 0) & (d >= -3000)
  want = ref.attention(q, k, v, ref.Case(128**-0.5, dense=vis[:, None],
                                         soft_cap=20.0), sinks=SINKS)[0]
  slots = P(None, "cp")
  if implementation == "pallas":
    k, v = (jnp.swapaxes(x, 1, 2) for x in (k, v))
    kw.update(kv_layout="bksh", implementation="pallas")
    slots = P(None, None, "cp")
  one = jax_ring.decode_attention(q, k, v, query_positions=q_pos,
                                  key_positions=kv_pos, **kw)
  m = jax.make_mesh((gpus,), ("cp",),
                    axis_types=(jax.sharding.AxisType.Auto,))
  cpc = jax_ring.ContextParallel(axis="cp")
  with jax.set_mesh(m):
    k, v = (jax.device_put(x, NamedSharding(m, slots)) for x in (k, v))
    kv_pos = jax.device_put(kv_pos, NamedSharding(m, P(None, "cp")))
    f = jax.jit(lambda q, k, v, kp: jax_ring.decode_attention(
        q, k, v, query_positions=q_pos, key_positions=kp,
        context_parallel=cpc, **kw))
    split = f(q, k, v, kv_pos)
    assert collectives(f.lower(q, k, v, kv_pos).compile().as_text())[
        "all-reduce"] == (gpus > 1)
  ref.assert_close(one, want, jnp.bfloat16, "one GPU")
  ref.assert_close(split, want, jnp.bfloat16, f"{gpus} GPUs")
  ref.assert_close(split, np.asarray(one, np.float32), jnp.bfloat16,
                   "against one GPU")


def test_positions_past_int32_are_refused_on_the_device_too():
  """With jax_enable_x64, int64 positions on the device (not only host
  arrays) past int32 are named rather than wrapped (which gave zeros); a
  traced int64 array under jit is refused by its dtype."""
  q, k, v, _ = ref.random_qkv(12, B, T, C, N, K, H, hv=HV)
  with jax.enable_x64(True):
    far = jnp.asarray(Q_POS, jnp.int64) + 2**31
    assert far.dtype == jnp.int64
    with pytest.raises(ValueError, match=re.escape(
        "query_positions must fit in int32; got 2147483668..2147483682")):
      jax_ring.decode_attention(q, k, v, query_positions=far,
                                key_positions=KV_POS)
    with pytest.raises(ValueError, match=re.escape(
        "query_positions must be int32 under jit")):
      jax.jit(lambda p: jax_ring.decode_attention(
          q, k, v, query_positions=p, key_positions=KV_POS))(
              jnp.asarray(Q_POS, jnp.int64))


def test_gradient_through_a_split_cache_equals_one_device():
  """``jax.grad`` of ``decode_attention`` with the cache over 4 devices
  (the merge's max is a shift that cancels: its gradient is stopped), for
  q, k, v and the sinks, against one device."""
  kw, _ = CASES["window_cap_sinks"]
  q, k, v, _ = ref.random_qkv(13, B, T, C, N, K, H, hv=HV)
  m = jax.make_mesh((4,), ("cp",), devices=jax.devices()[:4],
                    axis_types=(jax.sharding.AxisType.Auto,))
  cpc = jax_ring.ContextParallel(axis="cp")
  loss = lambda cp: lambda q, k, v, s: (jax_ring.decode_attention(
      q, k, v, query_positions=Q_POS, key_positions=KV_POS, sinks=s,
      context_parallel=cp, **{a: b for a, b in kw.items() if a != "sinks"})
                                       ** 2).sum()
  want = jax.jit(jax.grad(loss(None), argnums=(0, 1, 2, 3)))(q, k, v, SINKS)
  with jax.set_mesh(m):
    got = jax.jit(jax.grad(loss(cpc), argnums=(0, 1, 2, 3)))(q, k, v, SINKS)
  for name, a, b in zip(("q", "k", "v", "sinks"), got, want):
    ref.assert_close(a, b, jnp.float32, "d" + name)
